"""One rank of the agreement test: ``python -P agreement_rank.py RANK WORLD PORT STATES_JSON``.

Prints the agreed states of ``agree_poll_states`` and of ``poll_and_agree`` as one JSON line.
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from splitserve.transfer import KVPoll, agree_poll_states, poll_and_agree


class FixedRoom:
    def __init__(self, state: int) -> None:
        self.state = KVPoll(state)

    def poll(self) -> KVPoll:
        return self.state


def main() -> None:
    rank, world, port = (int(a) for a in sys.argv[1:4])
    states = json.loads(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        agreed = agree_poll_states(states)
        polled = poll_and_agree([FixedRoom(s) for s in states])
        empty = agree_poll_states([])
    finally:
        dist.destroy_process_group()
    print(json.dumps({"agreed": [int(s) for s in agreed], "polled": [int(s) for s in polled], "empty": empty}))


if __name__ == "__main__":
    main()
