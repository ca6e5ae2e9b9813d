# mypy: disable-error-code="import-untyped,import-not-found"
"""The plugin: ``--disaggregation-transfer-backend kvferry`` parses in SGLang's own
argument parser and routes to this backend through ``get_kv_class``; other backends
are untouched; the version guard refuses another sglang by name; the installed
package's metadata carries the ``sglang.srt.plugins`` entry point."""

from __future__ import annotations

import argparse
import importlib.metadata

import pytest

from .conftest import REQUIRED


@pytest.fixture(scope="module")
def registered(need_sglang: None) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    from kvferry.integrations.sglang import plugin

    plugin.register()
    plugin.register()  # idempotent
    HookRegistry.apply_hooks()


def test_backend_parses_in_sglangs_parser(registered: None) -> None:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "m", "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "kvferry"])
    assert args.disaggregation_transfer_backend == "kvferry"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "m", "--disaggregation-transfer-backend", "kvferry-typo"])


def test_get_kv_class_routes_kvferry_and_leaves_others(registered: None) -> None:
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer
    from sglang.srt.disaggregation.fake import FakeKVSender
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    import kvferry.integrations.sglang as k

    kb = TransferBackend("kvferry")
    assert kb is TransferBackend.KVFERRY and kb.value == "kvferry"
    assert get_kv_class(kb, KVClassType.MANAGER) is k.KvferryKVManager
    assert get_kv_class(kb, KVClassType.SENDER) is k.KvferryKVSender
    assert get_kv_class(kb, KVClassType.RECEIVER) is k.KvferryKVReceiver
    assert get_kv_class(kb, KVClassType.KVARGS) is KVArgs
    server = get_kv_class(kb, KVClassType.BOOTSTRAP_SERVER)
    assert issubclass(server, CommonKVBootstrapServer)  # SGLang's own rendezvous
    assert get_kv_class(TransferBackend.FAKE, KVClassType.SENDER) is FakeKVSender
    assert [b.value for b in TransferBackend][:5] == ["mooncake", "mori", "nixl", "ascend", "fake"]


def test_version_guard_names_both_versions(need_sglang: None) -> None:
    import kvferry.integrations.sglang as k

    k.check_version()  # the pinned one passes
    with pytest.raises(RuntimeError, match=r"supports sglang==0\.5\.23 only, but sglang 0\.5\.22 is installed"):
        k.check_version("0.5.22")
    with pytest.raises(RuntimeError, match=r"\(not installed\)"):
        k.check_version("")


def test_installed_entry_point(need_sglang: None) -> None:
    eps = [ep for ep in importlib.metadata.entry_points(group="sglang.srt.plugins") if ep.name == "kvferry"]
    if not eps:
        dist = importlib.metadata.distribution("kvferry")
        (pytest.fail if REQUIRED else pytest.skip)(
            f"the installed kvferry metadata ({dist._path}) predates the sglang.srt.plugins entry point: "  # type: ignore[attr-defined]
            "rebuild it (scripts/install-vllm.sh runs maturin develop) to check the installed entry point"
        )
    assert eps[0].value == "kvferry.integrations.sglang.plugin:register"
    assert eps[0].load().__module__ == "kvferry.integrations.sglang.plugin"
    # SGLang's own discovery runs it (what every SGLang process does at start).
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.plugins import load_plugins

    load_plugins()
    assert TransferBackend("kvferry").value == "kvferry"
