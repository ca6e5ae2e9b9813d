# mypy: disable-error-code="import-untyped,import-not-found"
# (sglang ships no type information: its classes are Any here.)
"""The backend's options, read from environment variables (SGLang's usual channel for
transfer-backend settings), and the rank topology read from SGLang's runtime context.

==================================  ==========  =============================================
variable                            default     meaning
==================================  ==========  =============================================
``KVFERRY_SGLANG_TIMEOUT``          ``30``      seconds a transfer may make no progress
                                                (no chunk, no acknowledgement) before it is
                                                ``Failed``; also each get's bound
``KVFERRY_SGLANG_BOOTSTRAP_TIMEOUT`` ``30``     seconds to reach the bootstrap server and
                                                the peer ranks before ``Failed``
``KVFERRY_SGLANG_PROBE_INTERVAL``   ``1``       seconds between liveness probes of the
                                                peer engines of transfers in flight
``KVFERRY_SGLANG_SECRET``           unset       shared secret of every kvferry engine
``KVFERRY_SGLANG_HOST``             SGLang's    address the engine and control socket bind
                                    local IP    and advertise
``KVFERRY_SGLANG_PATH``             ``direct``  ``direct`` or ``staged`` (kvferry's paths)
``KVFERRY_SGLANG_DEVICE``           ``auto``    ``host``, ``cuda:N`` or ``auto`` (CUDA when
                                                torch sees a GPU, else host)
``KVFERRY_SGLANG_TRANSPORT``        ``auto``    ``auto`` (a prefill on the same host is read
                                                straight from its memory, the socket
                                                otherwise) or ``tcp`` (always the socket)
==================================  ==========  =============================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
    if v <= 0:
        raise ValueError(f"{name}={raw!r} must be positive")
    return v


@dataclass(frozen=True)
class Options:
    timeout: float
    bootstrap_timeout: float
    probe_interval: float
    secret: str | None
    host: str | None
    path: str
    device: str
    transport: str = "auto"

    @classmethod
    def from_env(cls) -> Options:
        path = os.environ.get("KVFERRY_SGLANG_PATH", "direct")
        if path not in ("direct", "staged"):
            raise ValueError(f"KVFERRY_SGLANG_PATH={path!r}: expected 'direct' or 'staged'")
        transport = os.environ.get("KVFERRY_SGLANG_TRANSPORT", "auto")
        if transport not in ("auto", "tcp"):
            raise ValueError(f"KVFERRY_SGLANG_TRANSPORT={transport!r}: expected 'auto' or 'tcp'")
        return cls(
            timeout=_float("KVFERRY_SGLANG_TIMEOUT", 30.0),
            bootstrap_timeout=_float("KVFERRY_SGLANG_BOOTSTRAP_TIMEOUT", 30.0),
            probe_interval=_float("KVFERRY_SGLANG_PROBE_INTERVAL", 1.0),
            secret=os.environ.get("KVFERRY_SGLANG_SECRET") or None,
            host=os.environ.get("KVFERRY_SGLANG_HOST") or None,
            path=path,
            device=os.environ.get("KVFERRY_SGLANG_DEVICE", "auto"),
            transport=transport,
        )


@dataclass(frozen=True)
class Topology:
    """Where this rank sits: attention TP, DP, PP and context parallelism (attention CP
    and decode CP, ``--attn-cp-size`` and ``--dcp-size``), and the bootstrap server."""

    tp_size: int
    tp_rank: int
    dp_size: int
    dp_rank: int
    pp_size: int
    pp_rank: int
    bootstrap_host: str
    bootstrap_port: int
    cp_size: int = 1
    dcp_size: int = 1


def topology(server_args: Any, kv_args: Any) -> Topology:
    """From SGLang's runtime context when the scheduler set it up (its server args are
    the ones given), else from ``server_args``' own fields (``tp_size``, ``dp_size``,
    ``pp_size``, ``attn_cp_size``, ``dcp_size``, ``host``, ``disaggregation_bootstrap_port``)
    with ``kv_args.engine_rank``
    as the TP rank: what a process driving the backend without a scheduler passes."""
    try:
        from sglang.srt import runtime_context as rc

        ctx_args = rc._CONTEXT.server_args
    except Exception:
        ctx_args = None
    if ctx_args is not None and ctx_args is server_args:
        par = rc.get_parallel()
        return Topology(
            tp_size=int(par.attn_tp_size),
            tp_rank=int(par.attn_tp_rank),
            dp_size=int(par.attn_dp_size),
            dp_rank=int(par.attn_dp_rank),
            pp_size=int(par.pp_size),
            pp_rank=int(getattr(kv_args, "pp_rank", 0) or 0),
            bootstrap_host=str(rc.get_serving().host),
            bootstrap_port=int(rc.get_disagg().disaggregation_bootstrap_port),
            cp_size=int(getattr(par, "attn_cp_size", 1) or 1),
            dcp_size=int(getattr(par, "attn_dcp_size", 1) or 1),
        )
    return Topology(
        tp_size=int(getattr(server_args, "tp_size", 1)),
        tp_rank=int(getattr(kv_args, "engine_rank", 0)),
        dp_size=int(getattr(server_args, "dp_size", 1)),
        dp_rank=int(getattr(server_args, "dp_rank", 0) or 0),
        pp_size=int(getattr(server_args, "pp_size", 1)),
        pp_rank=int(getattr(kv_args, "pp_rank", 0) or 0),
        bootstrap_host=str(getattr(server_args, "host", "127.0.0.1")),
        bootstrap_port=int(getattr(server_args, "disaggregation_bootstrap_port", 8998)),
        cp_size=int(getattr(server_args, "attn_cp_size", 1) or 1),
        dcp_size=int(getattr(server_args, "dcp_size", 1) or 1),
    )
