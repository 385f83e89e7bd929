"""Poll states: integer order, forward-only moves, final states."""

from __future__ import annotations

from splitserve.transfer import KVPoll
from splitserve.transfer.poll_state import advance, is_final
from splitserve.transfer.room_status import RoomStatus


def test_states_are_the_protocol_integers_in_order():
    assert [int(s) for s in KVPoll] == [0, 1, 2, 3, 4]
    assert min(KVPoll.Success, KVPoll.Transferring) == KVPoll.Transferring


def test_states_only_move_forward_and_final_states_stay():
    assert advance(KVPoll.Bootstrapping, KVPoll.Transferring) == KVPoll.Transferring
    assert advance(KVPoll.Transferring, KVPoll.WaitingForInput) == KVPoll.Transferring
    assert advance(KVPoll.Transferring, KVPoll.Failed) == KVPoll.Failed
    assert advance(KVPoll.Failed, KVPoll.Success) == KVPoll.Failed
    assert advance(KVPoll.Success, KVPoll.Failed) == KVPoll.Success
    assert is_final(KVPoll.Failed) and is_final(KVPoll.Success) and not is_final(KVPoll.Transferring)


def test_room_status_deadline_follows_the_current_state():
    timeouts = {KVPoll.Bootstrapping: 1.0, KVPoll.WaitingForInput: 5.0, KVPoll.Transferring: 2.0}
    status = RoomStatus(9, timeouts, now=100.0)
    assert status.expired(100.9) is None
    assert status.expired(101.1).state == "Bootstrapping"
    status.move(KVPoll.WaitingForInput, now=101.0)
    assert status.expired(105.9) is None and status.expired(106.1).timeout_s == 5.0
    status.move(KVPoll.Transferring, now=106.0)
    status.touch(107.5)
    assert status.expired(109.4) is None and status.expired(109.6) is not None
    assert status.history == [KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring]


def test_room_status_moves_as_advance_says_and_tells_only_real_changes():
    """``move`` inlines ``advance``: for every pair of states it lands where ``advance`` says (Failed only
    through ``fail``), returns whether it moved and calls ``on_change`` exactly then."""
    timeouts = {KVPoll.Bootstrapping: 1.0, KVPoll.WaitingForInput: 5.0, KVPoll.Transferring: 2.0}
    for start in KVPoll:
        for target in KVPoll:
            changes: list[KVPoll] = []
            status = RoomStatus(1, timeouts, 0.0, lambda s, changes=changes: changes.append(s.state))
            if start == KVPoll.Failed:
                status.fail(None)  # type: ignore[arg-type]
            elif start != KVPoll.Bootstrapping:
                status.move(start, 0.0)
            changes.clear()
            want = advance(start, target)
            moved = status.move(target, 1.0)
            assert moved == (want != start and want != KVPoll.Failed), (start, target)
            assert status.state == (start if want == KVPoll.Failed else want), (start, target)
            assert status.final == is_final(status.state) and changes == ([status.state] if moved else [])
            if moved and not status.final:
                assert status.deadline == 1.0 + timeouts[status.state]
