"""The engine's options are declared once, in the library (``kvferry::engine::
EngineOptions``): ``kvferry.Engine``'s keywords must be exactly those options (plus
``directory``, which the package splits into a static map or ``etcd``), with the
library's defaults, each documented; a bad value is refused once, naming it."""

from __future__ import annotations

import inspect

import pytest

import kvferry
from kvferry import _kvferry

# Keywords of kvferry.Engine that are not library options, and why.
PACKAGE_ONLY = {"self", "directory"}  # directory: a {name: addr} map, or "etcd://…" → etcd
# Library options that kvferry.Engine spells through another keyword.
NOT_A_KEYWORD = {"etcd"}  # given as directory="etcd://…"


def engine_keywords() -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(kvferry.Engine.__init__).parameters)


def test_every_engine_keyword_is_a_library_option_with_its_default() -> None:
    defaults = _kvferry.EngineOptions.defaults()
    keywords = engine_keywords()
    names = set(keywords) - PACKAGE_ONLY
    assert names == set(defaults) - NOT_A_KEYWORD, (
        "keywords without an option:",
        sorted(names - set(defaults)),
        "options without a keyword:",
        sorted(set(defaults) - NOT_A_KEYWORD - names),
    )
    for name in names:
        assert keywords[name].default == defaults[name], (name, keywords[name].default, defaults[name])


def test_every_option_is_documented_in_the_engine_docstring() -> None:
    doc = kvferry.Engine.__doc__ or ""
    missing = [n for n in _kvferry.EngineOptions.defaults() if n not in NOT_A_KEYWORD and n not in doc]
    assert not missing, missing


def test_an_unknown_option_or_a_wrong_type_is_refused_by_name() -> None:
    with pytest.raises(kvferry.InvalidArgumentError, match="io_timeot"):
        _kvferry.EngineOptions(io_timeot=1.0)
    with pytest.raises(kvferry.InvalidArgumentError, match="seconds"):
        _kvferry.EngineOptions(io_timeout=-1.0)
    o = _kvferry.EngineOptions(io_timeout=2, secret=b"k", ttl=3.0)
    d = o.as_dict()
    assert d["io_timeout"] == 2.0 and d["ttl"] == 3.0 and d["max_ttl"] is None
    assert "k" not in repr(o) and d["secret"] != b"k"


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"wait_spin_us": 1_000_001}, "wait_spin_us"),
        ({"runtime_threads": 0}, "runtime_threads"),
        ({"copy_threads": 0}, "copy_threads"),
        ({"device": "tpu"}, "device"),
        ({"role": "leader"}, "role"),
        ({"lease_ttl": 0.0}, "lease_ttl"),
        ({"arena_bytes": 1000}, "arena_bytes"),
    ],
)
def test_a_bad_value_is_refused_once_naming_it(kwargs: dict[str, object], named: str) -> None:
    with pytest.raises(kvferry.InvalidArgumentError, match=named):
        kvferry.Engine(listen=None, **kwargs)  # type: ignore[arg-type]


def test_serving_options_reach_the_engine() -> None:
    # Options that only the command had before: now every front end has them.
    with kvferry.Engine(max_gets=3, peer_quota_pages=5, max_bulk_bytes=8 << 20, lease_grace=0.0) as e:
        assert e.address is not None
    with pytest.raises(kvferry.InvalidArgumentError, match="TTL"):
        kvferry.Engine(ttl=20.0, max_ttl=5.0)
