"""Per-role service-time models, fitted by least squares from engine measurements.

Prefill: the seconds of one forward over a prompt of ``n`` tokens, ``a + b*n + c*n^2`` (a fixed launch cost, the
matmuls linear in ``n``, attention quadratic). A batch of prompts costs ``a + b*sum(n) + c*sum(n^2)``: the
matmuls see every token, attention only a prompt's own.

Decode: the seconds of one step of a batch of ``batch`` sequences at ``context`` tokens each,
``fixed + per_seq*batch + per_token*batch*context`` (weights read once per step, a little compute per sequence,
and the KV cache read, one entry per token in the batch).

The input format (``fit_profile``) is the JSON that ``splitserve bench --profile engine --output FILE`` writes, or
anything with the same two lists::

    {"prefill": [{"tokens": 8192, "seconds": 0.745}, ...],
     "decode":  [{"batch": 1, "context": 1024, "step_s": 0.00495}, ...]}

Other fields of the rows (``tokens_per_s``, ``mfu_vs_measured_matmul``...) are ignored. A prefill row may give
``tokens_per_s`` instead of ``seconds``; a decode row may give ``step_ms`` instead of ``step_s``.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillModel:
    """Seconds of a prefill forward: ``a + b*n + c*n^2`` for one prompt of ``n`` tokens."""

    a: float
    b: float
    c: float

    def seconds(self, tokens: float) -> float:
        """Seconds of one prompt of ``tokens`` tokens."""
        return self.a + self.b * tokens + self.c * tokens * tokens

    def batch_seconds(self, prompts: Sequence[int]) -> float:
        """Seconds of one forward over several prompts (attention only within a prompt)."""
        total = sum(prompts)
        return self.a + self.b * total + self.c * sum(n * n for n in prompts)

    def tokens_per_s(self, tokens: float) -> float:
        """Prompt tokens per second of one replica serving prompts of ``tokens`` tokens back to back."""
        return tokens / self.seconds(tokens)


@dataclass(frozen=True)
class DecodeModel:
    """Seconds of a decode step: ``fixed + per_seq*batch + per_token*batch*context``."""

    fixed: float
    per_seq: float
    per_token: float
    kv_capacity_tokens: int = 800_000
    max_batch: int = 256

    def step_seconds(self, batch: float, context: float) -> float:
        """Seconds of one step of ``batch`` sequences at ``context`` tokens each."""
        return self.fixed + self.per_seq * batch + self.per_token * batch * context

    def step_seconds_sum(self, batch: float, context_sum: float) -> float:
        """Seconds of one step of ``batch`` sequences holding ``context_sum`` tokens in all."""
        return self.fixed + self.per_seq * batch + self.per_token * context_sum

    def max_batch_within(self, step_s: float, context: float) -> int:
        """The largest batch (at most ``max_batch``) whose step at ``context`` stays within ``step_s``; 0 if none."""
        slope = self.per_seq + self.per_token * context
        if slope <= 0:
            return self.max_batch if self.fixed <= step_s else 0
        return max(0, min(self.max_batch, math.floor((step_s - self.fixed) / slope)))


@dataclass(frozen=True)
class ServiceModel:
    """The prefill and decode models of one engine shape on one device."""

    prefill: PrefillModel
    decode: DecodeModel
    source: str = "fitted"

    def to_dict(self) -> dict[str, Any]:
        """The fitted coefficients, JSON-ready."""
        return {"prefill": asdict(self.prefill), "decode": asdict(self.decode), "source": self.source}


def _least_squares(rows: list[list[float]], ys: list[float], names: Sequence[str]) -> list[float]:
    """Non-negative least squares (coefficients < 0 are dropped and the rest refitted), relative error."""
    x = np.asarray(rows, dtype=float)
    y = np.asarray(ys, dtype=float)
    weights = 1.0 / y  # fit relative error: short and long points count alike
    active = list(range(x.shape[1]))
    while True:
        sol, *_ = np.linalg.lstsq(x[:, active] * weights[:, None], y * weights, rcond=None)
        negative = [active[i] for i, v in enumerate(sol) if v < 0]
        if not negative:
            break
        for i in negative:
            logger.info("service model: %s fitted negative, held at 0", names[i])
            active.remove(i)
        if not active:
            return [0.0] * x.shape[1]
    out = [0.0] * x.shape[1]
    for i, v in zip(active, sol, strict=True):
        out[i] = float(v)
    return out


def fit_prefill(points: Sequence[Mapping[str, float]]) -> PrefillModel:
    """Fit ``a + b*n + c*n^2`` to rows ``{"tokens": n, "seconds": s}`` (or ``tokens_per_s``); 3 rows at least."""
    rows, ys = [], []
    for p in points:
        n = float(p["tokens"])
        s = float(p["seconds"]) if "seconds" in p else n / float(p["tokens_per_s"])
        rows.append([1.0, n, n * n])
        ys.append(s)
    if len(rows) < 3:
        raise ValueError(f"prefill fit needs 3 points at least, got {len(rows)}")
    a, b, c = _least_squares(rows, ys, ("prefill a", "prefill b", "prefill c"))
    return PrefillModel(a, b, c)


def fit_decode(points: Sequence[Mapping[str, float]], kv_capacity_tokens: int = 800_000,
               max_batch: int = 256) -> DecodeModel:
    """Fit ``fixed + per_seq*b + per_token*b*c`` to rows ``{"batch": b, "context": c, "step_s": s}``.

    With every row at one context, ``per_seq`` and ``per_token`` cannot be told apart: the fit keeps them in the
    ratio of the default model. Measure two contexts to fit both."""
    rows, ys = [], []
    for p in points:
        b, c = float(p["batch"]), float(p["context"])
        s = float(p["step_s"]) if "step_s" in p else float(p["step_ms"]) / 1e3
        rows.append([1.0, b, b * c])
        ys.append(s)
    if len(rows) < 2:
        raise ValueError(f"decode fit needs 2 points at least, got {len(rows)}")
    contexts = {r[2] / r[1] for r in rows}
    if len(contexts) == 1:
        c = contexts.pop()
        ratio = DEFAULT_DECODE_PER_SEQ / DEFAULT_DECODE_PER_TOKEN  # per_seq = ratio * per_token
        fixed, slope = _least_squares([[r[0], r[1] * (ratio + c)] for r in rows], ys, ("decode fixed", "slope"))
        return DecodeModel(fixed, slope * ratio, slope, kv_capacity_tokens, max_batch)
    fixed, per_seq, per_token = _least_squares(rows, ys, ("decode fixed", "decode per_seq", "decode per_token"))
    return DecodeModel(fixed, per_seq, per_token, kv_capacity_tokens, max_batch)


def fit_profile(profile: Mapping[str, Any], kv_capacity_tokens: int | None = None,
                max_batch: int | None = None, source: str = "fitted") -> ServiceModel:
    """A ServiceModel from a bench engine report (or the documented minimal dict).

    ``kv_capacity_tokens`` and ``max_batch`` come from the arguments, else from the profile's fields of those
    names, else the defaults (800,000 tokens, 256)."""
    kv = kv_capacity_tokens or int(profile.get("kv_capacity_tokens", 800_000))
    mb = max_batch or int(profile.get("max_batch", 256))
    return ServiceModel(fit_prefill(profile["prefill"]), fit_decode(profile["decode"], kv, mb), source)


def load_profile(path: str | Path) -> ServiceModel:
    """fit_profile over a JSON file."""
    return fit_profile(json.loads(Path(path).read_text()), source=str(path))


# ---- the default: a Llama-3.1-8B-shaped engine on one H200 (estimates, to be refitted) ----------------------------

# Prefill: ~12,200 tok/s of linear work, attention adding ~8% at 8k tokens, 15 ms fixed: ~11,000 tok/s at 8k.
DEFAULT_PREFILL = (0.015, 1 / 12_200, 8.9e-10)
# Decode: ~4.9 ms of weights and launch per step, 15 us per sequence, 32 ns per KV token read
# (Llama-3.1-8B: 128 KiB of bf16 KV per token at ~4 TB/s): 5 ms at batch 1, ~17 ms at batch 256, 1k context.
DEFAULT_DECODE_FIXED = 4.9e-3
DEFAULT_DECODE_PER_SEQ = 15e-6
DEFAULT_DECODE_PER_TOKEN = 32e-9
# KV pool: ~110 GB of an H200's 141 GB after weights and activations, 128 KiB a token.
DEFAULT_KV_CAPACITY_TOKENS = 800_000


def default_profile() -> dict[str, Any]:
    """The default model's points, in the input format: what an engine of that shape is estimated to measure."""
    a, b, c = DEFAULT_PREFILL
    prefill = [{"tokens": n, "seconds": a + b * n + c * n * n} for n in (512, 1024, 2048, 4096, 8192, 16384)]
    decode = [{"batch": bs, "context": ctx,
               "step_s": DEFAULT_DECODE_FIXED + DEFAULT_DECODE_PER_SEQ * bs + DEFAULT_DECODE_PER_TOKEN * bs * ctx}
              for ctx in (1024, 8192) for bs in (1, 8, 32, 64, 128, 256)]
    return {"prefill": prefill, "decode": decode, "kv_capacity_tokens": DEFAULT_KV_CAPACITY_TOKENS, "max_batch": 256}


def default_model() -> ServiceModel:
    """The shipped default: a Llama-3.1-8B-shaped engine on one H200, fitted from ``default_profile()``."""
    return fit_profile(default_profile(), source="default: Llama-3.1-8B-shaped, one H200 (estimates)")
