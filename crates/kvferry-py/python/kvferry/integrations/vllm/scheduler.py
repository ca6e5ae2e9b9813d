"""The scheduler side of the connector: which requests have remote KV, how many tokens
they bring, which blocks a finished prefill request keeps published, and the per-step
metadata for the workers."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
from vllm.logger import init_logger

from . import hetero as vllm_hetero
from . import parallel
from . import prompt as vllm_prompt
from .config import KvferryConfig
from .mapping import RankPlan, slot_key
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
        # This engine core's DP rank and PP size (parallel.py).
        self.place = parallel.placement(vllm_config, worker=False)
        self.pp_size: int = self.place.pp_size
        # Every worker's handshake by (pp_rank, tp_rank); ``peers``: stage 0's by TP
        # rank (the instance's descriptor comes from its rank 0); ``stages``: each
        # stage's layers as the params carry them.
        self.workers: dict[tuple[int, int], KvferryHandshakeMetadata] = {}
        self.peers: dict[int, KvferryHandshakeMetadata] = {}
        self.stages: dict[int, list[Any]] = {}
        self.vllm_config = vllm_config
        # Refuses, at start-up, KV cache groups kvferry cannot move (Mamba state...).
        self.groups = vllm_hetero.groups_of(kv_cache_config)
        self.reader_slots = vllm_hetero.reader_slots_for(self.config, vllm_config)
        self.verdicts: dict[str, Any] = {}  # remote engine id -> Mapping | IncompatibleError
        self.log_error = logger.error
        self._need_recv: dict[str, RecvSpec] = {}
        self._need_send: dict[str, list[int]] = {}
        self._need_keys: dict[str, str] = {}  # publication key of each of _need_send
        self._need_expiry: dict[str, float] = {}
        self._need_release: dict[str, ReleaseSpec] = {}

    # handshake
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Handshakes of a single-stage instance, by TP rank."""
        self.set_handshakes({(0, int(r)): m for r, m in metadata.items()})

    def set_handshakes(self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        """Every worker's handshake, keyed ``(pp_rank, tp_rank)`` as vLLM 0.33 hands
        them over (``set_xfer_handshake_metadata_pp_aware``): each pipeline stage's
        workers hold, and publish, only that stage's layers."""
        for (pp, tp), meta in metadata.items():
            if not isinstance(meta, KvferryHandshakeMetadata):
                raise ValueError(f"KvferryConnector expects KvferryHandshakeMetadata, got {type(meta).__name__}")
            if not (0 <= int(pp) < self.pp_size and 0 <= int(tp) < self.tp_size):
                raise ValueError(
                    f"KvferryConnector: a handshake from worker (pp {pp}, tp {tp}) outside this instance's "
                    f"pipeline_parallel_size {self.pp_size} x tensor_parallel_size {self.tp_size} "
                    "(context parallelism, which numbers more ranks, is not supported)"
                )
            self.workers[(int(pp), int(tp))] = meta
            if int(pp) == 0:
                self.peers[int(tp)] = meta
            if int(tp) == 0 and meta.layers:
                self.stages[int(pp)] = parallel.stage_signature(meta.layers)
        logger.info(
            "KvferryConnector (%s): workers %s",
            f"DP rank {self.place.dp_rank}" if self.place.uses_dp else "one DP rank",
            {f"pp{p} tp{t}" if self.pp_size > 1 else t: m.address for (p, t), m in sorted(self.workers.items())},
        )

    # decode side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        if not self._valid_remote(params) and not self._adopt_foreign(request.request_id, params):
            return 0, False
        if self._refuse_placement(request.request_id, params):
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

    def _refuse_placement(self, req_id: str, params: dict[str, Any]) -> bool:
        """Params whose DP fields are malformed, or — without a descriptor, so without
        a compatibility handshake to refuse them — whose pipeline stages cannot feed
        this instance's: computed locally with a warning that says why, and the
        prefill told to free its blocks now. Returns whether the request was refused.
        (With a descriptor a PP mismatch is the handshake's refusal: hetero.plan.)"""
        why = self._placement_problem(params)
        if why is None:
            return False
        params["do_remote_prefill"] = False
        logger.warning(
            "KvferryConnector: computing %s locally: its kv_transfer_params from prefill engine %s (DP rank %s) "
            "cannot be pulled here: %s",
            req_id,
            params.get("remote_engine_id"),
            params.get("remote_dp_rank", "?"),
            why,
        )
        if params.get("remote_request_id") is not None and isinstance(params.get("kvferry_peers"), list):
            self._release_all_later(req_id, params)
        return True

    def _release_all_later(self, req_id: str, params: dict[str, Any]) -> None:
        """Queues, for the next step's metadata, the release of every block the
        prefill's params offer (every reader slot, every prefill rank and stage)."""
        exp = params.get("kvferry_expires_at")
        stages = parallel.stages_of(params, self.pp_size)
        self._need_release[req_id] = ReleaseSpec(
            key=str(params["remote_request_id"]),
            peers=list(params["kvferry_peers"]),
            expires_at=None if exp is None else float(exp),
            per_rank=vllm_hetero.release_all(self, params, stages),
            stages=stages,
        )

    def may_load_async(self, request: Request) -> bool:
        """Whether :meth:`get_num_new_matched_tokens` may answer ``(n, True)`` for
        ``request`` (vLLM 0.34 asks each time the request enters a waiting queue): its
        params ask for a remote prefill that kvferry can pull — kvferry's own fields,
        or a NIXL-style proxy's for a one-rank prefill — from a placement this
        instance can read. Reads the params only: no warning, no release, nothing
        changed (those happen when the scheduler asks for the tokens). It can only
        be wrong the way vLLM allows: a request whose prompt turns out to be all local
        prefix hits is answered ``(0, False)`` later."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return False
        if not self._valid_remote(params) and self._foreign_problem(params) is not None:
            return False
        return self._placement_problem(params) is None

    def _placement_problem(self, params: dict[str, Any]) -> str | None:
        """Why params cannot be pulled from their DP rank or pipeline stages (without
        a descriptor; with one, a mismatch is the handshake's refusal), or None."""
        why = parallel.dp_problem(params)
        if why is None and not isinstance(params.get("kvferry_desc"), dict):
            diffs = parallel.pp_differences(params, self.pp_size, self.stages)
            why = "; ".join(diffs) if diffs else None
        return why

    def _foreign_problem(self, params: dict[str, Any]) -> str | None:
        """Why params without kvferry's fields (a proxy written for NIXL) cannot be
        pulled (see :meth:`_adopt_foreign`), or None."""
        host, port, key = params.get("remote_host"), params.get("remote_port"), params.get("remote_request_id")
        tp = params.get("tp_size", 1)
        if not params.get("remote_block_ids"):
            return "no remote_block_ids"
        if not host or not isinstance(port, int) or not 0 < port < 65536:
            return "no kvferry_peers and no usable remote_host/remote_port"
        if key is None:
            return "no remote_request_id (the key the prefill instance published under)"
        if tp != 1:
            return f"no kvferry_peers and the prefill instance has tp_size {tp} (its ranks' addresses are unknown)"
        if params.get("pp_size", 1) != 1 or self.pp_size != 1:
            return (
                f"no kvferry_peers, and pipeline parallel (prefill pp_size {params.get('pp_size', 1)}, "
                f"decode {self.pp_size}): each stage's address is unknown"
            )
        return None

    def _adopt_foreign(self, req_id: str, params: dict[str, Any]) -> bool:
        """Remote-prefill params without kvferry's own fields, as a proxy written for
        NIXL forwards them (``remote_host``, ``remote_port``, ``remote_block_ids``,
        ``remote_engine_id``, ``remote_request_id``). A kvferry prefill instance puts
        its rank 0's listen address in ``remote_host``/``remote_port``, so with one
        tensor-parallel rank on the prefill side that address is the peer to pull from
        (the handshake then says which incarnation answers). Otherwise the request is
        computed locally, with a warning that says why — never silently. Returns
        whether the params are usable now (they gain ``kvferry_peers``)."""
        why = self._foreign_problem(params)
        host, port = params.get("remote_host"), params.get("remote_port")
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
            stages = parallel.stages_of(params, self.pp_size)
            self._need_release[request.request_id] = ReleaseSpec(
                key=str(params["remote_request_id"]),
                peers=list(params["kvferry_peers"]),
                expires_at=None if exp is None else float(exp),
                per_rank=vllm_hetero.release_all(self, params, stages),
                stages=stages,
            )
            return
        why = vllm_prompt.refusal(str(params["remote_request_id"]), request.prompt_token_ids or ())
        if why is not None:
            self._refuse_wrong_prompt(request, blocks, params, why)
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
            stages=parallel.stages_of(params, self.pp_size),
            remote_engine_id=None if params.get("remote_engine_id") is None else str(params["remote_engine_id"]),
            remote_dp_rank=parallel.remote_dp_rank(params),
        )

    def _refuse_wrong_prompt(self, request: Request, blocks: KVCacheBlocks, params: dict[str, Any], why: str) -> None:
        """The publication the params name is not bound to this request's prompt
        (:mod:`.prompt`): nothing is read. The request gets a refused pull — every
        worker reports its blocks as a load error (kind ``wrong_prompt``), which
        ``kv_load_failure_policy`` turns into a local recompute or a failed request —
        and every slot of the named publication is released at once, so the prefill
        frees its blocks within a round trip instead of at lease expiry."""
        req_id = request.request_id
        key = str(params["remote_request_id"])
        peers = list(params["kvferry_peers"])
        stages = parallel.stages_of(params, self.pp_size)
        kvc = self.vllm_config.kv_transfer_config
        logger.warning(
            "KvferryConnector: refusing the KV named for %s (prefill engine %s): %s; a load error, which "
            "kv_load_failure_policy=%s turns into %s",
            req_id,
            params.get("remote_engine_id"),
            why,
            getattr(kvc, "kv_load_failure_policy", "?"),
            "a local recompute" if getattr(kvc, "kv_load_failure_policy", None) == "recompute" else "a failed request",
        )
        per_rank = vllm_hetero.release_all(self, params, stages)
        if per_rank is None:  # one key per prefill rank, spread over the decode ranks
            per_rank = [[(q, key) for q in range(len(peers) // stages) if q % self.tp_size == r] for r in range(self.tp_size)]
        expires = params.get("kvferry_expires_at")
        if expires is not None:
            self._need_expiry[req_id] = float(expires)
        self._need_recv[req_id] = RecvSpec(
            key=key,
            peers=peers,
            remote_block_ids=[],
            local_block_ids=[
                b.block_id for g in blocks.blocks for b in g if not getattr(b, "is_null", False) and b.block_hash is None
            ],
            plans=[RankPlan(releases=list(per_rank[r]) if r < len(per_rank) else []) for r in range(self.tp_size)],
            refused=why,
            wrong_prompt=True,
            stages=stages,
            remote_engine_id=None if params.get("remote_engine_id") is None else str(params["remote_engine_id"]),
            remote_dp_rank=parallel.remote_dp_rank(params),
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvferryConnectorMetadata:
        meta = KvferryConnectorMetadata(
            reqs_to_recv=self._need_recv,
            reqs_to_send=self._need_send,
            publish_keys=self._need_keys,
            expires_at=self._need_expiry,
            reqs_to_release=self._need_release,
            idle=scheduler_output.total_num_scheduled_tokens == 0,
            preempted=set(scheduler_output.preempted_req_ids or ()),
        )
        self._need_recv = {}
        self._need_send = {}
        self._need_keys = {}
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
        if len(self.workers) < self.tp_size * self.pp_size:
            # Every worker publishes its own shard (its heads of its stage's layers):
            # without every worker's address the decode side could not pull them all.
            logger.warning(
                "KvferryConnector: handshakes from %d of %d workers; %s is not published",
                len(self.workers),
                self.tp_size * self.pp_size,
                request.request_id,
            )
            return False, None
        groups = vllm_hetero.group_block_ids(block_ids, request.num_prompt_tokens, self.block_size, self.groups)
        ids = [b for g in groups for b in g if b]  # what is published: every held block
        if not ids:
            return False, None
        self._need_send[request.request_id] = ids
        # The key is bound to the prompt (prompt.py): a decode reads it only for a
        # request with this very prompt.
        key = vllm_prompt.publication_key(request.request_id, vllm_prompt.prompt_digest(request.prompt_token_ids or ()))
        self._need_keys[request.request_id] = key
        ranks = [self.workers[w] for w in sorted(self.workers)]  # stage-major: pp x TP + tp
        first = ranks[0]
        host, _, port = (first.address or ":0").rpartition(":")
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": ids,
            "remote_engine_id": self.engine_id,
            "remote_request_id": key,
            "remote_host": self.config.advertise_host or host,
            "remote_port": int(port),
            "remote_num_tokens": request.num_prompt_tokens,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "remote_dp_rank": self.place.dp_rank,
            "dp_size": self.place.dp_size,
            "kvferry_peer_id": first.peer_id,
            "kvferry_incarnation": first.incarnation,
            "kvferry_peers": [
                {"address": self._advertised(m.address), "peer_id": m.peer_id, "incarnation": m.incarnation} for m in ranks
            ],
            "kvferry_expires_at": time.time() + self.config.lease_ttl,
        }
        if self.pp_size > 1:
            params["kvferry_stages"] = [self.stages.get(s) for s in range(self.pp_size)]
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
                per_rank = [[(r, k) for k in keys] for r in range(len(planned.peers) // max(1, planned.stages))]
            self._need_release[req_id] = ReleaseSpec(
                key=planned.key, peers=planned.peers, expires_at=expires, per_rank=per_rank, stages=planned.stages
            )
        elif params and params.get("do_remote_prefill") and (self._valid_remote(params) or self._adopt_foreign(req_id, params)):
            # Never allocated: aborted while waiting, or rejected before admission
            # (vLLM's notify_kv_transfer_request_rejected adds it pre-aborted so that
            # this hook frees the prefill's blocks), NIXL-style params included.
            params["do_remote_prefill"] = False
            self._release_all_later(req_id, params)

    def _advertised(self, address: str | None) -> str | None:
        if address is None or not self.config.advertise_host:
            return address
        return f"{self.config.advertise_host}:{address.rpartition(':')[2]}"

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        return


# -- worker side ----------------------------------------------------------------------
