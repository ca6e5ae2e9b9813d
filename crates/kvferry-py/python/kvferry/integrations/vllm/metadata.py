"""What travels between the connector's halves: the handshake metadata a worker
publishes, and the per-step metadata the scheduler builds for the workers (which
requests to pull, publish and release)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata


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
    layout: str = "NHD"  # a piece's cell order (layout.py), e.g. "HNKD"
    heads_per_rank: int = 0
    pieces: int = 0
    piece_bytes: int = 0
    dtype: str = ""
    elem_size: int = 0
    cache_layout: str = ""  # backend/KVCacheLayout (order), for messages
    # Where the worker sits in its deployment (parallel.py): its pipeline stage (each
    # stage registers only its own layers, ``layers`` in region order) and its engine
    # core's data-parallel rank.
    pp_rank: int = 0
    pp_size: int = 1
    dp_rank: int = 0
    layers: tuple[str, ...] = ()


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
    # The refusal is the prompt check's (prompt.py): the publication is not this
    # request's prompt's; reported as a WrongPromptError (kind ``wrong_prompt``).
    wrong_prompt: bool = False
    npub: int = 0
    src_piece_bytes: int = 0
    # Params without a descriptor (a proxy written for NIXL): the other reader slots
    # the prefill published besides ``key`` (as many as this instance would publish),
    # released when the pull starts, or with ``key`` when it never does.
    release_also: list[str] = field(default_factory=list)
    # Pipeline stages ``peers`` is cut into (parallel.py): the prefill's PP size when
    # it equals the decode's — each decode stage then deals only with its own stage's
    # slice of ``peers`` —, else 1 (``peers`` whole, handled by stage 0 alone).
    stages: int = 1
    # Where the blocks are, for messages and stats: the prefill engine core's id and
    # data-parallel rank (``remote_dp_rank`` of the params; None when not given).
    remote_engine_id: str | None = None
    remote_dp_rank: int | None = None

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
    stages: int = 1  # as RecvSpec.stages


@dataclass
class KvferryConnectorMetadata(KVConnectorMetadata):
    """Scheduler → worker, once per step: pulls to start, publications to release
    on the prefill side, and blocks to publish."""

    reqs_to_recv: dict[str, RecvSpec] = field(default_factory=dict)
    reqs_to_send: dict[str, list[int]] = field(default_factory=dict)
    # The key each of ``reqs_to_send`` is published under (prompt.publication_key);
    # a request absent here is published under its request id.
    publish_keys: dict[str, str] = field(default_factory=dict)
    expires_at: dict[str, float] = field(default_factory=dict)  # wall clock, per pull
    reqs_to_release: dict[str, ReleaseSpec] = field(default_factory=dict)
    idle: bool = False  # this step schedules no tokens: no forward pass runs
    # SchedulerOutput.preempted_req_ids: their blocks are vLLM's again (preemption.py)
    preempted: set[str] = field(default_factory=set)


def _flat_block_ids(ids: Any) -> list[int]:
    """``[1, 2]`` or one list per KV cache group (``([1, 2],)``) → ``[1, 2]``."""
    ids = list(ids or [])
    if ids and isinstance(ids[0], (list, tuple)):
        if len(ids) != 1:
            raise ValueError(f"KvferryConnector supports one KV cache group, got {len(ids)}")
        ids = list(ids[0])
    return [int(b) for b in ids]


# -- scheduler side ------------------------------------------------------------------
