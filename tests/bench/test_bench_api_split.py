"""`splitserve bench --profile api-split` end to end on the CPU, with the client's own figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitserve.bench.command import main as bench_main


@pytest.mark.slow
def test_api_split_profile_runs_on_the_cpu_and_reports_its_client(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "api_split.json"
    rc = bench_main(["--profile", "api-split", "--shape", "tiny", "--device", "cpu", "--fixed-loads", "6x12:4",
                     "--max-running-requests", "8", "--client-processes", "2", "--output", str(out)])
    assert rc == 0
    (entry,) = json.loads(out.read_text())["api_split"]["loads"]
    assert entry["bare_engine"]["output_tokens_per_s"] > 0
    assert set(entry["served"]) == {"one process", "engine core process"}
    for r in entry["served"].values():
        assert r["ok"] == r["requests"] == 6 and r["output_tokens"] == 24
        client = r["client"]
        assert client["processes"] == 2 and len(client["busy"]) == 2 and client["events"] >= 24
        assert 0 < client["busy_max"] == max(client["busy"])
    printed = capsys.readouterr().out
    assert printed.count("client: 2 processes, busy max") == 2
