"""The scheduler side of the connector: which requests have remote KV, how many tokens
they bring, which blocks a finished prefill request keeps published, and the per-step
metadata for the workers."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
from vllm.logger import init_logger

from . import hetero as vllm_hetero
from .config import KvferryConfig
from .mapping import slot_key
from .metadata import KvferryConnectorMetadata, KvferryHandshakeMetadata, RecvSpec, ReleaseSpec, _flat_block_ids

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


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
            preempted=set(scheduler_output.preempted_req_ids or ()),
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
        elif params and params.get("do_remote_prefill") and (self._valid_remote(params) or self._adopt_foreign(req_id, params)):
            # Never allocated: aborted while waiting, or rejected before admission
            # (vLLM's notify_kv_transfer_request_rejected adds it pre-aborted so that
            # this hook frees the prefill's blocks), NIXL-style params included.
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
