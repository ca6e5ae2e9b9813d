"""Fetching KV and asking peers: the :class:`~kvferry.Engine` methods that move bytes
from (or to) another engine — ``get`` and ``get_blocking`` (one transfer, waited for or
not), the delayed pull (``pull``, or ``stage`` then ``resolve``), ``release_remote``,
``push`` — and those that ask the directory or a peer what it holds (``peers``,
``locate``, ``lookup``). Each resolves a peer name through the engine's static
directory, then calls the native engine, which waits with the GIL released.

:class:`Fetching` is a base of :class:`~kvferry.Engine` (which sets ``_e`` and
``_directory``); it is not used on its own.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from . import _kvferry
from ._args import Key, _batch, _ids, _incarnation, _path
from ._memory import byte_view
from ._selection import Selection, _select, _selected_batch
from ._transfer import Transfer
from .errors import InvalidArgumentError

Region = _kvferry.Region


def _fetch_args(
    key: Key | Iterable[Key], block_ids: Any, select: Selection | None
) -> tuple[list[Key], list[_kvferry.BlockIds], Any]:
    """A fetch's keys, block ids and native selection: one block-id list per key, or
    with a selection one flat list (or one per key, concatenated)."""
    sel = _select(select)
    keys, blocks = _batch(key, block_ids) if sel is None else _selected_batch(key, block_ids)
    return keys, blocks, sel


class Fetching:
    """The fetching half of :class:`~kvferry.Engine` (module docs)."""

    _e: _kvferry.Engine
    _directory: dict[str, str]

    def _peer(self, peer: str) -> str:
        """A directory name's address (any other string is an address already)."""
        return self._directory.get(peer, peer)

    def get(
        self,
        peer: str,
        key: Key | Iterable[Key],
        dst: Region,
        block_ids: Any,
        *,
        timeout: float = 30.0,
        path: str = "direct",
        incarnation: int | None = None,
        select: Selection | None = None,
        await_published: float = 0.0,
    ) -> Transfer:
        """Starts fetching ``key`` (or a batch of keys, with one block-id list each)
        from ``peer`` into ``block_ids`` of ``dst``; returns at once. ``path``:
        ``direct`` (the socket writes your blocks) or ``staged`` (through staging pages,
        landing only verified chunks; always taken into device memory).
        ``incarnation``: the peer's :attr:`incarnation` the keys were offered by; if
        the peer is another one now (it restarted), the transfer fails with
        ``PeerRestartedError`` before anything is staged or written.
        ``select``: a :class:`Selection`, to move only part of the publication (a
        subset of its blocks, byte ranges of every per-layer piece) into ``block_ids``
        (then one flat list, or one list per key, concatenated); all keys must be
        published by one region of the peer (a key not published yet is a miss,
        ``NotFoundError``); a selection that does not fit raises ``SelectionError``.
        ``await_published``: seconds to wait, should the peer not have published the
        first key yet, for it to publish it (the peer answers the moment it does, and
        the get goes on; within ``timeout``) before the get misses — for a producer
        that publishes just after it handed out the keys, instead of retrying."""
        keys, blocks, sel = _fetch_args(key, block_ids, select)
        return Transfer(
            self._e.get(
                keys,
                self._peer(peer),
                dst,
                blocks,
                float(timeout),
                _path(path),
                _incarnation(incarnation),
                sel,
                float(await_published),
            )
        )

    def get_blocking(
        self,
        peer: str,
        key: Key | Iterable[Key],
        dst: Region,
        block_ids: Any,
        timeout: float = 5.0,
        *,
        path: str = "direct",
        incarnation: int | None = None,
        select: Selection | None = None,
    ) -> int:
        """Fetches and returns the chunks landed, within ``timeout`` seconds or raises
        ``TimeoutError``. A miss raises ``NotFoundError``; a partial hit returns how many
        leading chunks landed; a peer that is no longer ``incarnation`` raises
        ``PeerRestartedError``. The GIL is released while waiting. ``select``: as for
        :meth:`get`. It is :meth:`get`'s transfer waited for (as the library's
        ``Engine::get_blocking`` is its ``start_get`` waited for): one transfer, one
        deadline, and Ctrl-C cancels it, waits for its drain and raises
        ``KeyboardInterrupt``."""
        return self.get(peer, key, dst, block_ids, timeout=timeout, path=path, incarnation=incarnation, select=select).wait()

    def release_remote(
        self,
        peer: str,
        keys: Key | Iterable[Key],
        timeout: float = 5.0,
        *,
        retry_miss: float = 0.0,
        incarnation: int | None = None,
    ) -> Transfer:
        """Tells ``peer`` that this engine will not fetch ``keys`` (say, the request
        was aborted): the peer releases publications made ``once`` now instead of at
        their TTL. It stages nothing (a ``Release`` request), so it works while the
        peer's staging is full. A miss (not published yet) is retried for up to
        ``retry_miss`` seconds. With ``incarnation`` (the one that published), a peer
        that restarted since is refused with ``PeerRestartedError``. Returns at once;
        the transfer's result is the number of keys released (``NotFoundError`` if
        none was)."""
        ks = [keys] if isinstance(keys, (str, bytes)) else list(keys)
        if not ks:
            raise InvalidArgumentError("empty key list")
        return Transfer(self._e.release_remote(ks, self._peer(peer), float(timeout), float(retry_miss), incarnation))

    def pull(
        self,
        peer: str,
        key: Key | Iterable[Key],
        dst: Region,
        block_ids: Any,
        timeout: float = 5.0,
        *,
        path: str = "direct",
        select: Selection | None = None,
    ) -> int:
        """Delayed pull: the peer stages the keys under a lease, then their bytes move
        into ``dst``; returns the chunks landed. ``select``: as for :meth:`get` (the
        peer stages only the selected bytes)."""
        keys, blocks, sel = _fetch_args(key, block_ids, select)
        return self._e.pull(keys, self._peer(peer), dst, blocks, float(timeout), _path(path), sel)

    def stage(
        self, peer: str, keys: Key | Iterable[Key], timeout: float = 5.0, *, select: Selection | None = None
    ) -> _kvferry.Staged:
        """Delayed pull, step one: ``peer`` stages the keys under a lease (its TTL is
        this engine's ``lease_ttl``) and returns a handle for :meth:`resolve`. Raises
        ``NotFoundError`` when the peer holds none of them. ``select``: stage only the
        selected part (:class:`Selection`; every key must be published), which a
        :meth:`resolve` then lands by the selection's ``dst_ranges`` or its own."""
        ks = [keys] if isinstance(keys, (str, bytes)) else list(keys)
        return self._e.stage(self._peer(peer), ks, float(timeout), _select(select))

    def resolve(
        self,
        staged: _kvferry.Staged,
        dst: Region,
        block_ids: Any,
        timeout: float = 5.0,
        *,
        path: str = "direct",
        select: Selection | None = None,
    ) -> int:
        """Delayed pull, step two: moves a staged handle's chunks into ``dst``
        (``block_ids``: one list per staged chunk, or one list for a single chunk);
        returns the chunks landed. ``PeerRestartedError`` if the peer restarted since.
        A handle staged with a selection lands into ``block_ids`` (one flat list) by
        that selection's ``dst_ranges``, or by ``select``'s, which must name the same
        ``blocks`` and ``src_ranges`` as were staged (``SelectionError`` otherwise)."""
        sel = _select(select)
        rows = block_ids.tolist() if callable(getattr(block_ids, "tolist", None)) else list(block_ids)
        if rows and not isinstance(rows[0], (list, tuple)):
            rows = [rows]
        if sel is not None or staged.selected_bytes is not None:
            rows = [[b for r in rows for b in r]]
        return self._e.resolve(staged, dst, [_ids(r) for r in rows], float(timeout), _path(path), sel)

    def push(self, peer: str, key: Key, data: Any, timeout: float = 5.0) -> None:
        """Pushes ``data`` into ``peer``'s store under ``key``."""
        self._e.push(self._peer(peer), key, byte_view(data, "push"), float(timeout))

    def peers(self) -> dict[str, Any]:
        """The live peers of the etcd directory: ``{"stale": bool, "peers": [{"peer_id",
        "address", "incarnation", "role", "known_for"}]}`` (``stale``: etcd could not
        confirm the list lately; it is the last one known). Answers from memory.
        Without an etcd directory: the static map, never stale."""
        text = self._e.peers_json()
        if text is None:
            return {
                "stale": False,
                "peers": [{"peer_id": k, "address": v} for k, v in sorted(self._directory.items())],
            }
        out: dict[str, Any] = json.loads(text)
        return out

    def locate(self, keys: Key | Iterable[Key], timeout: float = 2.0) -> list[tuple[str, str, int]]:
        """Which live peers of the etcd directory hold ``keys``: ``[(peer_id, address,
        hits)]``, most leading keys first (empty: nobody holds the first key). Asks
        every live peer at once under ``timeout``; a peer that does not answer in time
        counts as holding nothing. Needs an etcd directory."""
        ks = [keys] if isinstance(keys, (str, bytes)) else list(keys)
        return self._e.locate(ks, float(timeout))

    def lookup(self, peer: str, keys: Key | Iterable[Key], timeout: float = 5.0) -> int:
        """How many leading ``keys`` ``peer`` holds."""
        ks = [keys] if isinstance(keys, (str, bytes)) else list(keys)
        return self._e.lookup(self._peer(peer), ks, float(timeout))
