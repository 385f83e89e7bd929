"""A role whose attach failed part-way during a role switch: what it started is stopped, what it took over from
the old role is left for the next attempt (engine/role_switch.py's release_partly_attached)."""

from __future__ import annotations

from typing import Any

from splitserve.engine.role import ComposedRole, Role
from splitserve.engine.role_switch import release_partly_attached


class Closable:
    def __init__(self) -> None:
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


class Started(Role):
    """Attached: hands over the endpoint it took and a server it started itself (stopped on hand-over)."""

    def __init__(self, endpoint: Closable, own: Closable) -> None:
        self.endpoint, self.own, self.server_stopped = endpoint, own, False

    def hand_over(self) -> dict[str, Any]:
        self.server_stopped = True
        return {"kv_transfer_endpoint": self.endpoint, "own": self.own}


class NeverAttached(Role):
    def close(self) -> None:
        raise AttributeError("'NeverAttached' object has no attribute 'receiver'")


def test_what_a_partly_attached_role_started_stops_and_what_it_took_over_stays() -> None:
    endpoint, own = Closable(), Closable()
    started = Started(endpoint, own)
    release_partly_attached(ComposedRole("prefill", [started, NeverAttached()]), {"kv_transfer_endpoint": endpoint})
    assert started.server_stopped and own.closed == 1
    assert endpoint.closed == 0  # the old role's endpoint goes on to the role built next


class TakesTheEndpoint(Role):
    def take_over(self, kept: dict[str, Any]) -> set[str]:
        self.endpoint = kept["kv_transfer_endpoint"]
        return {"kv_transfer_endpoint"}

    def hand_over(self) -> dict[str, Any]:
        return {"kv_transfer_endpoint": self.endpoint}


def test_a_role_carries_what_it_does_not_use_hands_it_over_again_and_closes_it_at_stop() -> None:
    endpoint, receiver = Closable(), Closable()
    decode = ComposedRole("decode", [TakesTheEndpoint()])
    kept = {"kv_transfer_endpoint": endpoint, "embedding_receiver": receiver}
    assert decode.take_over(kept) == set(kept)  # nothing is left for the switch to close
    assert decode.carried == {"embedding_receiver": receiver}
    assert decode.hand_over() == kept  # a switch back to prefill gets the receiver again
    decode.close()
    assert receiver.closed == 1 and endpoint.closed == 0  # the endpoint is the behaviour's to close
