"""A worker-side connector driven around a "forward" the way vLLM's own model runner
drives it, on each supported vLLM — for the chaos soak (:mod:`.chaos_node`), the
benches and the test harness, which run vLLM's scheduler and connectors without a
model.

- vLLM 0.33 (and the CPU build 0.32): ``KVConnectorModelRunnerMixin.
  _get_kv_connector_output`` around the forward, ``handle_preemptions`` before it
  (as ``GPUModelRunner.execute_model`` calls it);
- vLLM 0.34 removed that mixin with the V1 model runner: Model Runner V2's
  ``ActiveKVConnector`` (``pre_forward`` — which handles preemptions itself — then
  ``post_forward``), made once per worker over its KV caches, as the runner makes it
  (which registers them with the connector again: the same memory, so nothing
  changes, :mod:`.extend`).

Either way the connector vLLM reaches through ``get_kv_transfer_group()`` is the
driven one for the duration (one process stands in for several worker processes).
:func:`model_runner_output` builds the step's ``ModelRunnerOutput`` with the fields
the installed vLLM has (0.34 dropped ``req_id_to_index``).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["ConnectorDriver", "model_runner_output"]


def _mixin() -> Any:
    """vLLM 0.33's ``KVConnectorModelRunnerMixin``, or None (vLLM 0.34)."""
    try:
        return importlib.import_module("vllm.v1.worker.kv_connector_model_runner_mixin").KVConnectorModelRunnerMixin
    except ImportError:
        return None


@contextmanager
def _as_agent(conn: Any) -> Iterator[None]:
    """``conn`` is the process's KV connector (``get_kv_transfer_group()``) within."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    kv_transfer_state._KV_CONNECTOR_AGENT = conn
    try:
        yield
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = None


class ConnectorDriver:
    """One worker's connector (``conn``, made by ``KVConnectorFactory`` and already
    given ``kv_caches``), driven as the installed vLLM's model runner drives it."""

    def __init__(self, conn: Any, vllm_config: Any, kv_caches: dict[str, Any]) -> None:
        self.conn = conn
        self.vllm_config = vllm_config
        self._mixin = _mixin()
        self._active: Any = None
        if self._mixin is None:
            from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

            with _as_agent(conn):
                self._active = ActiveKVConnector(vllm_config, kv_caches)

    @contextmanager
    def step(self, scheduler_output: Any) -> Iterator[Any]:
        """Around one "forward" of ``scheduler_output``: yields the step's
        ``KVConnectorOutput``, filled in when the block ends."""
        from vllm.forward_context import set_forward_context

        with _as_agent(self.conn), set_forward_context(None, self.vllm_config):
            if self._mixin is not None:
                self.conn.handle_preemptions(scheduler_output.kv_connector_metadata)
                with self._mixin._get_kv_connector_output(scheduler_output) as kvo:
                    yield kvo
                return
            from vllm.v1.outputs import KVConnectorOutput

            kvo = KVConnectorOutput()
            self._active.pre_forward(scheduler_output)
            try:
                yield kvo
            finally:
                self._active.finish_forward()
                out = self._active.post_forward(scheduler_output.finished_req_ids)
                if out is not None:
                    for f in dataclasses.fields(out):
                        setattr(kvo, f.name, getattr(out, f.name))


def model_runner_output(req_ids: list[str], sampled_token_ids: list[list[int]], kv_connector_output: Any) -> Any:
    """The step's ``ModelRunnerOutput`` for the installed vLLM (0.33 also wants
    ``req_id_to_index``; 0.34 has no such field)."""
    from vllm.v1.outputs import ModelRunnerOutput

    kw: dict[str, Any] = {"req_ids": req_ids, "sampled_token_ids": sampled_token_ids, "kv_connector_output": kv_connector_output}
    if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        kw["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(**kw)
