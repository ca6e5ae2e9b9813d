"""One decode rank's reads for one request (a :class:`~.vllm_mapping.RankPlan`),
executed through kvferry and watched as one transfer by ``KvferryConnectorWorker``.

Semantics
---------
:class:`RankReads` starts one kvferry get per :class:`~.vllm_mapping.Read`, each from
its prefill rank's address and under its own reader-slot key, and looks like a
:class:`kvferry.Transfer` to the worker (``done()``, ``error``, ``cancel()``,
``wait()``): done when every get finished, failed on the first get that fails for good.
A get that misses (the prefill publishes a step after it answered) is retried, alone,
every 2-50 ms until ``retry_until``; a get that landed is never repeated (its slot was
released by its ``Done``).

How a read lands:

- the whole publication into whole blocks: a plain get into the cache region;
- otherwise, with ``kvferry.Selection`` (partial gets on the wire): a get selecting
  exactly the read's blocks and byte ranges, straight into the cache region — the wire
  carries only the bytes the decode needs;
- otherwise (a kvferry without ``Selection``): the whole publication lands in scratch
  blocks of the prefill's piece size, and the read's blocks and ranges are copied
  into the cache once it verified. Correct, but the wire carries whole blocks.

Cancellation
------------
``cancel()`` cancels every get in flight (kvferry drains each before its memory is
handed back); scratch regions are deregistered bounded by ``timeout`` (a region still
in use stays registered and is left to the engine, never freed under a writer).
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

from .. import errors
from .._engine import Engine, Region, Transfer
from .vllm_mapping import Read

__all__ = ["RankReads", "has_selection"]


def has_selection() -> bool:
    """Whether this kvferry has partial gets (``kvferry.Selection``)."""
    return hasattr(kvferry, "Selection")


@functools.lru_cache(maxsize=1024)
def _selection(
    blocks: tuple[int, ...], src: tuple[tuple[int, int], ...] | None, dst: tuple[tuple[int, int], ...] | None
) -> Any:
    """The :class:`kvferry.Selection` of a read's shape, checked once: every request of
    a topology reads the same head ranges of the same block positions (immutable, so
    shared; the cache is bounded)."""
    return kvferry.Selection(blocks=blocks, src_ranges=src, dst_ranges=dst)


def _selection_of(rd: Read) -> Any:
    return _selection(
        tuple(rd.blocks),
        None if rd.src_ranges is None else tuple((int(o), int(n)) for o, n in rd.src_ranges),
        None if rd.dst_ranges is None else tuple((int(o), int(n)) for o, n in rd.dst_ranges),
    )


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
    ) -> None:
        self.engine, self.region, self.geo = engine, region, geometry
        self.deadline, self.retry_until, self.path, self.timeout = deadline, retry_until, path, timeout
        self._register = register  # (caches, num_blocks, name) -> Region, the worker's
        self.subs: list[_Sub] = []
        self._error: BaseException | None = None
        self.bytes_needed = 0  # bytes the decode needs (per-piece selection x pieces x blocks)
        npieces = len(geometry.pieces)
        for rd in reads:
            if rd.rank >= len(peers) or not peers[rd.rank].get("address"):
                raise errors.InvalidArgumentError(f"no kvferry address for prefill rank {rd.rank} (have {len(peers)} ranks)")
            inc = peers[rd.rank].get("incarnation")
            self.subs.append(
                _Sub(rd, str(peers[rd.rank]["address"]), int(inc) if isinstance(inc, int) and 0 <= inc < 1 << 64 else None)
            )
            per = rd.nbytes_per_piece if rd.src_ranges is not None else geometry.src_piece_bytes
            self.bytes_needed += per * npieces * len(rd.blocks)
        for s in self.subs:
            self._launch(s)

    # -- launching ------------------------------------------------------------------

    def _whole(self, rd: Read) -> bool:
        return rd.src_ranges is None and rd.dst_ranges is None and rd.blocks == list(range(self.geo.npub))

    def _launch(self, s: _Sub) -> None:
        s.attempts += 1
        s.retry_at = None
        left = max(0.001, self.deadline - time.monotonic())
        rd = s.read
        if self._whole(rd):
            s.transfer = self.engine.get(
                s.address, rd.key, self.region, rd.dst_blocks, timeout=left, path=self.path, incarnation=s.incarnation
            )
            return
        if has_selection():
            sel = _selection_of(rd)
            s.transfer = self.engine.get(
                s.address, rd.key, self.region, rd.dst_blocks, timeout=left, path=self.path, incarnation=s.incarnation, select=sel
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
            s.address, rd.key, s.scratch_region, list(range(self.geo.npub)), timeout=left, path=self.path, incarnation=s.incarnation
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
            t = s.transfer
            if t is None:
                if s.retry_at is not None and now >= s.retry_at:
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
                s.transfer = None
                s.retry_at = min(self.retry_until, now + min(0.05, 0.002 * 2 ** min(s.attempts, 5)))
            else:
                s.error = err
                self._fail(err)
                return

    def _fail(self, e: BaseException) -> None:
        self._error = e
        for s in self.subs:
            if s.transfer is not None and not s.transfer.done():
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
            if s.transfer is not None and not s.transfer.done():
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
