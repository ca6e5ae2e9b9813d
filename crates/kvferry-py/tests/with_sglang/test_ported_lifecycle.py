# mypy: disable-error-code="import-untyped,import-not-found"
"""SGLang 0.5.23's CPU unit tests of a sender's life around its chunks, ported to
kvferry's backend between two real processes (prefill and decode, SGLang's bootstrap
server, every poll also reduced by SGLang's ``poll_and_all_reduce``):

- ``test/registered/unit/disaggregation/test_fake_kv_sender.py`` (``FakeKVSender``):
  polls before the first chunk never conclude; a send concludes ``Success`` and the
  state is kept; a request with no pages concludes; ``abort`` fails at once and the
  state stays ``Failed`` even if a chunk comes late.
- ``test/registered/unit/disaggregation/test_common_sender_lifecycle.py``
  (``CommonKVSender``, the base of the mooncake, nixl and mori senders): an abort stops
  what would be sent and its reason survives to ``failure_exception``; ``Success``
  survives ``clear()``, which forgets the room; a final chunk without KV pages still
  carries the auxiliary row.

Upstream drives one sender with no peer (or a manager built field by field) and reads
its internals (``conclude_state``, the transfer queue); here each assertion is made on
what those internals stand for in a real pair: the states every rank polls, the bytes
that did or did not land on the decode, and the manager's table of rooms. Each
difference is stated where it is made. What was not ported, and why: docs/sglang.md.
"""

from __future__ import annotations

import itertools

from .conftest import Role
from .test_transfer import BOOTSTRAPPING, FAILED, SUCCESS, WAITING, pair, reduced, wait_for

_rooms = itertools.count(7000)
G = "life"


def _paired(pre: Role, dec: Role, src: list[int], dst: list[int]) -> int:
    """A request whose decode has announced ``dst``: the prefill waits for its chunks."""
    room = next(_rooms)
    pre("start", group=G, room=room, pages=src, aux_index=1)
    dec("start", group=G, room=room, pages=dst, aux_index=3)
    # with no pages to send, the sender may conclude at its first poll after pairing
    assert wait_for(pre, G, room, {WAITING, SUCCESS, FAILED}) in ((WAITING,) if src else (WAITING, SUCCESS))
    return room


def _seen(role: Role, room: int, n: int, group: str = G) -> set[int]:
    """Every state any rank saw in ``n`` polls of its own."""
    return {s for states in role("polls", group=group, room=room, n=n)["seen"].values() for s in states}


def test_sender_lifecycle(roles: tuple[Role, Role]) -> None:
    pre, dec = roles
    pair(pre, dec, G, 2, 2)

    # fake: test_polls_before_send_stay_waiting_for_input — a scheduler polls a waiting
    # request once per loop; however often, that alone neither succeeds nor fails it.
    room = _paired(pre, dec, [0, 1, 2], [10, 11, 12])
    assert _seen(pre, room, 1000) == {WAITING}
    assert wait_for(dec, G, room, {WAITING, FAILED}) == WAITING
    assert _seen(dec, room, 1000) == {WAITING}
    assert dec("untouched", group=G, room=room, dst_pages=[10, 11, 12], dst_aux=3)["untouched"] == {
        r: {"pages": [10, 11, 12], "aux": True} for r in ("0", "1")
    }
    # ... and the healthy request then goes through (upstream: "never failed early").
    pre("send", group=G, room=room, pages=[0, 1, 2])
    assert wait_for(pre, G, room, {SUCCESS, FAILED}) == SUCCESS
    assert wait_for(dec, G, room, {SUCCESS, FAILED}) == SUCCESS

    # fake: test_normal_send_flow — Success is the concluded state: every later poll
    # says it again (upstream reads it cached in conclude_state).
    room = _paired(pre, dec, [4, 5], [14, 15])
    pre("send", group=G, room=room, pages=[4, 5])
    assert wait_for(pre, G, room, {SUCCESS, FAILED}) == SUCCESS
    assert wait_for(dec, G, room, {SUCCESS, FAILED}) == SUCCESS
    assert _seen(pre, room, 200) == {SUCCESS}
    assert _seen(dec, room, 200) == {SUCCESS}
    # common: test_success_waits_for_deferred_chunk_and_survives_clear — clear()
    # forgets the room (upstream: request_status no longer holds it) and the request
    # still polls Success.
    assert pre("clear", group=G, room=room)["tracked"] == {"0": False, "1": False}
    assert dec("clear", group=G, room=room)["tracked"] == {"0": False, "1": False}
    assert reduced(pre, G, room) == SUCCESS and reduced(dec, G, room) == SUCCESS

    # fake: test_fully_cached_request_concludes, common:
    # test_zero_kv_final_chunk_still_sends_aux_and_state — no KV pages at all (every
    # page a prefix hit): the request concludes, and the auxiliary row is carried
    # (SGLang's state indices are not: the backend refuses state buffers at start-up).
    room = _paired(pre, dec, [], [])
    assert wait_for(pre, G, room, {SUCCESS, FAILED}) == SUCCESS
    assert wait_for(dec, G, room, {SUCCESS, FAILED}) == SUCCESS
    out = dec("check", group=G, room=room, src_pages=[], dst_pages=[], src_aux=1, dst_aux=3, aux_src={"0": 0, "1": 1})
    assert out["nbad"] == 0, out["bad"]


def test_sender_abort(roles: tuple[Role, Role]) -> None:
    pre, dec = roles
    g = G + "-abort"
    pair(pre, dec, g, 2, 2)

    # fake: test_abort_sets_failed_state — upstream aborts a sender nobody has paired
    # with; here the decode has not arrived either (the sender is Bootstrapping).
    room = next(_rooms)
    pre("start", group=g, room=room, pages=[0, 1], aux_index=1)
    assert reduced(pre, g, room) == BOOTSTRAPPING
    pre("abort", group=g, room=room)
    assert pre("poll", group=g, room=room)["polls"] == {"0": FAILED, "1": FAILED}  # at once, no wait
    assert reduced(pre, g, room) == FAILED

    # common: test_abort_stops_enqueue_and_keeps_abort_reason — after an abort a
    # send() moves nothing (upstream: the transfer queue stays empty; here: the
    # decode's pages and auxiliary row stay zero) and failure_exception names the abort.
    room = next(_rooms)
    pre("start", group=g, room=room, pages=[0, 1, 2], aux_index=1)
    dec("start", group=g, room=room, pages=[20, 21, 22], aux_index=3)
    assert wait_for(pre, g, room, {WAITING, FAILED}) == WAITING
    pre("abort", group=g, room=room)
    pre("send", group=g, room=room, pages=[0, 1, 2])
    # fake: test_waiting_timeout_fails_a_stuck_sender's last step — Failed is terminal:
    # a chunk arriving late does not bring the request back.
    assert _seen(pre, room, 200, g) == {FAILED}
    assert reduced(pre, g, room) == FAILED
    errors = pre("failure", group=g, room=room)["errors"]
    assert set(errors) == {"0", "1"}, errors
    for err in errors.values():
        assert "KvferryTransferError" in err and "aborted by prefill" in err, err  # upstream: matches "Aborted"
    # The abort reaches the decode (upstream has no peer to tell): it fails, and no
    # byte of the aborted request landed.
    assert wait_for(dec, g, room, {FAILED, SUCCESS}, timeout=5) == FAILED
    assert dec("untouched", group=g, room=room, dst_pages=[20, 21, 22], dst_aux=3)["untouched"] == {
        r: {"pages": [20, 21, 22], "aux": True} for r in ("0", "1")
    }
