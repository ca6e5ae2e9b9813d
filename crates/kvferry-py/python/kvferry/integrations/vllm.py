"""``KvferryConnector``: disaggregated prefill/decode for vLLM V1 over kvferry.

A prefill instance computes a prompt's KV cache and finishes the request after one
token; its blocks stay pinned — published zero copy under the request id — until the
decode instance has pulled them (or a lease expires). The decode instance receives the
prefill's ``kv_transfer_params``, parks the request in ``WAITING_FOR_REMOTE_KVS``,
pulls the blocks straight into its own paged KV cache, then decodes.

Pinned to ``vllm==0.33.0`` (the connector API is experimental and changes between
vLLM releases). Load it with::

    from vllm.config import KVTransferConfig

    KVTransferConfig(
        kv_connector="KvferryConnector",
        kv_connector_module_path="kvferry.integrations.vllm",
        kv_role="kv_producer",          # prefill; "kv_consumer" for decode
        kv_connector_extra_config={"host": "10.0.0.5", "port": 7400, "timeout": 30.0},
    )

or ``vllm serve ... --kv-transfer-config '{"kv_connector": "KvferryConnector",
"kv_connector_module_path": "kvferry.integrations.vllm", "kv_role": "kv_producer"}'``.

``kv_connector_extra_config`` keys (all optional):

``host`` (str, default ``"127.0.0.1"``)
    Interface the worker's kvferry engine listens on. Decode instances connect here.
``port`` (int, default ``0``)
    Base port: tensor-parallel rank *r* listens on ``port + r``. ``0`` picks free
    ports (the addresses travel in ``kv_transfer_params``, so nothing needs to know
    them in advance).
``advertise_host`` (str, default: ``host``)
    Host written into ``kv_transfer_params`` for decode instances to connect to;
    set it when ``host`` is a wildcard such as ``"0.0.0.0"``.
``timeout`` (float seconds, default ``30.0``)
    Bound on every wait: a pull that has not landed within it is cancelled and
    becomes a load error of its request; cancels, deregistration and shutdown are
    bounded by it too.
``lease_ttl`` (float seconds, default ``60.0``)
    How long a prefill instance keeps a finished request's blocks published. A
    decode instance that has not pulled by then finds nothing (a load error on its
    side) and the prefill instance frees the blocks — a decode instance that never
    comes costs at most this long.
``secret`` (str, default none)
    Shared secret every instance must prove (HMAC handshake); none means no auth.
``path`` (``"direct"`` or ``"staged"``, default ``"direct"``)
    ``direct``: the socket writes the destination blocks; ``staged``: bytes go
    through staging pages and only verified chunks land.
``io_timeout`` (float seconds, default ``5.0``)
    An I/O step making no progress for this long fails (a hung peer).
``connect_timeout`` (float seconds, default ``3.0``)
    Bound on connecting to a peer.
``arena_bytes`` (int, default 64 MiB)
    Staging arena of the worker's engine (used by the ``staged`` path).
``peer_id`` (str, default ``kvferry-<engine_id>``)
    Prefix of the worker engines' peer ids (``-tp<rank>`` is appended).
``device`` (``"sim"`` or unset, default unset)
    Unset: the worker's engine follows its KV tensors — CPU tensors are host memory
    (zero copy both ways), CUDA tensors go to a ``cuda:N`` engine on their GPU and move
    through the device path (a device-to-host gather into pinned staging on a copy
    stream when a decode pulls, a host-to-device scatter on the decode side, every
    device wait bounded). ``"sim"``: CPU tensors are adopted as memory of kvferry's sim
    device, so that same device path (staging, device copies, events, faults) runs on a
    machine without a GPU — for tests and CPU rehearsals of a GPU deployment.
``idle_wait`` (float seconds, default ``0.001``, at most ``0.1``)
    In a step that computes nothing (the scheduler scheduled no tokens: a decode
    instance waiting only for KV), ``get_finished`` waits up to this long, with the GIL
    released, for a pull in flight to land, instead of returning at once. vLLM's engine
    loop otherwise steps back to back while it waits, and that loop's CPU is taken from
    the transfers. ``0`` turns it off; steps that run a forward pass never wait.
``reader_slots`` (int, or ``"auto"``, the default; at most 64; prefill side)
    Keys each finished request is published under on each rank (the same blocks,
    zero copy): every get of a request's blocks uses one, and the blocks are freed
    once every slot was read or released. ``"auto"`` publishes enough for every decode
    instance whose TP splits the KV heads (``D_TP`` up to the model's KV heads, any
    ``P_TP``; MLA: up to 8 decode ranks) with block sizes up to 2x apart:
    ``2 x max(1, KV heads / P_TP)`` (MLA: ``2 x max(1, 8 / P_TP)``), see
    :func:`~.vllm_hetero.auto_reader_slots`. The decode releases, in one message per
    prefill rank and step, the slots it does not read. A decode that reads a prefill
    rank more often than that (replicated heads on a wider decode, larger block-size
    ratios) refuses the pair at the handshake naming this key: set it to
    ``ceil(D_TP / P_TP)`` x the block-size ratio. See docs/vllm.md, "Heterogeneous
    prefill and decode".
``read_batch`` (int, default ``8``, at most 64; decode side)
    The most requests one kvferry get carries. The reads a step starts from one
    prefill rank that share their byte ranges (the same heads of every block) ride
    batched gets of at most 64 MiB, spread over up to 4 gets (the engine's pooled connections): 32 new
    requests make 4 gets of 8, 6 make 3 of 2, up to 4 go one get each. Each get costs
    a round trip and per-request work on both sides whatever its size, so small
    requests (a few blocks) move faster batched. A batch that misses (a key not
    published yet) hands each request back to a get of its own; an aborted request
    only leaves the batch (the others still land); a batch that fails otherwise (a
    timeout, a dead peer, a checksum) fails every request in it, as each one's own get
    to that peer would. ``1``: one get per request. Host caches on the ``direct`` path
    only (device caches stage, one request at a time). See docs/vllm.md, "Batched
    gets".
``device_timeout`` (float seconds, default: ``timeout``)
    Bound on each device copy; a copy that has not completed by then fails its transfer
    (a load error on the decode side) and its staging pages stay quarantined until the
    device confirms.

``kv_transfer_params`` returned by a prefill instance: ``do_remote_prefill`` (True),
``do_remote_decode`` (False), ``remote_block_ids``, ``remote_engine_id``,
``remote_request_id`` (the publication's key), ``remote_host``, ``remote_port``,
``remote_num_tokens``, ``tp_size``, ``kvferry_peer_id``, ``kvferry_incarnation``
(rank 0's; a restarted instance has a new incarnation), ``kvferry_peers`` (one
``{"address", "peer_id", "incarnation"}`` per tensor-parallel rank),
``kvferry_expires_at`` (wall-clock time the lease ends) and ``kvferry_desc`` (the
instance's KV geometry, for the compatibility handshake: see
``vllm_mapping.KvDescriptor``); with several KV cache groups (or a sliding window's
null blocks) ``remote_block_ids`` is one list per group, ``0`` where a group holds no
block.

The worker publishes one engine step after the scheduler returned the params, so a
decode instance may ask first: a miss is retried (2-50 ms backoff) until the lease's
advertised end or ``timeout``, whichever comes first.

Guarantees: a decode instance never computes on bytes that did not land verified —
a dead, hung or restarted prefill instance, an expired lease or a timeout becomes a
load error for exactly the requests involved (``get_block_ids_with_load_errors`` and
``failed_recving``; vLLM then recomputes or fails them per ``kv_load_failure_policy``).
A decode request aborted mid-pull gets its blocks back once the cancelled pull drained
(asked without waiting, reported in a later step). A failed pull is reported (its load
error, ``finished_recving``) only once nothing writes its blocks any more: a device
copy that outlived the transfer's deadline is waited for (polled each step, never
blocking vLLM's step; a device that never confirms keeps the request's blocks, as
quarantined staging pages are kept). A prefill instance frees a request's blocks only after its
publication was released — the decode's ``Done``, lease expiry or shutdown — and never
while a send still reads them. A decode request that will not pull (aborted before or
during its pull, or given up after a timeout) tells the prefill instance through
kvferry (``Engine.release_remote``: a ``Release`` request that stages nothing, so a
prefill whose staging is full still frees them), so its blocks are
freed within a round trip instead of at lease expiry — whatever the last error was (a
miss too: the release retries until the lease's advertised end, so a prefill that
publishes after the decode gave up is released as soon as it does), and when vLLM gives
the request 0 external tokens (``prompt_logprobs``, a full local prefix hit). Lease
expiry remains the backstop when the decode side dies or the release cannot reach the
prefill instance. Params without kvferry's fields (a proxy written for NIXL) are pulled
from ``remote_host:remote_port`` when the prefill has one rank, else computed locally
with a warning that says why.
KV caches in CPU memory move zero copy; CUDA caches move through pinned staging and
device copies (see ``device``). A decode request is reported in ``finished_recving``
only once its bytes are in its blocks — on a device, once the host-to-device copy
completed on the device. On the prefill side, with CUDA caches, a finished request's
blocks are published only once the step that computed them has completed on the GPU
(an event recorded in ``wait_for_save``, polled, never waited on without a bound).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

try:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorTransferResults,
        SupportsHMA,
    )
    from vllm.logger import init_logger
except ImportError as e:  # pragma: no cover - exercised only without vLLM
    raise ImportError(
        "kvferry.integrations.vllm needs vLLM: pip install vllm==0.33.0 "
        "(or run scripts/install-vllm.sh)"
    ) from e

from .. import errors
from .._engine import Engine, Region, Transfer
from . import vllm_hetero
from .vllm_mapping import slot_key
from .vllm_stats import KvferryConnectorStats, KvferryPromMetrics

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats, PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

VLLM_VERSION = "0.33.0"

_DEFAULTS: dict[str, Any] = {
    "host": "127.0.0.1",
    "port": 0,
    "advertise_host": None,
    "timeout": 30.0,
    "lease_ttl": 60.0,
    "secret": None,
    "path": "direct",
    "io_timeout": 5.0,
    "connect_timeout": 3.0,
    "arena_bytes": 64 << 20,
    "peer_id": None,
    "device": None,
    "device_timeout": None,
    "idle_wait": 0.001,
    "reader_slots": "auto",
    "read_batch": 8,
}


@dataclass(frozen=True)
class KvferryConfig:
    """The connector's settings, read from ``kv_connector_extra_config`` (see the
    module docstring for each key)."""

    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    timeout: float = 30.0
    lease_ttl: float = 60.0
    secret: str | None = None
    path: str = "direct"
    io_timeout: float = 5.0
    connect_timeout: float = 3.0
    arena_bytes: int = 64 << 20
    peer_id: str | None = None
    device: str | None = None
    device_timeout: float | None = None
    idle_wait: float = 0.001
    reader_slots: int | None = None  # None: "auto" (vllm_hetero.auto_reader_slots)
    read_batch: int = 8

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig) -> KvferryConfig:
        kvc = vllm_config.kv_transfer_config
        extra = dict(kvc.kv_connector_extra_config or {}) if kvc is not None else {}
        unknown = sorted(set(extra) - set(_DEFAULTS))
        if unknown:
            raise ValueError(f"KvferryConnector: unknown kv_connector_extra_config keys {unknown}; known: {sorted(_DEFAULTS)}")
        cfg = cls(
            host=str(extra.get("host", _DEFAULTS["host"])),
            port=int(extra.get("port", _DEFAULTS["port"])),
            advertise_host=extra.get("advertise_host"),
            timeout=float(extra.get("timeout", _DEFAULTS["timeout"])),
            lease_ttl=float(extra.get("lease_ttl", _DEFAULTS["lease_ttl"])),
            secret=extra.get("secret"),
            path=str(extra.get("path", _DEFAULTS["path"])),
            io_timeout=float(extra.get("io_timeout", _DEFAULTS["io_timeout"])),
            connect_timeout=float(extra.get("connect_timeout", _DEFAULTS["connect_timeout"])),
            arena_bytes=int(extra.get("arena_bytes", _DEFAULTS["arena_bytes"])),
            peer_id=extra.get("peer_id"),
            device=extra.get("device"),
            device_timeout=None if extra.get("device_timeout") is None else float(extra["device_timeout"]),
            idle_wait=float(extra.get("idle_wait", _DEFAULTS["idle_wait"])),
            reader_slots=_reader_slots(extra.get("reader_slots", _DEFAULTS["reader_slots"])),
            read_batch=_read_batch(extra.get("read_batch", _DEFAULTS["read_batch"])),
        )
        for name in ("timeout", "lease_ttl", "io_timeout", "connect_timeout"):
            if not getattr(cfg, name) > 0:
                raise ValueError(f"KvferryConnector: {name} must be > 0, got {getattr(cfg, name)!r}")
        if cfg.device not in (None, "sim"):
            raise ValueError(f"KvferryConnector: device must be 'sim' or unset (the KV tensors' own device), got {cfg.device!r}")
        if cfg.device_timeout is not None and not cfg.device_timeout > 0:
            raise ValueError(f"KvferryConnector: device_timeout must be > 0, got {cfg.device_timeout!r}")
        if not 0 <= cfg.idle_wait <= 0.1:
            raise ValueError(f"KvferryConnector: idle_wait must be between 0 and 0.1 seconds, got {cfg.idle_wait!r}")
        if cfg.path not in ("direct", "staged"):
            raise ValueError(f"KvferryConnector: path must be 'direct' or 'staged', got {cfg.path!r}")
        if not 0 <= cfg.port < 65536:
            raise ValueError(f"KvferryConnector: port out of range: {cfg.port}")
        return cfg


def _read_batch(v: Any) -> int:
    """``read_batch`` from the config: an int in 1..64."""
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 64:
        raise ValueError(f"KvferryConnector: read_batch must be an int in 1..64 (1: one get per request), got {v!r}")
    return v


def _reader_slots(v: Any) -> int | None:
    """``reader_slots`` from the config: None for ``"auto"``, else an int in 1..64."""
    if v is None or v == "auto":
        return None
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ValueError(f"KvferryConnector: reader_slots must be 'auto' or an integer between 1 and 64, got {v!r}")
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"KvferryConnector: reader_slots must be 'auto' or an integer between 1 and 64, got {v!r}") from None
    if not 1 <= n <= 64:
        raise ValueError(f"KvferryConnector: reader_slots must be 'auto' or an integer between 1 and 64, got {v!r}")
    return n


# -- messages between the two halves -----------------------------------------------


@dataclass
class KvferryHandshakeMetadata(KVConnectorHandshakeMetadata):
    """What a worker tells its scheduler after registering its KV cache: where its
    kvferry engine listens and which incarnation it is."""

    address: str | None
    peer_id: str
    incarnation: int
    tp_rank: int
    num_blocks: int
    block_bytes: int
    # The rank's KV geometry (vllm_hetero.py): for the compatibility handshake.
    layout: str = "NHD"  # a piece's cell order (vllm_layout), e.g. "HNKD"
    heads_per_rank: int = 0
    pieces: int = 0
    piece_bytes: int = 0
    dtype: str = ""
    elem_size: int = 0
    cache_layout: str = ""  # backend/KVCacheLayout (order), for messages


@dataclass
class RecvSpec:
    """One pull for the decode worker: ``key`` from ``peers[tp_rank]`` into
    ``local_block_ids``; remote block *i* lands in ``local_block_ids[i]`` for
    ``i >= skip_blocks`` (the first ``skip_blocks`` are a local prefix-cache hit)."""

    key: str
    peers: list[dict[str, Any]]
    remote_block_ids: list[int]
    local_block_ids: list[int]
    skip_blocks: int = 0
    # Set when the prefill advertised a descriptor (vllm_hetero.py): every decode
    # rank's reads and releases, or why the pair was refused.
    plans: list[Any] | None = None
    refused: str | None = None
    npub: int = 0
    src_piece_bytes: int = 0
    # Params without a descriptor (a proxy written for NIXL): the other reader slots
    # the prefill published besides ``key`` (as many as this instance would publish),
    # released when the pull starts, or with ``key`` when it never does.
    release_also: list[str] = field(default_factory=list)

    @property
    def load_block_ids(self) -> list[int]:
        """Local blocks this pull writes (reported on failure)."""
        if self.plans is not None:
            return sorted({b for plan in self.plans for rd in plan.reads for b in rd.dst_blocks}) or list(self.local_block_ids)
        n = min(len(self.local_block_ids), len(self.remote_block_ids))
        return self.local_block_ids[self.skip_blocks : n]


@dataclass
class ReleaseSpec:
    """A pull that will never happen (the decode request finished — was aborted —
    before its pull started): each worker tells ``peers[tp_rank]`` to release ``key``
    now, rather than the prefill instance holding the blocks until lease expiry."""

    key: str
    peers: list[dict[str, Any]]
    expires_at: float | None = None  # wall clock: the lease's advertised end
    # Reader slots (vllm_hetero.py): per decode rank, the (prefill rank, key) pairs it
    # releases; None: each rank releases ``key`` on its own prefill rank.
    per_rank: list[list[tuple[int, str]]] | None = None


@dataclass
class KvferryConnectorMetadata(KVConnectorMetadata):
    """Scheduler → worker, once per step: pulls to start, publications to release
    on the prefill side, and blocks to publish."""

    reqs_to_recv: dict[str, RecvSpec] = field(default_factory=dict)
    reqs_to_send: dict[str, list[int]] = field(default_factory=dict)
    expires_at: dict[str, float] = field(default_factory=dict)  # wall clock, per pull
    reqs_to_release: dict[str, ReleaseSpec] = field(default_factory=dict)
    idle: bool = False  # this step schedules no tokens: no forward pass runs


def _flat_block_ids(ids: Any) -> list[int]:
    """``[1, 2]`` or one list per KV cache group (``([1, 2],)``) → ``[1, 2]``."""
    ids = list(ids or [])
    if ids and isinstance(ids[0], (list, tuple)):
        if len(ids) != 1:
            raise ValueError(f"KvferryConnector supports one KV cache group, got {len(ids)}")
        ids = list(ids[0])
    return [int(b) for b in ids]


# -- scheduler side ------------------------------------------------------------------


class KvferryConnectorScheduler:
    """The half that lives in the scheduler (EngineCore) process."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> None:
        self.config = KvferryConfig.from_vllm(vllm_config)
        kvc = vllm_config.kv_transfer_config
        assert kvc is not None
        self.engine_id: str = str(kvc.engine_id)
        self.block_size: int = vllm_config.cache_config.block_size
        self.tp_size: int = vllm_config.parallel_config.tensor_parallel_size
        self.peers: dict[int, KvferryHandshakeMetadata] = {}
        self.vllm_config = vllm_config
        # Refuses, at start-up, KV cache groups kvferry cannot move (Mamba state...).
        self.groups = vllm_hetero.groups_of(kv_cache_config)
        self.reader_slots = vllm_hetero.reader_slots_for(self.config, vllm_config)
        self.verdicts: dict[str, Any] = {}  # remote engine id -> Mapping | IncompatibleError
        self.log_error = logger.error
        self._need_recv: dict[str, RecvSpec] = {}
        self._need_send: dict[str, list[int]] = {}
        self._need_expiry: dict[str, float] = {}
        self._need_release: dict[str, ReleaseSpec] = {}

    # handshake
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        for rank, meta in metadata.items():
            if not isinstance(meta, KvferryHandshakeMetadata):
                raise ValueError(f"KvferryConnector expects KvferryHandshakeMetadata, got {type(meta).__name__}")
            self.peers[int(rank)] = meta
        logger.info("KvferryConnector: workers %s", {r: m.address for r, m in sorted(self.peers.items())})

    # decode side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        if not self._valid_remote(params) and not self._adopt_foreign(request.request_id, params):
            return 0, False
        prompt = len(request.prompt_token_ids or ())
        remote = int(params.get("remote_num_tokens") or prompt)  # never claim what P did not compute
        count = min(prompt, remote) - num_computed_tokens
        if count > 0:
            return count, True
        return 0, False

    @staticmethod
    def _valid_remote(params: dict[str, Any]) -> bool:
        return (
            bool(params.get("remote_block_ids"))
            and isinstance(params.get("kvferry_peers"), list)
            and bool(params["kvferry_peers"])
            and params.get("remote_request_id") is not None
        )

    def _adopt_foreign(self, req_id: str, params: dict[str, Any]) -> bool:
        """Remote-prefill params without kvferry's own fields, as a proxy written for
        NIXL forwards them (``remote_host``, ``remote_port``, ``remote_block_ids``,
        ``remote_engine_id``, ``remote_request_id``). A kvferry prefill instance puts
        its rank 0's listen address in ``remote_host``/``remote_port``, so with one
        tensor-parallel rank on the prefill side that address is the peer to pull from
        (the handshake then says which incarnation answers). Otherwise the request is
        computed locally, with a warning that says why — never silently. Returns
        whether the params are usable now (they gain ``kvferry_peers``)."""
        why = None
        host, port, key = params.get("remote_host"), params.get("remote_port"), params.get("remote_request_id")
        tp = params.get("tp_size", 1)
        if not params.get("remote_block_ids"):
            why = "no remote_block_ids"
        elif not host or not isinstance(port, int) or not 0 < port < 65536:
            why = "no kvferry_peers and no usable remote_host/remote_port"
        elif key is None:
            why = "no remote_request_id (the key the prefill instance published under)"
        elif tp != 1:
            why = f"no kvferry_peers and the prefill instance has tp_size {tp} (its ranks' addresses are unknown)"
        if why is not None:
            params["do_remote_prefill"] = False  # warned once; the prompt is computed here
            logger.warning(
                "KvferryConnector: computing %s locally: its kv_transfer_params cannot be pulled (%s); "
                "forward the prefill's kv_transfer_params whole (kvferry_peers included)",
                req_id,
                why,
            )
            return False
        params["kvferry_peers"] = [{"address": f"{host}:{port}", "peer_id": None, "incarnation": None}]
        logger.info("KvferryConnector: %s: no kvferry_peers in kv_transfer_params; pulling from remote_host:remote_port %s:%s", req_id, host, port)
        return True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return  # nothing to pull, or already planned (the second call)
        params["do_remote_prefill"] = False  # one pull per request
        if not self._valid_remote(params) and not self._adopt_foreign(request.request_id, params):
            return
        if num_external_tokens <= 0:
            # Nothing to pull (a full local prefix hit, or vLLM skips reading cached
            # KV, as it does for prompt_logprobs): the prefill instance is told at once,
            # through the workers, so it frees the blocks now instead of at lease expiry.
            exp = params.get("kvferry_expires_at")
            self._need_release[request.request_id] = ReleaseSpec(
                key=str(params["remote_request_id"]),
                peers=list(params["kvferry_peers"]),
                expires_at=None if exp is None else float(exp),
                per_rank=vllm_hetero.release_all(self, params),
            )
            return
        if isinstance(params.get("kvferry_desc"), dict):
            # The prefill advertised its KV geometry: a planned pull (vllm_hetero.py).
            expires = params.get("kvferry_expires_at")
            if expires is not None:
                self._need_expiry[request.request_id] = float(expires)
            self._need_recv[request.request_id] = vllm_hetero.plan(self, request, blocks, params, RecvSpec)
            return
        if len(blocks.blocks) != 1:
            raise ValueError("KvferryConnector supports one KV cache group")
        group = [b for b in blocks.blocks[0] if not getattr(b, "is_null", False)]
        local = [b.block_id for b in group]
        cached = sum(1 for b in group if b.block_hash is not None)
        expires = params.get("kvferry_expires_at")
        if expires is not None:
            self._need_expiry[request.request_id] = float(expires)
        self._need_recv[request.request_id] = RecvSpec(
            key=str(params["remote_request_id"]),
            peers=list(params["kvferry_peers"]),
            remote_block_ids=_flat_block_ids(params["remote_block_ids"]),
            local_block_ids=local,
            skip_blocks=cached,
            release_also=[slot_key(str(params["remote_request_id"]), s) for s in range(1, self.reader_slots)],
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvferryConnectorMetadata:
        meta = KvferryConnectorMetadata(
            reqs_to_recv=self._need_recv,
            reqs_to_send=self._need_send,
            expires_at=self._need_expiry,
            reqs_to_release=self._need_release,
            idle=scheduler_output.total_num_scheduled_tokens == 0,
        )
        self._need_recv = {}
        self._need_send = {}
        self._need_expiry = {}
        self._need_release = {}
        return meta

    # prefill side
    def request_finished(self, request: Request, block_ids: list[int] | list[list[int]]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode"):
            # A decode-side request, or no P/D at all. A pull the worker started is the
            # worker's to finish (an abort cancels it and releases the publication);
            # one that never started is released from here.
            self._release_unpulled(request.request_id, params)
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted or failed prefill: nothing worth sending
        if len(self.peers) < self.tp_size:
            # Every rank publishes its own shard: without every rank's address the
            # decode side could not pull them all.
            logger.warning(
                "KvferryConnector: handshakes from %d of %d ranks; %s is not published",
                len(self.peers),
                self.tp_size,
                request.request_id,
            )
            return False, None
        groups = vllm_hetero.group_block_ids(block_ids, request.num_prompt_tokens, self.block_size, self.groups)
        ids = [b for g in groups for b in g if b]  # what is published: every held block
        if not ids:
            return False, None
        self._need_send[request.request_id] = ids
        ranks = [self.peers[r] for r in sorted(self.peers)]
        first = ranks[0]
        host, _, port = (first.address or ":0").rpartition(":")
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": ids,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.config.advertise_host or host,
            "remote_port": int(port),
            "remote_num_tokens": request.num_prompt_tokens,
            "tp_size": self.tp_size,
            "kvferry_peer_id": first.peer_id,
            "kvferry_incarnation": first.incarnation,
            "kvferry_peers": [
                {"address": self._advertised(m.address), "peer_id": m.peer_id, "incarnation": m.incarnation} for m in ranks
            ],
            "kvferry_expires_at": time.time() + self.config.lease_ttl,
        }
        vllm_hetero.advertise(self, params, groups)
        return True, params

    def _release_unpulled(self, req_id: str, params: dict[str, Any] | None) -> None:
        """A decode request finished before its pull began (aborted while waiting,
        or between allocation and the next step): the prefill instance's blocks are
        released now, through the workers, instead of at lease expiry."""
        planned = self._need_recv.pop(req_id, None)
        expires = self._need_expiry.pop(req_id, None)
        if planned is not None:
            per_rank = vllm_hetero.release_planned(planned)
            if per_rank is None and planned.release_also:
                keys = [planned.key, *planned.release_also]
                per_rank = [[(r, k) for k in keys] for r in range(len(planned.peers))]
            self._need_release[req_id] = ReleaseSpec(key=planned.key, peers=planned.peers, expires_at=expires, per_rank=per_rank)
        elif params and params.get("do_remote_prefill") and self._valid_remote(params):
            params["do_remote_prefill"] = False
            exp = params.get("kvferry_expires_at")
            self._need_release[req_id] = ReleaseSpec(
                key=str(params["remote_request_id"]),
                peers=list(params["kvferry_peers"]),
                expires_at=None if exp is None else float(exp),
                per_rank=vllm_hetero.release_all(self, params),
            )

    def _advertised(self, address: str | None) -> str | None:
        if address is None or not self.config.advertise_host:
            return address
        return f"{self.config.advertise_host}:{address.rpartition(':')[2]}"

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        return


# -- worker side ----------------------------------------------------------------------


@dataclass
class _Pull:
    req_id: str
    spec: RecvSpec
    deadline: float  # monotonic: a load error after this
    retry_until: float  # monotonic: misses are retried until then
    expires_at: float | None = None  # wall clock: the lease's advertised end
    started: float = field(default_factory=time.monotonic)
    transfer: Transfer | None = None
    address: str | None = None
    incarnation: int | None = None  # the prefill rank's, as advertised
    dst: Region | None = None
    dst_ids: list[int] = field(default_factory=list)
    retry_at: float | None = None
    attempts: int = 0
    scratch: dict[str, torch.Tensor] | None = None
    scratch_region: Region | None = None
    error: BaseException | None = None
    undrained_since: float | None = None  # monotonic: failed, destination not yet quiet


def _tp_rank(vllm_config: VllmConfig) -> int:
    """This worker's tensor-parallel rank: from vLLM's TP group when it is
    initialized, else from the parallel config (``rank`` modulo the TP size; 0 for a
    single process)."""
    try:
        from vllm.distributed.parallel_state import get_tp_group

        return int(get_tp_group().rank_in_group)
    except Exception:  # not initialized: one process per rank, set up by the caller
        pc = vllm_config.parallel_config
        return int(getattr(pc, "rank", 0) or 0) % max(1, int(pc.tensor_parallel_size))


class KvferryConnectorWorker:
    """The half that lives in each worker process, next to the KV cache: owns the
    kvferry engine, publishes finished prefills and pulls remote ones."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> None:
        self.config = KvferryConfig.from_vllm(vllm_config)
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        kvc = vllm_config.kv_transfer_config
        assert kvc is not None
        self.engine_id = str(kvc.engine_id)
        self.listens = kvc.kv_role != "kv_consumer"
        self.tp_rank = _tp_rank(vllm_config)
        self.reader_slots = vllm_hetero.reader_slots_for(self.config, vllm_config)  # published per request (prefill)
        self.num_blocks: int | None = kv_cache_config.num_blocks if kv_cache_config is not None else None
        self.engine: Engine | None = None
        self.region: Region | None = None
        self.caches: dict[str, torch.Tensor] = {}
        self._pulls: dict[str, _Pull] = {}
        self._sending: set[str] = set()  # published, not yet released
        self._released: set[str] = set()  # released, not yet seen finished
        self._finished_seen: set[str] = set()  # finished, publication still out
        self._load_errors: set[int] = set()
        self._done_meta: KvferryConnectorMetadata | None = None
        self._releases: dict[str, Transfer] = {}  # release_remote in flight, by request
        self._draining: dict[str, _Pull] = {}  # aborted mid-pull, destination not yet quiet
        self.stats = KvferryConnectorStats()  # this interval's, taken by get_kv_connector_stats
        self.device: str | None = None  # the engine's device: None (host), "sim", "cuda:N"
        self._step_done: Any = None  # CUDA: event recorded after the step's forward
        self._to_publish: dict[str, tuple[list[int], float]] = {}  # CUDA: waiting for _step_done
        self._idle = False  # the current step runs no forward pass
        self._pieces: list[Any] = []  # raw per-layer pieces [num_blocks, piece_bytes] (vllm_hetero)
        self._geo: dict[str, Any] = {}
        self._slot_owner: dict[str, str] = {}  # published reader-slot key -> request
        self._slots_left: dict[str, int] = {}  # request -> slots not yet released
        self._slot_reason: dict[str, str] = {}  # request -> reason reported once its last slot is released
        self._release_batch: dict[str, tuple[list[float | None], list[str]]] | None = None  # vllm_hetero.batched_releases
        self._read_defer: list[Any] | None = None  # vllm_hetero.batched_gets

    # setup
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        caches: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in kv_caches.items():
            ptr = t.data_ptr()
            if ptr in seen:  # a layer sharing another's cache moves once
                continue
            seen.add(ptr)
            caches[name] = t
        if not caches:
            raise ValueError("KvferryConnector: no KV caches to register")
        self.device = self._device_for(caches)
        first = next(iter(caches.values()))
        nb = self.num_blocks
        if nb is None:
            nb = int(first.shape[0])  # vLLM 0.33's per-layer view: [blocks, heads, tokens, content]
        self.num_blocks = nb
        # Where every K and V head vector lies, from vLLM's own description of the
        # cache (backends, resolved layout, spec); refused by name, never guessed,
        # before any engine starts.
        phys, self._geo = vllm_hetero.geometry(self, caches)
        self._pieces = self._geo.pop("pieces")
        cfg = self.config
        port = cfg.port + self.tp_rank if cfg.port else 0
        peer_id = f"{cfg.peer_id or 'kvferry-' + self.engine_id}-tp{self.tp_rank}"
        self.engine = Engine(
            listen=f"{cfg.host}:{port}" if self.listens else None,
            secret=cfg.secret,
            arena_bytes=cfg.arena_bytes,
            peer_id=peer_id,
            ttl=cfg.lease_ttl,
            max_ttl=cfg.lease_ttl,
            io_timeout=cfg.io_timeout,
            connect_timeout=cfg.connect_timeout,
            device=self.device or "host",
            device_timeout=cfg.device_timeout or cfg.timeout,
        )
        self.caches = caches
        self.region = self._register(phys, nb, "vllm-kv")
        logger.info(
            "KvferryConnector worker tp%d: %s, %d blocks of %d bytes in %s memory, incarnation %#x",
            self.tp_rank,
            self.engine.address or "client only",
            self.region.num_blocks,
            self.region.block_bytes,
            self.device or "host",
            self.engine.incarnation,
        )

    def _device_for(self, caches: dict[str, torch.Tensor]) -> str | None:
        """The engine's device for these tensors (see ``device`` in the module docs)."""
        places = {(t.device.type, t.device.index) for t in caches.values()}
        if len(places) != 1:
            raise ValueError(f"KvferryConnector: KV caches on several devices {sorted(map(str, places))}; one engine moves one device's memory")
        kind, index = places.pop()
        if kind == "cpu":
            return "sim" if self.config.device == "sim" else None
        if kind == "cuda":
            if self.config.device == "sim":
                raise ValueError("KvferryConnector: device='sim' adopts CPU KV caches; these are CUDA tensors (leave device unset)")
            return f"cuda:{index or 0}"
        raise ValueError(f"KvferryConnector: KV caches on {kind}; kvferry moves CPU and CUDA memory (and CPU memory as its sim device)")

    def _register(self, caches: dict[str, torch.Tensor], num_blocks: int, name: str) -> Region:
        """Registers per-layer tensors as one region of this worker's engine: on the sim
        device, CPU tensors are adopted as its memory first."""
        assert self.engine is not None
        if self.device == "sim":
            mems = {n: self.engine.adopt_host_memory(t, name=f"{name}[{n}]") for n, t in caches.items()}
            return self.engine.register_kv_caches(mems, num_blocks=num_blocks, name=name)
        return self.engine.register_kv_caches(caches, num_blocks=num_blocks, name=name)

    def get_handshake_metadata(self) -> KvferryHandshakeMetadata | None:
        if self.engine is None or self.region is None:
            return None
        return KvferryHandshakeMetadata(
            address=self.engine.address,
            peer_id=self.engine.peer_id,
            incarnation=self.engine.incarnation,
            tp_rank=self.tp_rank,
            num_blocks=self.region.num_blocks,
            block_bytes=self.region.block_bytes,
            layout=self._geo.get("layout", "NHD"),
            heads_per_rank=self._geo.get("heads_per_rank", 0),
            pieces=len(self._pieces),
            piece_bytes=int(self._pieces[0].shape[1]) if self._pieces else 0,
            dtype=self._geo.get("dtype", ""),
            elem_size=self._geo.get("elem_size", 0),
            cache_layout=self._geo.get("cache_layout", ""),
        )

    # per step
    def start_step(self, meta: KvferryConnectorMetadata) -> None:
        """Publishes this step's finished prefills and starts its pulls (once per
        metadata object; both start_load_kv and wait_for_save call it)."""
        if self._done_meta is meta:  # a reference, not id(): ids of freed objects recur
            return
        self._done_meta = meta
        self._idle = meta.idle
        for req_id, block_ids in meta.reqs_to_send.items():
            self._publish(req_id, block_ids)
        # One Release per prefill rank and step; the step's reads as batched gets.
        with vllm_hetero.batched_releases(self), vllm_hetero.batched_gets(self):
            for req_id, spec in meta.reqs_to_recv.items():
                self._start_pull(req_id, spec, meta.expires_at.get(req_id))
            for req_id, rel in meta.reqs_to_release.items():
                if rel.per_rank is not None:
                    vllm_hetero.release_keys(self, req_id, rel)
        for req_id, rel in meta.reqs_to_release.items():
            if rel.per_rank is not None:
                continue
            peer = rel.peers[self.tp_rank] if len(rel.peers) > self.tp_rank else {}
            inc = peer.get("incarnation")
            self._release_remote(req_id, rel.key, peer.get("address"), rel.expires_at, inc if isinstance(inc, int) else None)

    def _release_remote(
        self, req_id: str, key: str, address: str | None, expires_at: float | None, incarnation: int | None = None
    ) -> None:
        """Tells the prefill instance (this rank's peer) that ``key`` will not be
        pulled, so it frees the blocks now. The prefill may not have published yet (it
        publishes a step after it returned the params, and a slow step is why a decode
        gives up), so a miss is retried until the lease's advertised end (``timeout``
        when none was advertised): the release lands within a retry interval (at most
        50 ms) of the publication. A ``Release`` request stages nothing, so a prefill
        whose staging is full (``Busy``) is still told. In the background; a failure
        only means the blocks wait for the lease to expire."""
        if self.engine is None or not address:
            return
        timeout = self.config.timeout
        retry = timeout if expires_at is None else max(0.0, expires_at - time.time())
        inc = incarnation if incarnation is not None and 0 <= incarnation < 1 << 64 else None
        try:
            self._releases[req_id] = self.engine.release_remote(
                address, key, timeout=retry + timeout, retry_miss=retry, incarnation=inc
            )
            self.stats.record_release()
        except errors.Error as e:
            logger.debug("KvferryConnector: releasing %s on %s failed: %s", req_id, address, e)

    def _reap_releases(self) -> None:
        for req_id, t in list(self._releases.items()):
            if t.done():
                del self._releases[req_id]
                if t.error is not None and not isinstance(t.error, errors.NotFoundError):
                    logger.debug("KvferryConnector: release of %s: %s", req_id, t.error)

    def mark_step_computed(self) -> None:
        """Called after the step's forward was enqueued (``wait_for_save``): on a CUDA
        cache, records an event on the current stream, so blocks are published only
        once the kernels that wrote them have completed."""
        if self.device is not None and self.device.startswith("cuda"):
            event_cls: Any = torch.cuda.Event  # untyped in torch's stubs
            ev = event_cls()
            ev.record()
            self._step_done = ev

    def _publish(self, req_id: str, block_ids: list[int]) -> None:
        """Publishes a finished prefill's blocks; on a CUDA cache, not before the step
        that computed them has completed on the GPU (polled each step, bounded by
        ``timeout``: a GPU that never completes frees the blocks unpublished, and the
        decode gets a miss)."""
        if self.device is not None and self.device.startswith("cuda"):
            self._to_publish.setdefault(req_id, (block_ids, time.monotonic() + self.config.timeout))
            self._publish_computed()
            return
        self._publish_now(req_id, block_ids)

    def _publish_computed(self) -> None:
        if not self._to_publish:
            return
        done = self._step_done is None or bool(self._step_done.query())
        now = time.monotonic()
        for req_id, (ids, give_up_at) in list(self._to_publish.items()):
            if done:
                del self._to_publish[req_id]
                self._publish_now(req_id, ids)
            elif now > give_up_at:
                del self._to_publish[req_id]
                logger.error("KvferryConnector: the GPU did not finish computing %s within %ss; not published", req_id, self.config.timeout)
                self._released.add(req_id)

    def _publish_now(self, req_id: str, block_ids: list[int]) -> None:
        assert self.engine is not None and self.region is not None
        try:
            vllm_hetero.publish_slots(self, req_id, block_ids)
        except errors.Error as e:
            # Nothing pins the blocks: free them now; the decode side gets a miss.
            logger.error("KvferryConnector: publishing %s failed: %s", req_id, e)
            self._released.add(req_id)
            return
        self._sending.add(req_id)

    def _start_pull(self, req_id: str, spec: RecvSpec, expires_at: float | None) -> None:
        assert self.engine is not None and self.region is not None
        now = time.monotonic()
        deadline = now + self.config.timeout
        # The prefill instance publishes one engine step after it returned the params,
        # so a miss is retried — until the lease would have ended (the wall-clock
        # expiry it advertised), and never past the timeout.
        retry_until = deadline if expires_at is None else min(deadline, now + max(0.0, expires_at - time.time()))
        pull = _Pull(req_id, spec, deadline=deadline, retry_until=retry_until, expires_at=expires_at)
        self._pulls[req_id] = pull
        try:
            if spec.plans is not None:
                vllm_hetero.start_reads(self, pull)
                return
            if len(spec.peers) <= self.tp_rank:
                raise errors.InvalidArgumentError(
                    f"prefill instance has {len(spec.peers)} tensor-parallel ranks; this is rank {self.tp_rank}"
                )
            peer = spec.peers[self.tp_rank]
            pull.address = peer.get("address")
            inc = peer.get("incarnation")
            pull.incarnation = int(inc) if isinstance(inc, int) and 0 <= inc < 1 << 64 else None
            if not pull.address:
                raise errors.InvalidArgumentError(f"no kvferry address for rank {self.tp_rank}: {peer}")
            n_remote = len(spec.remote_block_ids)
            if spec.skip_blocks == 0 and len(spec.local_block_ids) >= n_remote:
                pull.dst, pull.dst_ids = self.region, spec.local_block_ids[:n_remote]
            else:
                # Part of the prompt is a local prefix-cache hit (or the block counts
                # differ): the publication is one chunk, so it lands in scratch blocks
                # and only the missing blocks are copied into the cache.
                pull.scratch = self._scratch(n_remote)
                pull.scratch_region = self._register(pull.scratch, n_remote, f"scratch-{req_id}")
                pull.dst, pull.dst_ids = pull.scratch_region, list(range(n_remote))
            self._launch(pull)
            if spec.release_also:  # the slots an auto prefill published besides key
                vllm_hetero.release_slots(self, req_id, spec.peers, expires_at, self.tp_rank, spec.release_also)
        except Exception as e:  # noqa: BLE001 - bad params, no memory...: a load error, never a crash
            pull.error = e

    def _launch(self, pull: _Pull) -> None:
        assert self.engine is not None and pull.address is not None and pull.dst is not None
        pull.attempts += 1
        pull.retry_at = None
        left = max(0.001, pull.deadline - time.monotonic())
        # Naming the incarnation that published: a restarted prefill instance is refused
        # at once (PeerRestartedError, a load error) instead of missing until timeout.
        pull.transfer = self.engine.get(
            pull.address, pull.spec.key, pull.dst, pull.dst_ids, timeout=left, path=self.config.path, incarnation=pull.incarnation
        )

    def _scratch(self, n: int) -> dict[str, torch.Tensor]:
        """``n`` scratch blocks shaped like the registered region: one raw
        ``[n, piece_bytes]`` buffer per piece, in region order."""
        return {f"piece{i}": torch.empty((n, int(p.shape[1])), dtype=torch.uint8, device=p.device) for i, p in enumerate(self._pieces)}

    def _land_scratch(self, pull: _Pull) -> None:
        assert pull.scratch is not None
        spec = pull.spec
        n = min(len(spec.local_block_ids), len(spec.remote_block_ids))
        src = torch.arange(spec.skip_blocks, n)
        dst = torch.tensor(spec.local_block_ids[spec.skip_blocks : n], dtype=torch.long)
        if len(src) == 0:
            return
        for i, piece in enumerate(self._pieces):
            piece[dst] = pull.scratch[f"piece{i}"][src]

    def _drop_scratch(self, pull: _Pull) -> None:
        if pull.scratch_region is not None and self.engine is not None:
            try:
                self.engine.deregister(pull.scratch_region, timeout=self.config.timeout)
            except errors.Error as e:  # still in use after the bound: leave it to GC
                logger.warning("KvferryConnector: scratch for %s not deregistered: %s", pull.req_id, e)
        pull.scratch_region = None
        pull.scratch = None

    def _wait_idle(self) -> None:
        """In a step without a forward pass, gives the transfers the CPU: waits (GIL
        released) up to ``idle_wait`` for the oldest pull in flight to finish."""
        if not self._idle or self.config.idle_wait <= 0:
            return
        for pull in self._pulls.values():
            t = pull.transfer
            if t is not None and not t.done():
                try:
                    t.wait(self.config.idle_wait)
                except (errors.Error, TimeoutError):
                    pass  # not finished yet, or failed: read below, as every step does
                return

    def transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        res = KVConnectorTransferResults()
        self._wait_idle()
        self._publish_computed()
        # Decode requests finished (aborted) while pulling: cancel without waiting, and
        # hand the blocks back (finished_recving) once the pull drained: at once if it
        # already has, else in a later step. Nothing here waits on the drain.
        for req_id in finished_req_ids:
            pull = self._pulls.pop(req_id, None)
            if pull is not None:
                t = pull.transfer
                landed = t is not None and t.done() and t.error is None
                if t is not None and not t.done():
                    t.cancel(timeout=0)
                if not landed and not isinstance(pull.error, errors.PeerRestartedError):
                    # Aborted before the bytes landed — or failed and not yet reported
                    # (its drain pending): the prefill instance may free the blocks
                    # now (a landed pull already sent Done; a pull still in _pulls has
                    # released nothing yet, whatever its error; a restarted prefill no
                    # longer holds them).
                    self._release_remote(req_id, pull.spec.key, pull.address, pull.expires_at, pull.incarnation)
                    vllm_hetero.give_up(self, pull)
                self._draining[req_id] = pull
            if req_id in self._sending or req_id in self._released or req_id in self._to_publish:
                self._finished_seen.add(req_id)
        for req_id, pull in list(self._draining.items()):
            if pull.transfer is None or pull.transfer.drained():
                del self._draining[req_id]
                self._drop_scratch(pull)
                res.finished_recving.add(req_id)
        now = time.monotonic()
        for req_id, pull in list(self._pulls.items()):
            if pull.error is None:
                t = pull.transfer
                if t is None:  # waiting to retry a miss
                    if pull.retry_at is not None and now < pull.retry_at:
                        continue
                    try:
                        self._launch(pull)
                    except Exception as e:  # noqa: BLE001
                        pull.error = e
                    else:
                        continue
                elif not t.done():
                    if now < pull.deadline + 1.0:
                        continue
                    # kvferry enforces the deadline itself; this is the backstop.
                    t.cancel(timeout=0)
                    pull.error = errors.TimeoutError(f"pull of {req_id} did not finish within {self.config.timeout}s")
                elif isinstance(t.error, errors.NotFoundError) and pull.dst is not None and time.monotonic() < pull.retry_until:
                    # A miss of a pull without a plan: launched again. A planned pull's
                    # RankReads retries its own misses until the same retry_until and
                    # its NotFoundError is final (it read the clock after ``now``).
                    pull.transfer = None
                    pull.retry_at = min(pull.retry_until, now + min(0.05, 0.002 * 2 ** min(pull.attempts, 5)))
                    continue
                else:
                    pull.error = t.error
            t = pull.transfer
            if t is not None and not t.drained():
                # Failed, but something (a device copy that outlived the transfer) may
                # still write the destination blocks: vLLM gets them back (the load
                # error) only once the device confirmed; polled each step, never waited.
                if pull.undrained_since is None:
                    pull.undrained_since = now
                    logger.warning(
                        "KvferryConnector: pull of %s failed (%r); its blocks are reported once the device confirms the copy into them",
                        req_id,
                        pull.error,
                    )
                continue
            if pull.error is None and pull.scratch is not None:
                try:
                    self._land_scratch(pull)
                except Exception as e:  # noqa: BLE001 - any failure is a load error
                    pull.error = e
            self._drop_scratch(pull)
            del self._pulls[req_id]
            res.finished_recving.add(req_id)
            if pull.error is None and pull.dst is None and pull.transfer is not None and hasattr(pull.transfer, "bytes_needed"):
                self.stats.record_pull(time.monotonic() - pull.started, pull.transfer.bytes_needed, len(pull.spec.load_block_ids))
            if pull.error is None and pull.dst is not None:
                self.stats.record_pull(time.monotonic() - pull.started, len(pull.dst_ids) * pull.dst.block_bytes, len(pull.dst_ids))
            if pull.error is not None:
                self.stats.record_failure(pull.error)
                logger.warning("KvferryConnector: pull of %s failed after %d attempt(s): %r", req_id, pull.attempts, pull.error)
                res.failed_recving.add(req_id)
                self._load_errors.update(pull.spec.load_block_ids)
                if not isinstance(pull.error, errors.PeerRestartedError):
                    # This side gives up on the blocks, whatever the last error was (a
                    # miss too: the prefill may publish after the decode's timeout), so
                    # the prefill may free them now. A restarted prefill no longer holds
                    # them.
                    self._release_remote(req_id, pull.spec.key, pull.address, pull.expires_at, pull.incarnation)
                    vllm_hetero.give_up(self, pull)
        self._reap_releases()
        # Publications released (decode's Done, abort, lease expiry, shutdown): the
        # blocks are free once the request was reported finished to this worker.
        if self.engine is not None:
            for key, reason in self.engine.released():
                if reason == "replaced":
                    continue
                req_id = key if isinstance(key, str) else bytes(key).decode(errors="replace")
                done = vllm_hetero.slot_released(self, req_id, str(reason))
                if done is None:
                    continue  # other reader slots of the request are still out
                req_id, reason = done
                self.stats.record_publication_released(reason)
                if req_id in self._sending:
                    self._sending.discard(req_id)
                    self._released.add(req_id)
                    logger.debug("KvferryConnector: %s released (%s)", req_id, reason)
        ready = self._released & self._finished_seen
        if ready:
            self._released -= ready
            self._finished_seen -= ready
            res.finished_sending |= ready
        return res

    def take_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        pulls = [*self._pulls.values(), *self._draining.values()]
        # Every pull is asked first, then each drain is waited for: a batched get is
        # cancelled only once every request riding it has left (vllm_reads._Batch).
        for pull in pulls:
            if pull.transfer is not None and not pull.transfer.done():
                pull.transfer.cancel(timeout=0)
        for pull in pulls:
            if pull.transfer is not None and not pull.transfer.drained():
                pull.transfer.cancel()
            self._drop_scratch(pull)
        self._pulls.clear()
        self._draining.clear()
        if self.engine is not None:
            report = self.engine.close(timeout=self.config.timeout)
            if not report.get("clean", True):
                logger.warning("KvferryConnector: engine closed with work outstanding: %s", report)


# -- the connector ---------------------------------------------------------------------


class KvferryConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM V1 KV connector moving prefill KV to decode instances with kvferry.

    One class, two roles (vLLM creates it once in the scheduler and once per worker);
    each role delegates to :class:`KvferryConnectorScheduler` or
    :class:`KvferryConnectorWorker`. Configuration: see this module's docstring.
    """

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """``LBHNC`` (heads outside tokens) for MHA/GQA caches: a head slice of a
        block — what a decode of another TP size reads — is then one run of
        ``block_size`` cells per head instead of one run per token, which cuts a
        heterogeneous read's byte ranges ``block_size``-fold; it is also the only
        layout vLLM's CPU backend reads. vLLM uses it wherever every backend supports
        it, and otherwise warns and picks another: ``vllm_layout`` maps ``LBNHC`` too
        and refuses the rest by name. None for MLA (one head slot: both orders are
        the same bytes)."""
        mc = vllm_config.model_config
        if mc is not None and bool(getattr(mc, "use_mla", False)):
            return None
        return "LBHNC"

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        try:
            import vllm

            if vllm.__version__ != VLLM_VERSION:
                logger.warning("KvferryConnector is pinned to vllm==%s; this is %s", VLLM_VERSION, vllm.__version__)
        except Exception:  # pragma: no cover
            pass
        self.connector_scheduler: KvferryConnectorScheduler | None = None
        self.connector_worker: KvferryConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KvferryConnectorScheduler(vllm_config, kv_cache_config)
        else:
            self.connector_worker = KvferryConnectorWorker(vllm_config, kv_cache_config)

    def _s(self) -> KvferryConnectorScheduler:
        assert self.connector_scheduler is not None, "scheduler-side method called on a worker connector"
        return self.connector_scheduler

    def _w(self) -> KvferryConnectorWorker:
        assert self.connector_worker is not None, "worker-side method called on a scheduler connector"
        return self.connector_worker

    # scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._s().get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # The request's own blocks are transferred: every transfer group is restored.
        return tuple(self._kv_cache_config.transfer_group_ids)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._s().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._s().build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        # Hybrid allocator: one block list per KV cache group (vllm_hetero.py).
        return self._s().request_finished(request, [list(g) for g in block_ids])

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._s().update_connector_output(connector_output)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._s().set_xfer_handshake_metadata(metadata)

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._w().register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._w().get_handshake_metadata() if self.connector_worker is not None else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvferryConnectorMetadata)
        self._w().start_step(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Pulls land between steps (asynchronous loads): nothing to wait for per layer.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        # Nothing is copied while computing: finished requests' blocks are published
        # zero copy (request_finished), and peers read them in place.
        return

    def wait_for_save(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.mark_step_computed()
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, KvferryConnectorMetadata):
                self._w().start_step(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._w().transfer_results(finished_req_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        res = self._w().transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._w().take_load_errors()

    # metrics (vllm_stats.py): taken after every step, combined across workers
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        w = self.connector_worker
        if w is None or w.stats.is_empty():
            return None
        return w.stats.clone_and_reset()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvferryConnectorStats(data=data) if data is not None else KvferryConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvferryPromMetrics:
        return KvferryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()


__all__ = [
    "KvferryConnector",
    "KvferryConnectorStats",
    "KvferryPromMetrics",
    "KvferryConnectorScheduler",
    "KvferryConnectorWorker",
    "KvferryConnectorMetadata",
    "KvferryHandshakeMetadata",
    "KvferryConfig",
    "RecvSpec",
    "VLLM_VERSION",
]
