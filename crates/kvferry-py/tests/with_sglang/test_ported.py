# mypy: disable-error-code="import-untyped,import-not-found"
"""SGLang 0.5.23's CPU unit tests of a sender's chunked conclusion
(``test/registered/unit/disaggregation/test_fake_sender_chunked.py`` upstream), ported
to kvferry's backend between two real processes. Their assertions are kept, with one
difference each states: a real backend's sender is ``Bootstrapping`` until its decode
arrived (the fake one, which has no peer, starts at ``WaitingForInput``), and between
chunks it is ``Transferring`` or ``WaitingForInput`` — never ``Success`` before the
last chunk, which is what the upstream assertion guards."""

from __future__ import annotations

import itertools
import time

from .conftest import Role
from .test_transfer import BOOTSTRAPPING, FAILED, SUCCESS, WAITING, pair, reduced, wait_for

_rooms = itertools.count(5000)


def _start(pre: Role, dec: Role, g: str, num_pages: int) -> int:
    room = next(_rooms)
    pre("start", group=g, room=room, pages=list(range(num_pages)), aux_index=1)
    assert reduced(pre, g, room) == BOOTSTRAPPING  # upstream: WaitingForInput (no peer)
    dec("start", group=g, room=room, pages=[20 + i for i in range(num_pages)], aux_index=3)
    if num_pages:
        assert wait_for(pre, g, room, {WAITING, FAILED}) == WAITING
    else:  # nothing to send: it may conclude at its first poll after pairing
        assert wait_for(pre, g, room, {WAITING, SUCCESS, FAILED}) in (WAITING, SUCCESS)
    return room


def _not_concluded(pre: Role, dec: Role, g: str, room: int) -> None:
    time.sleep(0.3)  # the decode reads and acknowledges what was sent so far
    assert reduced(pre, g, room) not in (SUCCESS, FAILED)
    assert reduced(dec, g, room) not in (SUCCESS, FAILED)


def test_fake_sender_chunked_semantics(roles: tuple[Role, Role]) -> None:
    pre, dec = roles
    pair(pre, dec, "ported", 1, 1)

    # test_single_chunk_concludes_after_send
    room = _start(pre, dec, "ported", 4)
    pre("send", group="ported", room=room, pages=[0, 1, 2, 3])
    assert wait_for(pre, "ported", room, {SUCCESS, FAILED}) == SUCCESS
    assert wait_for(dec, "ported", room, {SUCCESS, FAILED}) == SUCCESS

    # test_chunked_request_only_concludes_on_last_chunk
    room = _start(pre, dec, "ported", 10)
    pre("send", group="ported", room=room, pages=[0, 1, 2, 3])
    _not_concluded(pre, dec, "ported", room)
    pre("send", group="ported", room=room, pages=[4, 5, 6, 7])
    _not_concluded(pre, dec, "ported", room)
    pre("send", group="ported", room=room, pages=[8, 9])
    assert wait_for(pre, "ported", room, {SUCCESS, FAILED}) == SUCCESS
    assert wait_for(dec, "ported", room, {SUCCESS, FAILED}) == SUCCESS
    out = dec("check", group="ported", room=room, src_pages=list(range(10)), dst_pages=[20 + i for i in range(10)],
              src_aux=1, dst_aux=3, aux_src={"0": 0})
    assert out["nbad"] == 0, out["bad"]

    # test_zero_page_request_concludes_immediately (the auxiliary row still moves)
    room = _start(pre, dec, "ported", 0)
    assert wait_for(pre, "ported", room, {SUCCESS, FAILED}) == SUCCESS
    assert wait_for(dec, "ported", room, {SUCCESS, FAILED}) == SUCCESS

    # test_skipped_empty_chunk_does_not_block_conclusion
    room = _start(pre, dec, "ported", 6)
    pre("send", group="ported", room=room, pages=[0, 1, 2, 3])
    _not_concluded(pre, dec, "ported", room)
    pre("send", group="ported", room=room, pages=[4, 5])
    assert wait_for(pre, "ported", room, {SUCCESS, FAILED}) == SUCCESS
    assert wait_for(dec, "ported", room, {SUCCESS, FAILED}) == SUCCESS
