"""`splitserve bench --profile fp8` on the CPU with the tiny shape: every side measured, the ratios over bf16."""

from __future__ import annotations

import json
from pathlib import Path

from splitserve.bench import fp8


def test_fp8_bench_reports_each_side_against_bf16(tmp_path: Path) -> None:
    out = tmp_path / "fp8.json"
    assert fp8.main(["--shape", "tiny", "--device", "cpu", "--burst", "4x16:8", "--no-accuracy", "--prefill-len",
                     "64", "--context", "32", "--reps", "1", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["ratios"]) == {"fp8", "fp8+kv", "fp8/w8a16"}
    for side in fp8.MODES:
        row = report[side]
        assert row["decode_b1_s"] > 0
        if side in fp8.DECODE_ONLY:  # the decode step's peer alone
            assert "prefill_tok_s" not in row and "burst_tok_s" not in row
        else:
            assert row["prefill_tok_s"] > 0 and row["burst_tok_s"] > 0
    # float32 on the CPU: an FP8 KV cache holds a token in a quarter of the bytes; FP8 weights are dequantized on load
    assert report["ratios"]["fp8+kv"]["kv_bytes_per_token"] == 0.25
    assert report["ratios"]["fp8"]["kv_bytes_per_token"] == 1.0
    assert report["ratios"]["fp8"]["weight_bytes"] == 1.0
    for side, row in report["ratios"].items():
        assert row["decode_b1_time"] > 0
        assert (side in fp8.DECODE_ONLY) == ("burst_speedup" not in row)
