"""The worker side of the connector: the rank's kvferry engine, its registered KV
caches, publications of finished prefill requests, pulls of remote KV into this
rank's blocks, releases, and what each step reports back to vLLM.

# Cancellation

A pull is a kvferry transfer: cancelling it (an abort, a timeout, shutdown) returns
only once it drained; its blocks go back to vLLM only after that (see
:meth:`KvferryConnectorWorker.transfer_results`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.logger import init_logger

from . import hetero as vllm_hetero
from ... import errors
from ..._engine import Engine, Region, Transfer
from .config import KvferryConfig
from .metadata import KvferryConnectorMetadata, KvferryHandshakeMetadata, RecvSpec
from .stats import KvferryConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger(__name__)


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
        self._pieces: list[Any] = []  # raw per-layer pieces [num_blocks, piece_bytes] (hetero.py)
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
