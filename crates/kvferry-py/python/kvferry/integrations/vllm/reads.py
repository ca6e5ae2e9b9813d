"""One decode rank's reads for one request (a :class:`~.mapping.RankPlan`),
executed through kvferry and watched as one transfer by ``KvferryConnectorWorker``.

Semantics
---------
:class:`RankReads` starts one kvferry get per :class:`~.mapping.Read`, each from
its prefill rank's address and under its own reader-slot key, and looks like a
:class:`kvferry.Transfer` to the worker (``done()``, ``error``, ``cancel()``,
``wait()``): done when every get finished, failed on the first get that fails for good.
A key the prefill has not published yet (it publishes a step after it answered) is
waited for on the prefill until ``retry_until`` (``await_published``: the prefill
answers the moment it publishes, and the get goes on); a get that still misses (a
prefill that cannot wait) is retried, alone, every 2-50 ms until ``retry_until``; a get
that landed is never repeated (its slot was released by its ``Done``).

How a read lands:

- the whole publication into whole blocks: a plain get into the cache region;
- otherwise, with ``kvferry.Selection`` (partial gets on the wire): a get selecting
  exactly the read's blocks and byte ranges, straight into the cache region — the wire
  carries only the bytes the decode needs;
- otherwise (a kvferry without ``Selection``): the whole publication lands in scratch
  blocks of the prefill's piece size, and the read's blocks and ranges are copied
  into the cache once it verified. Correct, but the wire carries whole blocks.

Batched gets
------------
A ``RankReads`` made with ``defer`` starts nothing; :func:`launch_batched` then starts
a whole step's reads at once: those from one prefill rank that share their per-piece
ranges ride :class:`_Batch` gets (several reader-slot keys in one kvferry get, their
destination blocks concatenated), the rest go alone. A batched read is landed, handed
back to a get of its own, or failed when its batch settles (see :class:`_Batch`);
until then it is watched through the batch. Every request still has its own
``RankReads``, deadline and outcome.

Cancellation
------------
``cancel()`` cancels every get in flight (kvferry drains each before its memory is
handed back) — a batched get only once every request riding it was cancelled; until
then the cancelled request only leaves it, and ``drained()`` turns True when it ends.
Scratch regions are deregistered bounded by ``timeout`` (a region still in use stays
registered and is left to the engine, never freed under a writer).
Dropping a :class:`RankReads` without ``cancel()`` leaves its gets to run to their own
deadlines; nothing is freed under them. :meth:`release_unread` tells each prefill rank
that the slots whose gets did not land will not be read (``release_remote``), so a
failed or aborted request frees the prefill's blocks within a round trip.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

import kvferry

from ... import errors
from ..._engine import Engine, Region, Transfer
from .mapping import Read

__all__ = ["RankReads", "has_selection"]


MIN_GET = 0.010
"""A missed get is retried only while at least this long is left before the deadline;
after that the miss is final (a get launched with less would time out instead)."""


WAIT_MARGIN = 0.25
"""How long before its deadline a get stops waiting on the prefill for a publication
(``await_published``), so that a key never published ends as a miss within the
deadline — a load error of kind ``miss`` — not as the get's timeout."""


def has_selection() -> bool:
    """Whether this kvferry has partial gets (``kvferry.Selection``)."""
    return hasattr(kvferry, "Selection")


@functools.lru_cache(maxsize=1024)
def _selection(
    blocks: tuple[int, ...] | None, src: tuple[tuple[int, int], ...] | None, dst: tuple[tuple[int, int], ...] | None
) -> Any:
    """The :class:`kvferry.Selection` of a read's shape, checked once: every request of
    a topology reads the same head ranges of the same block positions (immutable, so
    shared; the cache is bounded)."""
    return kvferry.Selection(blocks=blocks, src_ranges=src, dst_ranges=dst)


def _ranges(rd: Read) -> tuple[tuple[tuple[int, int], ...] | None, tuple[tuple[int, int], ...] | None]:
    """A read's source and destination ranges as hashable tuples."""
    src = None if rd.src_ranges is None else tuple((int(o), int(n)) for o, n in rd.src_ranges)
    dst = None if rd.dst_ranges is None else tuple((int(o), int(n)) for o, n in rd.dst_ranges)
    return src, dst


def _selection_of(rd: Read) -> Any:
    return _selection(tuple(rd.blocks), *_ranges(rd))


