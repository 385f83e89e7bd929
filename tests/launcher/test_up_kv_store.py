"""`splitserve up --kv-store`: a Mooncake Store master on loopback before the engines, every engine wired
to it, a second engine served from pages the first one evicted, the master restarted like any child
(the engines serving throughout, and using it again once it is back), and stopped last."""

from __future__ import annotations

import os
import random
import signal
import time

import httpx
import pytest
from servers import children_of, cmdline_of, is_zombie, running_up

pytest.importorskip("mooncake.store")
pytestmark = pytest.mark.slow


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def complete(url: str, prompt: str) -> dict:
    r = httpx.post(f"{url}/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def master_of(up) -> tuple[int, list[str]]:
    """The running master's pid and argv ((0, []) while there is none)."""
    for pid in children_of(up.proc.pid):
        if is_zombie(pid):
            continue
        try:
            argv = cmdline_of(pid)
        except OSError:
            continue
        if argv and os.path.basename(argv[0]) == "mooncake_master":
            return pid, argv
    return 0, []


def test_up_kv_store_shares_evicted_pages_between_engines_and_survives_its_master(tmp_path) -> None:
    args = ["--model", "tiny", "--unified", "2", "--kv-store", "--kv-store-segment-mb", "32",
            "--restart-backoff-s", "0.5",
            "--engine-args", "--page-size 4 --max-total-tokens 256 --kv-store-timeout-ms 2000"]
    with running_up(args, tmp_path / "up.log") as up:
        pid, master_args = master_of(up)
        assert pid
        assert "--rpc_address=127.0.0.1" in master_args
        port = next(a.split("=", 1)[1] for a in master_args if a.startswith("--rpc_port="))
        engines = up.engines()["unified"]
        assert len(engines) == 2
        for engine_pid, _ in engines:
            argv = cmdline_of(engine_pid)
            assert argv[argv.index("--kv-store") + 1] == f"127.0.0.1:{port}"
            assert argv[argv.index("--kv-store-segment-mb") + 1] == "32"
        (_, first), (_, second) = engines
        for url in (first, second):
            wait_for(lambda u=url: metric(u, "splitserve_kv_store_up") == 1, 60, f"{url}'s store client not up")
        rng = random.Random(0)
        prompts = [" ".join(rng.choice(["alpha", "beta", "gamma", "delta", "omega", "sigma"]) for _ in range(20))
                   for _ in range(6)]
        expected = [complete(first, p)["choices"][0]["text"] for p in prompts]  # evicts the first prompts
        wait_for(lambda: metric(first, "splitserve_kv_store_written_bytes_total") > 0, 10, "nothing written")
        out = complete(second, prompts[0])  # never seen by the second engine
        assert out["choices"][0]["text"] == expected[0]
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert metric(second, "splitserve_kv_store_hit_tokens_total") > 0
        # The master dies: the engines serve on (same outputs), `up` restarts it on the same port.
        os.kill(pid, signal.SIGKILL)
        for i, p in enumerate(prompts[:3]):
            assert complete(second, p)["choices"][0]["text"] == expected[i]
        wait_for(lambda: master_of(up)[0] not in (0, pid), 30, "the master was not restarted")
        assert f"--rpc_port={port}" in master_of(up)[1]

        def back() -> bool:  # the clients reconnect to the new master (empty) once their backoff ends
            complete(second, prompts[rng.randrange(6)] + " again")
            return metric(second, "splitserve_kv_store_up") == 1

        wait_for(back, 60, "the second engine's store never came back")
        # Whether a lookup met the dead master depends on how fast `up` restarted it: the failure count is
        # pinned where the kill's timing is controlled (tests/engine/test_store_kv.py), not here.
        assert "kv-store" in up.log_text()
        up.sigterm_leaves_no_child()  # the master included
