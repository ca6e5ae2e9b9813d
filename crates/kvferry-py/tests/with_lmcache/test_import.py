"""Importing the integration without lmcache says what to install; the adapter parses
its URLs; install() refuses another lmcache version."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_import_without_lmcache_names_what_to_install():
    # a child process where `import lmcache` fails, as on a machine without it
    code = (
        "import sys; sys.modules['lmcache'] = None\n"
        "try:\n"
        "    import kvferry.integrations.lmcache\n"
        "except ImportError as e:\n"
        "    print('IMPORTERROR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "IMPORTERROR" in out.stdout, out.stdout + out.stderr
    assert "lmcache==0.5.6" in out.stdout and "install-lmcache.sh" in out.stdout
    import kvferry  # noqa: F401 - the package itself never needs lmcache


@pytest.mark.usefixtures("need_lmcache")
def test_adapter_parses_kvferry_and_plugin_urls():
    from kvferry.integrations.lmcache import KvferryConnectorAdapter, RemoteOptions

    a = KvferryConnectorAdapter()
    assert a.can_parse("kvferry://10.0.0.5:7070") and a.can_parse("plugin://kvferry")
    assert not a.can_parse("lm://10.0.0.5:7070") and not a.can_parse("plugin://fs")

    class Cfg:
        extra_config = {"kvferry.timeout": 2.5, "kvferry.secret": "abc"}

    o = RemoteOptions.from_config(Cfg(), "kvferry://10.0.0.5:7070?timeout=1.5")
    assert (o.server, o.timeout, o.secret) == ("10.0.0.5:7070", 1.5, b"abc")
    with pytest.raises(ValueError, match="needs a server"):
        RemoteOptions.from_config(Cfg(), None)
    Cfg.extra_config = {"kvferry.server": "h:1", "kvferry.tiemout": 3}
    with pytest.raises(ValueError, match="unknown kvferry option"):
        RemoteOptions.from_config(Cfg(), None)


@pytest.mark.usefixtures("need_lmcache")
def test_install_refuses_another_lmcache_version(monkeypatch):
    import kvferry.integrations.lmcache._channel as ch
    import kvferry.integrations.lmcache._version as ver

    monkeypatch.setattr(ver, "installed_version", lambda: "0.9.9")
    monkeypatch.setattr(ch, "_installed", {})
    with pytest.raises(RuntimeError, match="pinned to lmcache==0.5.6.*found lmcache 0.9.9"):
        ch.install()
