"""Chaos: `splitserve up --prefill 2 --decode 2` under load while a decode and then a prefill are
killed with SIGKILL. Every request ends (200 or a clear OpenAI-style error), none hangs; 15 s
after the kills every new request succeeds; the engines left alone hold no pages afterwards."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
from servers import assert_kv_back_to_start, running_up

from splitserve.bench.chaos import Kill, RequestRecord, load_until, summarize

KEY = "c0ffee" * 8


def test_summary_counts_per_kill_what_was_tokenless_and_when_new_requests_all_succeeded_again() -> None:
    records = [
        RequestRecord(0.0, 3.0, outcome="ok"),  # in flight at the first kill, no token yet: retried, ok
        RequestRecord(1.0, 2.2, first_token=1.5, tokens=3, outcome="clear_error"),  # broke after its token
        RequestRecord(2.6, 2.8, outcome="clear_error"),  # new after the first kill, failed
        RequestRecord(2.9, 3.1, outcome="ok"),  # ... and from here on all succeeded: recovery 0.9 s
        RequestRecord(3.5, 4.0, outcome="ok"),
        RequestRecord(2.5, 6.0, outcome="unclear"),  # in flight when the router died: the second kill's
        RequestRecord(6.0, 7.0, outcome="hung"),
    ]
    s = summarize(records, [Kill(2.0, "decode-0", "decode"), Kill(5.0, "router", "router")])
    first, second = s["kills"]
    assert (first["in_flight_without_token"], first["of_those_ok"]) == (1, 1)
    assert (first["new_requests"], first["new_requests_ok"]) == (3, 2)
    assert abs(first["recovery_s"] - 0.9) < 1e-9
    assert (second["in_flight_without_token"], second["of_those_ok"]) == (1, 0)
    assert s["targets"] == {"hung": 1, "tokenless_ok": 1, "tokenless": 1, "max_recovery_s": first["recovery_s"]}
    assert (s["ok"], s["clear_error"], s["unclear"], s["hung"]) == (3, 2, 1, 1)


@pytest.mark.slow
def test_killing_a_decode_then_a_prefill_under_load_hangs_nothing_and_recovers(tmp_path) -> None:
    engine_args = ("--max-running-requests 16 --transfer-heartbeat-interval-s 0.2 --transfer-heartbeat-misses 5")
    with running_up(["--model", "tiny", "--prefill", "2", "--decode", "2", "--transfer-control-key", KEY,
                     "--engine-args", engine_args], tmp_path / "up.log") as up:
        engines = up.engines()  # role -> [(pid, url)]
        kills: list[Kill] = []
        start = time.monotonic()
        schedule = [(start + 4, "decode"), (start + 10, "prefill")]

        def killer() -> None:
            for at, role in schedule:
                time.sleep(max(0.0, at - time.monotonic()))
                pid, url = engines[role][0]
                os.kill(pid, signal.SIGKILL)
                kills.append(Kill(time.monotonic(), url, role))

        thread = threading.Thread(target=killer)
        thread.start()
        records = asyncio.run(load_until(up.url, start + 10 + 15 + 8, concurrency=4,
                                         prompt_len=24, max_tokens=16, deadline_s=30))
        thread.join()
        s = summarize(records, kills)
        assert s["hung"] == 0 and s["unclear"] == 0 and s["unreachable"] == 0, s
        assert s["longest_s"] < 30, s
        assert s["ok"] + s["clear_error"] == s["requests"]
        late = [r for r in records if r.start >= kills[-1].at + 15]
        assert len(late) >= 4 and all(r.outcome == "ok" for r in late), s
        tokenless = sum(k["in_flight_without_token"] for k in s["kills"])
        assert tokenless >= 2 and sum(k["of_those_ok"] for k in s["kills"]) >= 0.95 * tokenless, s
        for role in ("prefill", "decode"):
            assert_kv_back_to_start(engines[role][1][1], timeout=20, key=KEY)  # the engines left alone
        assert up.log_text().count("restarting ") >= 1
        up.sigterm_leaves_no_child()