@dataclass
class _Sub:
    read: Read
    address: str
    incarnation: int | None
    transfer: Transfer | None = None
    retry_at: float | None = None
    attempts: int = 0
    landed: bool = False
    scratch: dict[str, Any] | None = None
    scratch_region: Region | None = None
    error: BaseException | None = None
    batch: _Batch | None = None  # the batched get carrying this read, until it settled
    last_miss: BaseException | None = None  # the NotFoundError a retry is waiting on


@dataclass
class _Geometry:
    """This rank's cache as the reads see it: raw pieces ``[num_blocks, piece_bytes]``
    (uint8 torch views, in region order) and the prefill's piece size."""

    pieces: list[Any]
    src_piece_bytes: int
    npub: int  # blocks in each publication slot
    extra: dict[str, Any] = field(default_factory=dict)


class RankReads:
    """The gets of one decode rank for one request, as one transfer (module docs)."""

    def __init__(
        self,
        engine: Engine,
        region: Region,
        geometry: _Geometry,
        reads: list[Read],
        peers: list[dict[str, Any]],
        *,
        deadline: float,
        retry_until: float,
        path: str,
        timeout: float,
        register: Any,
        defer: list[RankReads] | None = None,
    ) -> None:
        self.engine, self.region, self.geo = engine, region, geometry
        self.deadline, self.retry_until, self.path, self.timeout = deadline, retry_until, path, timeout
        self._register = register  # (caches, num_blocks, name) -> Region, the worker's
        self.subs: list[_Sub] = []
        self._error: BaseException | None = None
        self.bytes_needed = 0  # bytes the decode needs (per-piece selection x pieces x blocks)
        for rd in reads:
            if rd.rank >= len(peers) or not peers[rd.rank].get("address"):
                raise errors.InvalidArgumentError(f"no kvferry address for prefill rank {rd.rank} (have {len(peers)} ranks)")
            inc = peers[rd.rank].get("incarnation")
            self.subs.append(
                _Sub(rd, str(peers[rd.rank]["address"]), int(inc) if isinstance(inc, int) and 0 <= inc < 1 << 64 else None)
            )
            self.bytes_needed += self.read_bytes(rd)
        if defer is not None:  # launched by launch_batched() with the step's other reads
            defer.append(self)
            return
        for s in self.subs:
            self._launch(s)

    def read_bytes(self, rd: Read) -> int:
        """Bytes ``rd`` moves: its selected bytes per piece x pieces x blocks."""
        per = rd.nbytes_per_piece if rd.src_ranges is not None else self.geo.src_piece_bytes
        return per * len(self.geo.pieces) * len(rd.blocks)

    # -- launching ------------------------------------------------------------------

    def _whole(self, rd: Read) -> bool:
        return rd.src_ranges is None and rd.dst_ranges is None and rd.blocks == list(range(self.geo.npub))

    def _launch(self, s: _Sub) -> None:
        s.attempts += 1
        s.retry_at = None
        now = time.monotonic()
        left = max(0.001, self.deadline - now)
        # A key the prefill has not published yet (it publishes a step after it
        # answered) is waited for on the prefill, which answers when it publishes:
        # no retry timer (the retries below remain for a prefill that cannot wait).
        # The wait ends WAIT_MARGIN before the deadline: a key still missing then is
        # reported as the miss it is, not as the get's own timeout.
        wait = max(0.0, min(self.retry_until, self.deadline - WAIT_MARGIN) - now)
        rd = s.read
        if self._whole(rd):
            s.transfer = self.engine.get(
                s.address,
                rd.key,
                self.region,
                rd.dst_blocks,
                timeout=left,
                path=self.path,
                incarnation=s.incarnation,
                await_published=wait,
            )
            return
        if has_selection():
            sel = _selection_of(rd)
            s.transfer = self.engine.get(
                s.address,
                rd.key,
                self.region,
                rd.dst_blocks,
                timeout=left,
                path=self.path,
                incarnation=s.incarnation,
                select=sel,
                await_published=wait,
            )
            return
        if s.scratch_region is None:
            import torch

            n = self.geo.npub
            whole = torch.empty((len(self.geo.pieces), n, self.geo.src_piece_bytes), dtype=torch.uint8)
            s.scratch = {"all": whole}
            # One [blocks, piece_bytes] tensor per piece, in region order (views of one).
            s.scratch_region = self._register({f"piece{i}": whole[i] for i in range(whole.shape[0])}, n, f"scratch-{rd.key}")
        s.transfer = self.engine.get(
            s.address,
            rd.key,
            s.scratch_region,
            list(range(self.geo.npub)),
            timeout=left,
            path=self.path,
            incarnation=s.incarnation,
            await_published=wait,
        )

    def _land_scratch(self, s: _Sub) -> None:
        import torch

        assert s.scratch is not None
        rd = s.read
        sr = rd.src_ranges or [(0, self.geo.src_piece_bytes)]
        dr = rd.dst_ranges or [(0, int(self.geo.pieces[0].shape[1]))]
        src_idx = torch.tensor(rd.blocks, dtype=torch.long)
        dst_idx = torch.tensor(rd.dst_blocks, dtype=torch.long)
        sc = s.scratch["all"][:, src_idx]  # [pieces, blocks, src piece bytes]: one gather
        data = sc[:, :, sr[0][0] : sr[0][0] + sr[0][1]] if len(sr) == 1 else torch.cat([sc[:, :, o : o + n] for o, n in sr], dim=2)
        for i, piece in enumerate(self.geo.pieces):
            at = 0
            for o, n in dr:
                piece[dst_idx, o : o + n] = data[i, :, at : at + n]
                at += n

    def _drop_scratch(self, s: _Sub) -> None:
        if s.scratch_region is not None:
            try:
                self.engine.deregister(s.scratch_region, timeout=self.timeout)
            except errors.Error:
                pass  # still in use after the bound: the engine keeps it until drained
        s.scratch_region = None
        s.scratch = None

    # -- the Transfer interface -------------------------------------------------------

    def _poll(self) -> None:
        if self._error is not None:
            return
        now = time.monotonic()
        for s in self.subs:
            if s.landed:
                continue
            if s.batch is not None:
                if not s.batch.settle(now):
                    continue  # in flight, or failed and not drained yet
                if s.landed:
                    continue
                if s.error is not None:
                    self._fail(s.error)
                    return
                # handed back (s.batch is None now): got alone below
            t = s.transfer
            if t is None:
                if s.retry_at is not None and now >= s.retry_at:
                    if s.last_miss is not None and self.deadline - now < MIN_GET:
                        # Too little time left for another get: the miss is final (a
                        # get launched now would time out and call it a timeout).
                        s.error = s.last_miss
                        self._fail(s.last_miss)
                        return
                    try:
                        self._launch(s)
                    except Exception as e:  # noqa: BLE001
                        self._fail(e)
                        return
                continue
            if not t.done():
                continue
            err = t.error
            if err is None:
                try:
                    if s.scratch is not None:
                        self._land_scratch(s)
                except Exception as e:  # noqa: BLE001
                    self._fail(e)
                    return
                s.landed = True
                self._drop_scratch(s)
            elif isinstance(err, errors.NotFoundError) and now < self.retry_until:
                s.last_miss = err
                s.transfer = None
                s.retry_at = min(self.retry_until, now + min(0.05, 0.002 * 2 ** min(s.attempts, 5)))
            else:
                s.error = err
                self._fail(err)
                return

    def _fail(self, e: BaseException) -> None:
        self._error = e
        for s in self.subs:
            if s.batch is not None:
                s.batch.leave(s, 0)  # the other members may still need it
            elif s.transfer is not None and not s.transfer.done():
                s.transfer.cancel(timeout=0)  # asked, not waited: drained() tells when
            self._drop_scratch(s)

    def done(self) -> bool:
        self._poll()
        return self._error is not None or all(s.landed for s in self.subs)

    @property
    def error(self) -> BaseException | None:
        self._poll()
        return self._error

    def drained(self) -> bool:
        """True once no get of this rank writes the destination blocks (never blocks)."""
        return all(s.transfer is None or s.transfer.drained() for s in self.subs)

    def cancel(self, timeout: float | None = None) -> bool:
        """Cancels every get still running; as ``Transfer.cancel``: returns after their
        drain (up to ``timeout``; ``0``: at once, then poll :meth:`drained`)."""
        any_ = False
        for s in self.subs:
            if s.batch is not None:
                any_ = s.batch.leave(s, timeout) or any_
            elif s.transfer is not None and not s.transfer.done():
                any_ = s.transfer.cancel(timeout) or any_
            self._drop_scratch(s)
        if self._error is None and not all(s.landed for s in self.subs):
            self._error = errors.CancelledError("cancelled")
        return any_

    def wait(self, timeout: float | None = None) -> int:
        for s in self.subs:
            if s.transfer is not None and not s.transfer.done():
                s.transfer.wait(timeout)
                break
        return sum(1 for s in self.subs if s.landed)

    def unread(self) -> list[tuple[str, str]]:
        """``[(address, key)]`` of slots whose get has not landed."""
        return [(s.address, s.read.key) for s in self.subs if not s.landed]


