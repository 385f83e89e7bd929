"""Write fences: a failed room's buffers stay out of use until no write for it can land.

One implementation for both transfers whose writer is remote: a decode's KV pages (written by the
prefill ranks) and a prefill's embedding slots (written by an encoder, embedding_receiver.py;
there ``bootstrap_addr`` is "" and the only writer is the encoder). In KV terms: once a decode
rank sent a room's metadata, the prefill may write into its pages at any time until
it stops, even long after the room failed here: a prefill frozen (SIGSTOP, a stalled host) in the
middle of a transfer resumes where it was. So a room that fails after its metadata went out is
fenced: its pages are held until every prefill rank of the replica

- acknowledged the room's abort (``RoomFenced``: no write of that rank for the room is in flight
  and none will start; the decode asks again every heartbeat interval until it answers), or
- is known gone: another process answers at its control endpoint, nothing listens there any more
  (a connection to it is refused: the process that bound it exited; a frozen one's kernel still
  accepts), or the replica's bootstrap server lists a different incarnation for that rank (a
  restarted prefill: the old process is dead), or
- is past ``lift_at``: the write-by deadline the metadata carried (the prefill starts no write
  after it) plus ``transfer_fence_grace_s``, the longest one write already started may take.
  A prefill frozen in the middle of one Mooncake batch for longer than that is the one case this
  does not cover.

Pure bookkeeping on timestamps: the manager's control thread drives it under the manager's lock.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

CONNECT_TIMEOUT_S = 0.5


@dataclass
class WriteFence:
    """The fence of one failed room; ``pending`` maps each prefill rank's control endpoint to the
    incarnation (instance id) its metadata went to."""

    room: int
    bootstrap_addr: str
    pending: dict[str, str]
    created: float
    lift_at: float
    next_query: float
    next_lookup: float = 0.0
    outcome: str = field(default="")  # how it ended: acknowledged, peer gone, deadline

    def lifted(self, now: float) -> bool:
        """No write for the room can land any more."""
        if not self.outcome:
            if not self.pending:
                self.outcome = "acknowledged"
            elif now >= self.lift_at:
                self.outcome = "deadline"
        return bool(self.outcome)

    def acknowledged(self, endpoint: str) -> None:
        """``endpoint`` answered: it writes nothing more for the room."""
        self.pending.pop(endpoint, None)

    def peer_seen(self, endpoint: str, instance: str) -> None:
        """A message from ``endpoint`` by ``instance``: another process there means ours is gone."""
        expected = self.pending.get(endpoint)
        if expected and instance and instance != expected:  # "": the writer's instance was not known
            del self.pending[endpoint]
            if not self.pending and not self.outcome:
                self.outcome = "peer gone"

    def peer_gone(self, endpoint: str, instance: str) -> None:
        """The process ``instance`` at ``endpoint`` is known to have exited."""
        if self.pending.get(endpoint) == instance:
            del self.pending[endpoint]
            if not self.pending and not self.outcome:
                self.outcome = "peer gone"

    def registered(self, incarnations: set[tuple[str, str]]) -> None:
        """The replica's bootstrap server lists these (endpoint, instance) pairs now: a pending
        rank no longer among them was replaced by a new process."""
        for endpoint, instance in list(self.pending.items()):
            if (endpoint, instance) not in incarnations:
                del self.pending[endpoint]
                if not self.pending and not self.outcome:
                    self.outcome = "peer gone"


def nothing_listens(endpoint: str) -> bool:
    """True when a TCP connection to the control ``endpoint`` (``tcp://host:port``) is refused: the
    process that had it bound exited. A frozen process's kernel still accepts; a host that does not
    answer at all tells nothing (False)."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False
