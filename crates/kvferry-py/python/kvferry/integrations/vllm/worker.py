"""The worker side of the connector: the rank's kvferry engine, its registered KV
caches, publications of finished prefill requests, pulls of remote KV into this
rank's blocks, releases, and what each step reports back to vLLM.

# Cancellation

A pull is a kvferry transfer: cancelling it (an abort, a timeout, shutdown) returns
only once it drained; its blocks go back to vLLM only after that (see
:meth:`KvferryConnectorWorker.transfer_results`)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.logger import init_logger

from . import hetero as vllm_hetero
from . import parallel
from ... import errors
from ..._engine import Engine, Region, Transfer
from .config import KvferryConfig
from .ledger import PullRecord, RequestLedger, Seen
from .mapping import RankPlan
from .metadata import KvferryConnectorMetadata, KvferryHandshakeMetadata, RecvSpec
from .reads import WAIT_MARGIN, RankReads
from .stats import KvferryConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = init_logger(__name__)


@dataclass(kw_only=True)
class _Pull(PullRecord):
    """A pull's I/O beside its lifecycle (:class:`~.ledger.PullRecord`): the
    transfer, its destination and scratch memory."""

    spec: RecvSpec
    transfer: Transfer | None = None
    address: str | None = None
    incarnation: int | None = None  # the prefill rank's, as advertised
    dst: Region | None = None
    dst_ids: list[int] = field(default_factory=list)
    scratch: dict[str, torch.Tensor] | None = None
    scratch_region: Region | None = None


def _tp_rank(vllm_config: VllmConfig) -> int:
    """This worker's tensor-parallel rank: from vLLM's TP group when it is
    initialized, else from the parallel config (``rank`` modulo the TP size; 0 for a
    single process)."""
    return parallel.placement(vllm_config).tp_rank


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
        # DP rank, pipeline stage, TP rank (parallel.py): the listen port, the peer id
        # and which prefill workers this one pulls from follow from it.
        self.place = parallel.placement(vllm_config)
        self.tp_rank = self.place.tp_rank
        self.pp_rank = self.place.pp_rank
        self.reader_slots = vllm_hetero.reader_slots_for(self.config, vllm_config)  # published per request (prefill)
        self.num_blocks: int | None = kv_cache_config.num_blocks if kv_cache_config is not None else None
        self.engine: Engine | None = None
        self.region: Region | None = None
        self.caches: dict[str, torch.Tensor] = {}
        # Every request's lifecycle on this worker, both sides (ledger.py); the
        # worker keeps only I/O: release transfers in flight, by tag.
        self.ledger = RequestLedger(timeout=self.config.timeout)
        self._releases: dict[str, Transfer] = {}
        self._done_meta: KvferryConnectorMetadata | None = None
        self.stats = KvferryConnectorStats()  # this interval's, taken by get_kv_connector_stats
        self.device: str | None = None  # the engine's device: None (host), "sim", "cuda:N"
        self._step_done: Any = None  # CUDA: event recorded after the step's forward
        self._idle = False  # the current step runs no forward pass
        self._pieces: list[Any] = []  # raw per-layer pieces [num_blocks, piece_bytes] (hetero.py)
        self._geo: dict[str, Any] = {}
        self._read_defer: list[Any] | None = None  # vllm_hetero.batched_gets
        self._pub_keys: dict[str, str] = {}  # request -> its publication key, until published
        self.phys: dict[str, torch.Tensor] = {}  # what is registered (sleep.py registers it again)
        self.asleep = False  # sleep.py: the KV cache is deregistered

    # setup
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Starts this rank's engine and registers its KV cache; called again (vLLM
        0.34's grown cache), registers the new views instead (:mod:`.extend`)."""
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
        if self.engine is not None:
            from .extend import register_again

            register_again(self, caches)
            return
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
        port = parallel.listen_port(cfg.port, self.place)
        peer_id = parallel.peer_id(cfg.peer_id or "kvferry-" + self.engine_id, self.place)
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
            transport=cfg.transport,
        )
        self.caches, self.phys = caches, phys
        self.region = self._register(phys, nb, "vllm-kv")
        logger.info(
            "KvferryConnector worker %s: %s, %d blocks of %d bytes in %s memory, incarnation %#x",
            self.place.describe(),
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
            pp_rank=self.place.pp_rank,
            pp_size=self.place.pp_size,
            dp_rank=self.place.dp_rank,
            layers=tuple(self.phys),
        )

    # views of the ledger (for logs and tests)
    @property
    def _pulls(self) -> dict[str, _Pull]:
        """Pulls vLLM still waits for (not aborted)."""
        return {r: p for r, p in self.ledger.pulls.items() if p.state != "aborted" and isinstance(p, _Pull)}

    @property
    def _draining(self) -> dict[str, _Pull]:
        """Pulls aborted whose transfer has not drained yet."""
        return {r: p for r, p in self.ledger.pulls.items() if p.state == "aborted" and isinstance(p, _Pull)}

    @property
    def _sending(self) -> set[str]:
        """Requests published and not yet released."""
        return self.ledger.sending()

    # per step
    def start_step(self, meta: KvferryConnectorMetadata) -> None:
        """Publishes this step's finished prefills and starts its pulls (once per
        metadata object; both start_load_kv and wait_for_save call it)."""
        if self._done_meta is meta:  # a reference, not id(): ids of freed objects recur
            return
        self._done_meta = meta
        self._idle = meta.idle
        for req_id, block_ids in meta.reqs_to_send.items():
            self._publish(req_id, block_ids, meta.publish_keys.get(req_id, req_id))
        # The step's releases go as one message per prefill rank (at most max_keys
        # keys each); its reads as batched gets.
        with vllm_hetero.batched_releases(self), vllm_hetero.batched_gets(self):
            for req_id, spec in meta.reqs_to_recv.items():
                self._start_pull(req_id, self._stage_spec(spec), meta.expires_at.get(req_id))
            for req_id, rel in meta.reqs_to_release.items():
                # This stage's prefill workers only (a later stage of an unsplit list
                # has none: stage 0 releases them all).
                peers = parallel.stage_view(rel.peers, rel.stages, self.place)
                if peers is None:
                    continue
                if rel.per_rank is not None:
                    vllm_hetero.release_keys(self, req_id, dataclasses.replace(rel, peers=peers))
                    continue
                peer = peers[self.tp_rank] if len(peers) > self.tp_rank else {}
                inc = peer.get("incarnation")
                self.ledger.release(peer.get("address"), [rel.key], rel.expires_at, _incarnation(inc))

    def _stage_spec(self, spec: RecvSpec) -> RecvSpec:
        """``spec`` as this worker sees it (:func:`.parallel.stage_view`): only its
        pipeline stage's prefill workers. A worker of a later stage handed an unsplit
        list has nothing to pull: the scheduler refused the pair (PP sizes differ), and
        the worker reports that refusal, releasing nothing (stage 0 releases)."""
        if spec.stages <= 1 and self.pp_rank == 0:
            return spec
        view = parallel.stage_view(spec.peers, spec.stages, self.place)
        if view is not None:
            return dataclasses.replace(spec, peers=view)
        why = spec.refused or f"the prefill's pipeline stages do not match this decode's {self.place.pp_size}"
        return dataclasses.replace(spec, peers=[], plans=[RankPlan() for _ in range(self.place.tp_size)], refused=why)

    def flush_releases(self) -> None:
        """Sends the releases the ledger collected. A prefill may not have published
        yet (it publishes a step after it returned the params), so a miss is retried
        until the lease's advertised end (``timeout`` when none was advertised). A
        ``Release`` stages nothing, so a prefill whose staging is full is still told.
        In the background; a failure only means the blocks wait for the lease."""
        if self.engine is None:
            return
        timeout = self.config.timeout
        for msg in self.ledger.flush_releases():
            retry = timeout if msg.expires_at is None else max(0.0, msg.expires_at - time.time())
            keys: Any = msg.keys[0] if len(msg.keys) == 1 else list(msg.keys)
            try:
                self._releases[f"{msg.address}#{msg.keys[0]}#{len(self._releases)}"] = self.engine.release_remote(
                    msg.address, keys, timeout=retry + timeout, retry_miss=retry, incarnation=msg.incarnation
                )
                self.stats.record_release()
            except errors.Error as e:
                logger.debug("KvferryConnector: releasing %d key(s) on %s failed: %s", len(msg.keys), msg.address, e)

    def _reap_releases(self) -> None:
        for tag, t in list(self._releases.items()):
            if t.done():
                del self._releases[tag]
                if t.error is not None and not isinstance(t.error, errors.NotFoundError):
                    logger.debug("KvferryConnector: release %s: %s", tag, t.error)

    def mark_step_computed(self) -> None:
        """Called after the step's forward was enqueued (``wait_for_save``): on a CUDA
        cache, records an event on the current stream, so blocks are published only
        once the kernels that wrote them have completed."""
        if self.device is not None and self.device.startswith("cuda"):
            event_cls: Any = torch.cuda.Event  # untyped in torch's stubs
            ev = event_cls()
            ev.record()
            self._step_done = ev

    def _publish(self, req_id: str, block_ids: list[int], key: str) -> None:
        """Publishes a finished prefill's blocks under ``key`` (bound to its prompt:
        :mod:`.prompt`); on a CUDA cache, not before the step that computed them has
        completed on the GPU (polled each step, bounded by ``timeout``: a GPU that
        never completes frees the blocks unpublished, and the decode gets a miss)."""
        self._pub_keys[req_id] = key
        if self.device is not None and self.device.startswith("cuda"):
            self.ledger.computing(req_id, block_ids, time.monotonic() + self.config.timeout)
            self._publish_computed()
            return
        self._publish_now(req_id, block_ids)

    def _publish_computed(self) -> None:
        if not self.ledger.pubs:
            return
        done = self._step_done is None or bool(self._step_done.query())
        go, lost = self.ledger.computed(time.monotonic(), done)
        for rec in go:
            self._publish_now(rec.req_id, rec.block_ids)
        for rec in lost:
            self._pub_keys.pop(rec.req_id, None)
            logger.error("KvferryConnector: the GPU did not finish computing %s within %ss; not published", rec.req_id, self.config.timeout)

    def _publish_now(self, req_id: str, block_ids: list[int]) -> None:
        assert self.engine is not None and self.region is not None
        key = self._pub_keys.pop(req_id, req_id)
        try:
            vllm_hetero.publish_slots(self, req_id, block_ids, key)
        except errors.Error as e:
            # Nothing pins the blocks: free them now; the decode side gets a miss.
            logger.error("KvferryConnector: publishing %s failed: %s", req_id, e)
            self.ledger.published(req_id, [])

    def _start_pull(self, req_id: str, spec: RecvSpec, expires_at: float | None) -> None:
        assert self.engine is not None and self.region is not None
        pull = _Pull(req_id=req_id, spec=spec, expires_at=expires_at, retries_misses=spec.plans is None)
        self.ledger.start_pull(pull, time.monotonic(), time.time())
        try:
            pull.load_blocks = list(spec.load_block_ids)
            if spec.plans is not None:
                vllm_hetero.start_reads(self, pull)
                return
            if len(spec.peers) <= self.tp_rank:
                raise errors.InvalidArgumentError(
                    f"prefill instance has {len(spec.peers)} tensor-parallel ranks; this is rank {self.tp_rank}"
                )
            peer = spec.peers[self.tp_rank]
            pull.address = peer.get("address")
            pull.incarnation = _incarnation(peer.get("incarnation"))
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
            self.ledger.fail(pull, e)

    def _launch(self, pull: _Pull) -> None:
        assert self.engine is not None and pull.address is not None and pull.dst is not None
        self.ledger.launched(pull)
        now = time.monotonic()
        left = max(0.001, pull.deadline - now)
        # A key the prefill has not published yet (it publishes a step after it
        # answered) is waited for on the prefill, which answers the moment it
        # publishes: no retry timer between the publication and the get (the ledger's
        # retries remain for a prefill that cannot wait).
        # It ends WAIT_MARGIN before the deadline, so a key never published is a miss.
        wait = max(0.0, min(pull.retry_until, pull.deadline - WAIT_MARGIN) - now) if pull.retries_misses else 0.0
        # Naming the incarnation that published: a restarted prefill instance is refused
        # at once (PeerRestartedError, a load error) instead of missing until timeout.
        pull.transfer = self.engine.get(
            pull.address,
            pull.spec.key,
            pull.dst,
            pull.dst_ids,
            timeout=left,
            path=self.config.path,
            incarnation=pull.incarnation,
            await_published=wait,
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

    def _seen(self, rec: PullRecord, unread: bool = False) -> Seen:
        """What this pull's transfer says now (for the ledger); ``unread``: with the
        slots it has not landed (a plain pull: its key, unless it landed)."""
        assert isinstance(rec, _Pull)
        t = rec.transfer
        if t is None:
            return Seen(False, unread=self._unread(rec, False) if unread else ())
        done = t.done()
        err = t.error if done else None
        seen = Seen(True, done, err, t.drained())
        if not unread:
            return seen
        return Seen(True, done, err, seen.drained, self._unread(rec, done and err is None))

    @staticmethod
    def _unread(pull: _Pull, landed: bool) -> tuple[tuple[str, int | None, str], ...]:
        t = pull.transfer
        if isinstance(t, RankReads):
            return tuple((a, None, k) for a, k in t.unread())
        if landed or pull.address is None:
            return ()
        return ((pull.address, pull.incarnation, pull.spec.key),)

    def transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        res = KVConnectorTransferResults()
        self._wait_idle()
        self._publish_computed()
        led = self.ledger
        with vllm_hetero.batched_releases(self):
            # Decode requests finished (aborted) while pulling: cancelled without
            # waiting; their blocks go back to vLLM once the pull drained (the ledger).
            for req_id in finished_req_ids:
                rec = led.pulls.get(req_id)
                if rec is not None:
                    aborted, cancel = led.abort(req_id, self._seen(rec, unread=True), time.monotonic())
                    if cancel and isinstance(aborted, _Pull) and aborted.transfer is not None:
                        aborted.transfer.cancel(timeout=0)
                led.finished(req_id)
            now = time.monotonic()
            polled = led.poll(now, self._seen)
            for rec in polled.cancel:
                assert isinstance(rec, _Pull) and rec.transfer is not None
                rec.transfer.cancel(timeout=0)
            for rec in polled.launch:
                assert isinstance(rec, _Pull)
                try:
                    self._launch(rec)
                except Exception as e:  # noqa: BLE001
                    led.fail(rec, e)
            for rec in polled.undrained:
                # Failed, but something (a device copy that outlived the transfer) may
                # still write the destination blocks: vLLM gets them back (the load
                # error) only once the device confirmed; polled each step, never waited.
                logger.warning(
                    "KvferryConnector: pull of %s failed (%r); its blocks are reported once the device confirms the copy into them",
                    rec.req_id,
                    rec.error,
                )
            for rec in polled.ready:
                self._finish(rec)
            self._reap_releases()
            # Publications released (decode's Done, abort, lease expiry, shutdown): the
            # blocks are free once the request was reported finished to this worker.
            self.take_released()
        res.finished_recving, res.failed_recving = led.take_recving()
        res.finished_sending |= led.finished_sending()
        return res

    def take_released(self) -> set[str]:
        """Feeds the engine's released publications to the ledger; returns their keys."""
        keys: set[str] = set()
        if self.engine is None:
            return keys
        for key, reason in self.engine.released():
            if reason == "replaced":
                continue
            k = key if isinstance(key, str) else bytes(key).decode(errors="replace")
            keys.add(k)
            done = self.ledger.slot_released(k, str(reason))
            if done is not None:
                self.stats.record_publication_released(done[1])
                logger.debug("KvferryConnector: %s released (%s)", *done)
        return keys

    def _finish(self, pull: PullRecord) -> None:
        """A pull whose transfer drained: landed (its scratch copied in) or failed;
        reported to the ledger either way, with its stats."""
        assert isinstance(pull, _Pull)
        seen = self._seen(pull, unread=True)
        err = pull.error
        if pull.state != "aborted" and err is None and pull.scratch is not None:
            try:
                self._land_scratch(pull)
            except Exception as e:  # noqa: BLE001 - any failure is a load error
                err = e
        self._drop_scratch(pull)
        self.ledger.report(pull, seen, err)
        if pull.state == "aborted":
            return
        t = pull.transfer
        dp = pull.spec.remote_dp_rank
        if pull.error is None and pull.dst is None and t is not None and hasattr(t, "bytes_needed"):
            self.stats.record_pull(time.monotonic() - pull.started, t.bytes_needed, len(pull.spec.load_block_ids), dp)
        if pull.error is None and pull.dst is not None:
            self.stats.record_pull(time.monotonic() - pull.started, len(pull.dst_ids) * pull.dst.block_bytes, len(pull.dst_ids), dp)
        if pull.error is not None:
            self.stats.record_failure(pull.error, dp)
            logger.warning(
                "KvferryConnector: pull of %s from %s failed after %d attempt(s): %r",
                pull.req_id,
                _source(pull.spec),
                pull.attempts,
                pull.error,
            )

    def take_load_errors(self) -> set[int]:
        return self.ledger.take_load_errors()

    def shutdown(self) -> None:
        pulls = [p for p in self.ledger.pulls.values() if isinstance(p, _Pull)]
        # Every pull is asked first, then each drain is waited for: a batched get is
        # cancelled only once every request riding it has left (reads._Batch).
        for pull in pulls:
            if pull.transfer is not None and not pull.transfer.done():
                pull.transfer.cancel(timeout=0)
        for pull in pulls:
            if pull.transfer is not None and not pull.transfer.drained():
                pull.transfer.cancel()
            self._drop_scratch(pull)
        self.ledger.pulls.clear()
        if self.engine is not None:
            report = self.engine.close(timeout=self.config.timeout)
            if not report.get("clean", True):
                logger.warning("KvferryConnector: engine closed with work outstanding: %s", report)


def _source(spec: RecvSpec) -> str:
    """Where a pull's blocks are, for messages: ``prefill engine E (DP rank d)``."""
    where = f"prefill engine {spec.remote_engine_id or '?'}"
    if spec.remote_dp_rank is not None:
        where += f" (DP rank {spec.remote_dp_rank})"
    return where


def _incarnation(inc: Any) -> int | None:
    """An advertised incarnation, if it is one (a u64)."""
    return int(inc) if isinstance(inc, int) and 0 <= inc < 1 << 64 else None


# -- the connector ---------------------------------------------------------------------