# -- batched gets --------------------------------------------------------------------

MAX_BATCH_BYTES = 64 << 20
"""A batch closes before its selected bytes would pass this (a producer refuses a
selected get of over 256 MiB; large requests gain nothing from sharing a get)."""

_REFUSED = (errors.NotFoundError, errors.InvalidArgumentError, errors.BusyError)
"""A batch that fails with these was refused before anything was staged (a key not
published, a selection or request the producer refused, no staging room): no slot was
consumed, so its members are handed back to gets of their own."""

BATCH_SPREAD = 4
"""A step's batchable reads from one prefill rank are spread over up to this many
batched gets (the engine pools 4 connections per peer by default), each of at most
``read_batch`` keys: 32 requests make 4 gets of 8, 6 make 3 of 2, 4 or fewer go alone."""


class _Batch:
    """One kvferry get carrying the reads of several requests from one prefill rank
    (same address, incarnation and per-piece ranges): their reader-slot keys in one
    request, their blocks in one destination list.

    It settles once the get finished and nothing writes its blocks any more:

    - landed every key: every read landed (its ``Done`` released every slot);
    - a plain get that landed a prefix (the keys after it not published yet): those
      landed, the others are handed back and got alone (with their own retries);
    - refused before anything was staged (a selected get names a key not published
      yet, the producer refused the request, no staging room: ``_REFUSED``; no slot
      consumed): every read is handed back and got alone;
    - any other failure (a timeout, a dead or restarted peer, a checksum mismatch):
      the slots it staged are consumed, so every member fails with that error (a load
      error: vLLM recomputes them), as each would with a get of its own to that peer.

    A member's request aborted (its :class:`RankReads` cancelled) does not cancel the
    get the others still need: the member only leaves, and its blocks are quiet when
    the get is (``drained``). The get is cancelled once every member left (shutdown).
    A request is never written by two gets at once."""

    __slots__ = ("transfer", "subs", "selected", "settled", "left")

    def __init__(self, transfer: Transfer, subs: list[_Sub], selected: bool) -> None:
        self.transfer, self.subs, self.selected, self.settled = transfer, subs, selected, False
        self.left: set[int] = set()  # id() of members whose request no longer wants it

    def leave(self, s: _Sub, timeout: float | None) -> bool:
        """Member ``s`` no longer wants the get: cancels it once no member does (then
        exactly ``Transfer.cancel``), else waits up to ``timeout`` (default 10 s;
        ``0``: not at all) for it to finish. As ``Transfer.cancel``: True once nothing
        writes the get's blocks."""
        self.left.add(id(s))
        t = self.transfer
        if not t.done():
            if len(self.left) == len(self.subs):
                return t.cancel(timeout)
            if timeout is None or timeout > 0:
                try:
                    t.wait(10.0 if timeout is None else timeout)
                except Exception:  # noqa: BLE001 - its outcome is read when it settles
                    pass
        return t.drained()

    def settle(self, now: float) -> bool:
        """True once settled (each member landed, handed back or failed); never blocks."""
        if self.settled:
            return True
        t = self.transfer
        if not t.done():
            return False
        err = t.error
        landed = 0
        if err is None:
            n = t.wait(1.0)  # done: returns at once with the keys landed
            # A selected get lands all of its keys or fails; a plain one lands a prefix.
            landed = len(self.subs) if self.selected else min(int(n), len(self.subs))
        elif not t.drained():
            return False  # failed, but a copy may still write the members' blocks
        for i, s in enumerate(self.subs):
            if i < landed:
                s.landed = True
            elif err is None or isinstance(err, _REFUSED):
                s.transfer, s.retry_at = None, now  # got alone at the next poll
            else:
                s.error = err
            s.batch = None
        self.settled = True
        return True


