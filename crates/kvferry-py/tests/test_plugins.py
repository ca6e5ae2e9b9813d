"""``python -m kvferry plugins``: what it reports is what this interpreter's entry-point
lookup (the one vLLM and SGLang use) really finds, and its exit status says whether a
plugin would fail to load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def _run(*args: str, pythonpath: Path | None = None) -> tuple[int, Any]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    p = subprocess.run(
        [sys.executable, "-m", "kvferry", "plugins", "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    return p.returncode, json.loads(p.stdout) if p.stdout.strip().startswith("{") else p.stdout + p.stderr


def test_the_installed_package_declares_both_plugins_and_this_interpreter_finds_them() -> None:
    rc, r = _run()
    assert rc == 0, r
    assert r["ok"] is True and r["version"]
    by_group = {p["group"]: p for p in r["plugins"]}
    assert by_group["vllm.general_plugins"]["value"] == "kvferry.integrations.vllm.bounded_output:register"
    assert by_group["sglang.srt.plugins"]["value"] == "kvferry.integrations.sglang.plugin:register"
    assert all(p["found"] for p in r["plugins"]), r["plugins"]
    for p in r["plugins"]:
        # Tried exactly where the framework reading the group is installed.
        framework = {"vllm.general_plugins": "vllm", "sglang.srt.plugins": "sglang"}[p["group"]]
        installed = next(f for f in r["frameworks"] if f["name"] == framework)["version"] is not None
        assert (p["imports"] is not None) == installed, p


def _fake_distribution(root: Path, module: str) -> None:
    info = root / "kvferry_fake_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvferry-fake-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[example.plugins]\nfake = {module}:register\n")


def test_a_plugin_whose_module_does_not_import_fails_the_check(tmp_path: Path) -> None:
    _fake_distribution(tmp_path, "kvferry_no_such_module")
    rc, r = _run("--distribution", "kvferry-fake-plugin", pythonpath=tmp_path)
    assert rc == 1, r
    (p,) = r["plugins"]
    assert p["found"] is True and p["imports"] is False
    assert "kvferry_no_such_module does not import" in p["error"]


def test_a_plugin_whose_module_imports_passes(tmp_path: Path) -> None:
    (tmp_path / "kvferry_fake_mod.py").write_text("def register() -> None:\n    raise AssertionError('never called')\n")
    _fake_distribution(tmp_path, "kvferry_fake_mod")
    rc, r = _run("--distribution", "kvferry-fake-plugin", pythonpath=tmp_path)
    assert rc == 0, r
    assert r["plugins"][0]["imports"] is True


def test_a_distribution_that_is_not_installed_is_exit_status_2() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "kvferry", "plugins", "--distribution", "kvferry-not-installed-anywhere"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stdout + p.stderr
    assert "not installed" in p.stdout and "pip install ./crates/kvferry-py" in p.stdout
