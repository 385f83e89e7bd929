"""Service-time models: the shipped default has the shape it claims, and the fit recovers known coefficients from
points in the documented format (the bench engine report's rows)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitserve.planner.service_model import (
    default_model,
    default_profile,
    fit_decode,
    fit_prefill,
    fit_profile,
    load_profile,
)


def test_default_llama_8b_h200_shape() -> None:
    m = default_model()
    assert 10_000 <= m.prefill.tokens_per_s(8192) <= 12_000
    quad = m.prefill.c * 8192**2 / m.prefill.seconds(8192)
    assert 0 < quad < 0.15  # attention's quadratic term: small at 8k
    assert m.decode.step_seconds(1, 1024) == pytest.approx(0.005, rel=0.05)
    assert m.decode.step_seconds(256, 1024) == pytest.approx(0.017, rel=0.05)
    assert m.decode.kv_capacity_tokens == 800_000 and m.decode.max_batch == 256


def test_fit_recovers_coefficients() -> None:
    a, b, c = 0.02, 9e-5, 1e-9
    p = fit_prefill([{"tokens": n, "seconds": a + b * n + c * n * n} for n in (256, 1024, 4096, 8192, 16384)])
    assert (p.a, p.b, p.c) == pytest.approx((a, b, c), rel=1e-6)
    rows = [{"batch": bs, "context": ctx, "step_s": 0.004 + 2e-5 * bs + 4e-8 * bs * ctx}
            for ctx in (512, 4096) for bs in (1, 16, 64, 256)]
    d = fit_decode(rows)
    assert (d.fixed, d.per_seq, d.per_token) == pytest.approx((0.004, 2e-5, 4e-8), rel=1e-6)


def test_fit_accepts_bench_report_rows_and_alternatives(tmp_path: Path) -> None:
    # The bench engine report's rows carry more fields; tokens_per_s and step_ms are accepted too.
    prof = default_profile()
    report = {"shape": "llama-3.1-8b", "device": "NVIDIA H200",
              "prefill": [{"tokens": r["tokens"], "tokens_per_s": r["tokens"] / r["seconds"], "path": "eager",
                           "mfu_vs_measured_matmul": 0.4} for r in prof["prefill"]],
              "decode": [{"batch": r["batch"], "context": r["context"], "step_ms": r["step_s"] * 1e3,
                          "roofline_s": 0.0} for r in prof["decode"]]}
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(report))
    m, ref = load_profile(path), default_model()
    assert m.prefill.seconds(8000) == pytest.approx(ref.prefill.seconds(8000), rel=1e-6)
    assert m.decode.step_seconds(100, 3000) == pytest.approx(ref.decode.step_seconds(100, 3000), rel=1e-6)


def test_one_context_fit_and_negative_terms() -> None:
    # All rows at one context: per-sequence and per-token cost cannot be told apart; the fit still predicts them.
    rows = [{"batch": bs, "context": 1024, "step_s": 0.005 + 5e-5 * bs} for bs in (1, 8, 64, 256)]
    d = fit_decode(rows)
    for bs in (1, 32, 256):
        assert d.step_seconds(bs, 1024) == pytest.approx(0.005 + 5e-5 * bs, rel=1e-6)
    # A purely linear prefill: the quadratic term is held at 0, never negative.
    p = fit_prefill([{"tokens": n, "seconds": 0.01 + 1e-4 * n} for n in (100, 1000, 5000)])
    assert p.c == 0.0 or p.c == pytest.approx(0.0, abs=1e-15)
    with pytest.raises(ValueError):
        fit_prefill([{"tokens": 1, "seconds": 1.0}])
    with pytest.raises(ValueError):
        fit_profile({"prefill": [], "decode": []})
