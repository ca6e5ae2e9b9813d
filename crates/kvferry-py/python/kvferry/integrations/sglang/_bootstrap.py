# mypy: disable-error-code="import-untyped,import-not-found"
# (sglang ships no type information: its classes are Any here.)
"""The rendezvous: SGLang's own HTTP bootstrap server (``CommonKVBootstrapServer``,
unchanged), and the few bounded HTTP calls the backend makes to it: a prefill rank
registers its control endpoint, a decode rank reads the prefill's topology and the
endpoints of the ranks it reads. Every call is bounded by the bootstrap timeout; a
server that never answers (or keeps answering "not registered yet") is an error naming
the address and how long was waited."""

from __future__ import annotations

import time
from typing import Any

import requests
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer

from ._options import Topology


class KvferryKVBootstrapServer(CommonKVBootstrapServer):  # type: ignore[misc]
    """SGLang's bootstrap server, as is: the kvferry backend registers and looks up
    ranks through its ``/route`` API like the built-in backends."""


class BootstrapError(RuntimeError):
    """The bootstrap server did not answer, or answered with an error, in time."""


def _url(host: str, port: int | str) -> str:
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


def register_rank(topo: Topology, ip: str, port: int, page_size: int, dtype: str, timeout: float) -> None:
    """PUT this prefill rank's control endpoint into the bootstrap server's table."""
    payload = {
        "attn_tp_size": topo.tp_size,
        "attn_tp_rank": topo.tp_rank,
        "attn_cp_size": 1,
        "attn_cp_rank": 0,
        "attn_dp_size": topo.dp_size,
        "attn_dp_rank": topo.dp_rank,
        "pp_size": topo.pp_size,
        "pp_rank": topo.pp_rank,
        "system_dp_size": 1,
        "system_dp_rank": 0,
        "rank_ip": ip,
        "rank_port": port,
        "page_size": page_size,
        "kv_cache_dtype": dtype,
    }
    url = _url(topo.bootstrap_host, topo.bootstrap_port) + "/route"
    _call("PUT", url, timeout, json=payload)


def _call(method: str, url: str, timeout: float, **kw: Any) -> Any:
    """One request, retried while the server is unreachable or not ready (503), until
    ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise BootstrapError(f"bootstrap server {url} did not answer within {timeout:g} s ({last})")
        try:
            r = requests.request(method, url, timeout=min(left, 5.0), **kw)
        except requests.RequestException as e:
            last = f"{type(e).__name__}: {e}"
        else:
            if r.status_code == 200:
                return r.json() if method == "GET" else r.text
            if r.status_code != 503:
                raise BootstrapError(f"bootstrap server {url} answered {r.status_code}: {r.text}")
            last = f"503: {r.text}"
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


def server_info(bootstrap_addr: str, timeout: float) -> dict[str, Any]:
    """The prefill's topology (``attn_tp_size``, ``page_size``, ``kv_cache_dtype``, ...)."""
    host, _, port = bootstrap_addr.rpartition(":")
    url = _url(host, port) + "/route"
    info = _call(
        "GET",
        url,
        timeout,
        params={"prefill_dp_rank": -1, "prefill_cp_rank": -1, "target_tp_rank": -1, "target_pp_rank": -1},
    )
    if not isinstance(info, dict):
        raise BootstrapError(f"bootstrap server {url} answered {info!r}")
    return info


def rank_endpoint(bootstrap_addr: str, dp_rank: int, tp_rank: int, timeout: float) -> str:
    """The control endpoint (``tcp://ip:port``) of prefill rank ``tp_rank`` of DP rank
    ``dp_rank``."""
    host, _, port = bootstrap_addr.rpartition(":")
    url = _url(host, port) + "/route"
    info = _call(
        "GET",
        url,
        timeout,
        params={"prefill_dp_rank": dp_rank, "prefill_cp_rank": 0, "target_tp_rank": tp_rank, "target_pp_rank": 0},
    )
    ip = str(info["rank_ip"])
    if ":" in ip and not ip.startswith("["):
        ip = f"[{ip}]"
    return f"tcp://{ip}:{int(info['rank_port'])}"
