"""Poll-state agreement across two CPU ranks (gloo): the replica acts on the minimum."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from splitserve.transfer import KVPoll, agree_poll_states

SCRIPT = Path(__file__).resolve().parent / "agreement_rank.py"


def test_two_ranks_agree_on_the_minimum_state_of_each_room():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rank_states = [[4, 3, 0, 2, 4, 1], [3, 4, 1, 4, 4, 1]]
    procs = [subprocess.Popen([sys.executable, "-P", str(SCRIPT), str(rank), "2", str(port), json.dumps(states)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ))
             for rank, states in enumerate(rank_states)]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()[-2000:]
        outputs.append(json.loads(out.decode().strip().splitlines()[-1]))
    want = [min(a, b) for a, b in zip(*rank_states, strict=True)]
    assert want == [3, 3, 0, 2, 4, 1]
    for out in outputs:
        assert out == {"agreed": want, "polled": want, "empty": []}


def test_without_a_process_group_the_local_states_stand():
    assert agree_poll_states([4, 0, 2]) == [KVPoll.Success, KVPoll.Failed, KVPoll.WaitingForInput]
