"""A decode step's roofline that counts compute, beside the HBM one the benchmarks report.

The HBM roofline is every weight and KV byte read once at the measured copy bandwidth. At a few
rows that is the limit; at 256 rows the projections do 2 x 256 FLOPs per weight and are
compute-bound, which it does not see. This one takes, per operation of the step, the longer of its
bytes at the copy bandwidth and its FLOPs at the measured matmul peak: each projection (its weights;
the rows' activations are a few MB and left out, as the HBM figure leaves them out), attention (the
KV it reads; QK^T and PV), and the weights no projection reads in full (the embedding table and the
norms), which the HBM figure counts as read, at the bandwidth.
"""

from __future__ import annotations

from typing import Any


def attention_dims(cfg: dict[str, Any]) -> tuple[int, int, int]:
    """(query heads, KV heads, head size) of a model config."""
    heads = cfg["num_attention_heads"]
    return heads, cfg.get("num_key_value_heads", heads), cfg.get("head_dim") or cfg["hidden_size"] // heads


def projection_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, int, int]]:
    """(input features, output features, times per step) of each projection of a decode step."""
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv_heads, head_dim = attention_dims(cfg)
    return {"qkv": (hidden, (heads + 2 * kv_heads) * head_dim, layers), "o": (heads * head_dim, hidden, layers),
            "gate_up": (hidden, 2 * inter, layers), "down": (inter, hidden, layers),
            "lm_head": (hidden, cfg["vocab_size"], 1)}


def decode_step_rooflines(cfg: dict[str, Any], batch: int, context: float, weight_bytes: int, bandwidth: float,
                          peak_flops: float, dtype_bytes: int = 2) -> dict[str, Any]:
    """Seconds of one decode step of `batch` rows at `context` tokens of KV each: `hbm_s` (weights and
    KV at the bandwidth: the HBM roofline) and `compute_s` (per operation max(bytes / bandwidth,
    FLOPs / peak), so never below `hbm_s`), with the per-operation terms and which bound each hit.
    `dtype_bytes`: the weights' and the KV cache's element size."""
    heads, kv_heads, head_dim = attention_dims(cfg)
    layers = cfg["num_hidden_layers"]
    ops: dict[str, tuple[float, float]] = {}  # name -> (bytes, flops) per step
    for name, (k, n, times) in projection_shapes(cfg).items():
        ops[name] = (k * n * dtype_bytes * times, 2 * batch * k * n * times)
    ops["attention"] = (batch * context * 2 * kv_heads * head_dim * dtype_bytes * layers,
                        4 * batch * context * heads * head_dim * layers)
    projected = sum(b for name, (b, _) in ops.items() if name != "attention")
    ops["other weights"] = (max(0, weight_bytes - projected), 0.0)
    terms = {name: {"bytes_s": b / bandwidth, "flops_s": f / peak_flops,
                    "bound": "compute" if f / peak_flops > b / bandwidth else "memory"}
             for name, (b, f) in ops.items()}
    kv_bytes = ops["attention"][0]
    return {"hbm_s": (weight_bytes + kv_bytes) / bandwidth,
            "compute_s": sum(max(t["bytes_s"], t["flops_s"]) for t in terms.values()), "ops": terms}