def _batch_key(rr: RankReads, s: _Sub) -> tuple[Any, ...] | None:
    """What reads must share to ride one get; None when this one goes alone."""
    rd = s.read
    if rr._whole(rd):
        return (s.address, s.incarnation, id(rr.region), rr.path, "whole")
    if not has_selection():
        return None  # lands through scratch, one get each
    return (s.address, s.incarnation, id(rr.region), rr.path, "selected", *_ranges(rd))


def launch_batched(reads: list[RankReads], max_keys: int) -> None:
    """Starts the gets of ``reads`` (made with ``defer``): the reads of one prefill
    rank that share their per-piece ranges ride :class:`_Batch` gets of up to
    ``max_keys`` keys and :data:`MAX_BATCH_BYTES` (spread over up to
    :data:`BATCH_SPREAD` gets); the others, and all of them when ``max_keys`` is 1, go
    alone. A launch that raises fails only its own requests."""
    groups: dict[tuple[Any, ...], list[tuple[RankReads, _Sub]]] = {}
    for rr in reads:
        for s in rr.subs:
            k = _batch_key(rr, s) if max_keys > 1 else None
            if k is None:
                _start_alone(rr, s)
            else:
                groups.setdefault(k, []).append((rr, s))
    for k, members in groups.items():
        n = len(members)
        per = min(max_keys, -(-n // min(n, BATCH_SPREAD)))
        parts: list[list[tuple[RankReads, _Sub]]] = []
        part: list[tuple[RankReads, _Sub]] = []
        nbytes = 0
        for rr, s in members:
            b = rr.read_bytes(s.read)
            if part and (len(part) == per or nbytes + b > MAX_BATCH_BYTES):
                parts.append(part)
                part, nbytes = [], 0
            part.append((rr, s))
            nbytes += b
        parts.append(part)
        for part in parts:
            if len(part) == 1 or len({s.read.key for _, s in part}) < len(part):
                for rr, s in part:  # alone (a key twice would be refused as a whole)
                    _start_alone(rr, s)
            else:
                _start_batch(part, k[5:] if k[4] == "selected" else None)


def _start_alone(rr: RankReads, s: _Sub) -> None:
    if rr._error is not None:
        return
    try:
        rr._launch(s)
    except Exception as e:  # noqa: BLE001 - a load error for this request, as at its start
        rr._fail(e)


def _start_batch(part: list[tuple[RankReads, _Sub]], ranges: tuple[Any, ...] | None) -> None:
    """One get for ``part``; ``ranges``: the shared ``(src, dst)`` ranges of a selected
    batch (from its key), None for whole publications."""
    selected = ranges is not None
    part = [(rr, s) for rr, s in part if rr._error is None]
    if len(part) < 2:
        for rr, s in part:
            _start_alone(rr, s)
        return
    rr0, s0 = part[0]
    keys = [s.read.key for _, s in part]
    left = max(0.001, min(rr.deadline for rr, _ in part) - time.monotonic())
    try:
        if selected:
            # Positions into the keys' block lists concatenated (each key: its request's
            # publication of ``npub`` blocks); None when every block is read in order.
            every = all(s.read.blocks == list(range(rr.geo.npub)) for rr, s in part)
            blocks: tuple[int, ...] | None = None
            if not every:
                pos: list[int] = []
                base = 0
                for rr, s in part:
                    pos += [base + b for b in s.read.blocks]
                    base += rr.geo.npub
                blocks = tuple(pos)
            assert ranges is not None
            sel = _selection(blocks, *ranges)
            t = rr0.engine.get(
                s0.address,
                keys,
                rr0.region,
                [b for _, s in part for b in s.read.dst_blocks],
                timeout=left,
                path=rr0.path,
                incarnation=s0.incarnation,
                select=sel,
            )
        else:
            t = rr0.engine.get(
                s0.address, keys, rr0.region, [s.read.dst_blocks for _, s in part], timeout=left, path=rr0.path, incarnation=s0.incarnation
            )
    except Exception:  # noqa: BLE001 - the batch could not start: each read alone (its own error, if any)
        for rr, s in part:
            _start_alone(rr, s)
        return
    batch = _Batch(t, [s for _, s in part], selected)
    for _, s in part:
        s.attempts += 1
        s.retry_at = None
        s.transfer = t
        s.batch = batch
