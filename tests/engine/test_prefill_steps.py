"""A prefill engine runs a request's prompt and samples its first token, nothing more: under the overlap
scheduler (forced on the CPU: the step launched next is planned before the last one's tokens are read back)
no decode row is planned for a request whose first token is still on the device."""

from __future__ import annotations

import threading

from servers import free_port

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.request import Request, TokenOutput
from splitserve.engine.roles import build_role
from splitserve.engine.sampling_params import SamplingParams
from splitserve.transfer import TransferConfig


def test_a_prefill_engine_under_overlap_plans_no_decode_row() -> None:
    cfg = EngineConfig(model="tiny", device="cpu", role="prefill", page_size=4, max_total_tokens=2048,
                       max_running_requests=8)
    # Computing ahead of the decode: the prompts run without a decode engine (their KV waits in the rooms).
    transfer = TransferConfig(transfer_control_key="5a" * 16, bootstrap_port=free_port(),
                              prefill_waits_for_decode=False)
    engine = Engine(cfg, role=build_role(cfg, transfer))
    engine.overlap = True
    launched: list[tuple[str, int, int]] = []  # (request, first position, tokens) of every chunk launched
    launch = engine.runner.launch

    def recording(chunks, page_table):
        launched.extend((c.request.request_id, c.start, c.length) for c in chunks)
        return launch(chunks, page_table)

    engine.runner.launch = recording
    prompts = {f"r{i}": list(range(10 + i, 30 + 3 * i)) for i in range(6)}
    ended = threading.Event()
    finished: set[str] = set()

    def on_output(out: TokenOutput) -> None:
        if out.finish_reason is not None:
            finished.add(out.request_id)
            if len(finished) == len(prompts):
                ended.set()

    engine.start()
    try:
        for i, (rid, ids) in enumerate(prompts.items()):
            req = Request(rid, ids, SamplingParams(max_new_tokens=64, temperature=0.0), on_output)
            req.bootstrap_addr, req.bootstrap_room = f"127.0.0.1:{transfer.bootstrap_port}", 1000 + i
            engine.submit(req)
        # Every prompt computed: the requests wait in their rooms for a decode that never comes.
        for _ in range(200):
            if {rid for rid, start, length in launched if start + length >= len(prompts[rid])} == set(prompts):
                break
            ended.wait(0.05)
        else:
            raise AssertionError(f"the prompts were not all computed: {launched}")
        for _ in range(10):  # a few more loop turns: a decode row would have been planned by now
            ended.wait(0.05)
        for rid in prompts:
            engine.abort(rid, "test over")
        assert ended.wait(30)
    finally:
        engine.stop()
    beyond = [(rid, start, length) for rid, start, length in launched if start + length > len(prompts[rid])]
    assert beyond == [], f"steps past a prompt on a prefill engine: {beyond}"
    assert all(sum(n for r, _, n in launched if r == rid) == len(ids) for rid, ids in prompts.items())
