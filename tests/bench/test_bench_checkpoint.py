"""`splitserve bench --profile checkpoint` runs the engine and transformers on the same prompts."""

from __future__ import annotations

import pytest

from splitserve.bench.checkpoint import run_checkpoint_benchmark

pytestmark = pytest.mark.slow  # two models, a few generations


def test_checkpoint_profile_reports_both_sides_on_the_same_work() -> None:
    report = run_checkpoint_benchmark("tiny", "cpu", [1, 2], output_len=4, repeats=1)
    assert [r["batch"] for r in report["rows"]] == [1, 2]
    for row in report["rows"]:
        assert row["output_tokens"] == row["batch"] * 4
        assert row["engine_tokens_per_s"] > 0 and row["transformers_tokens_per_s"] > 0
        assert row["engine_over_transformers"] == pytest.approx(row["transformers_s"] / row["engine_s"])
    # Greedy on the same weights: the engine answers as transformers does (unpadded at batch 1).
    assert report["rows"][0]["identical_answers"] == 1
