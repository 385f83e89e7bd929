"""The projections' GEMMs under sustained load: cuBLAS as torch calls it against cuBLASLt's other
algorithms, the weight stored [K, N], and torch's cuBLASLt path, each at the power cap.

  python3 -P benchmarks/gemm_sustained.py --shape llama-3.1-8b --rows 2048 256 --output X.json \
      [--table-out gemm_algos.json]

Under the engine's loads the H200 sits at its 700 W cap (1,400-1,650 MHz), where a kernel's energy
per FLOP sets its speed, so a short burst at 1,980 MHz ranks kernels by the wrong measure. Here every
variant of every shape is one CUDA graph of back-to-back calls (~8 ms a replay, over weight copies of
at least 512 MiB at decode row counts, so the weights come from HBM as in a step); all graphs are
replayed in a shuffled round-robin, first for `--heat-s` untimed (the GPU reaches its cap), then
`--rounds` times timed by events, with no idle between them: each variant is timed in the same
sustained state as the others. Per shape the report gives us per call (median over rounds), TFLOP/s
and the ratio to torch's call (torch.mm, which F.linear runs), and each variant's output against it.

Variants: `linear` (torch.mm(x, W.T), F.linear's path), `lt_pref` (the same with
torch.backends.cuda.preferred_blas_library("cublaslt")), `kn` (x @ W' with W' = W.T stored [K, N]),
`lt0..ltN` (cuBLASLt's heuristic candidates 0..N-1 through engine/layers/cublaslt.py). Last, whether
TunableOp offers anything on this build (its results for one shape). `--table-out` writes the
winning cuBLASLt algorithm per shape where it took <= `--win` of linear's time (the file
engine/layers/gemm_algos.py reads).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from splitserve.bench.step_roofline import projection_shapes
from splitserve.engine.checkpoints.model_shapes import SHAPES
from splitserve.engine.layers import cublaslt, gemm_algos

logger = logging.getLogger("gemm_sustained")
TARGET_REPLAY_US = 8000.0


def shapes_of(cfg: dict, rows_list: list[int], lm_head_rows: set[int]) -> list[tuple[str, int, int, int]]:
    """(projection, rows, n, k) of the step's GEMMs at each row count; lm_head only at `lm_head_rows`."""
    out = []
    for rows in rows_list:
        for name, (k, n, _times) in projection_shapes(cfg).items():
            if name != "lm_head" or rows in lm_head_rows:
                out.append((name, rows, n, k))
    return out


class Variant:
    """One way of computing one shape: a graph of `calls` back-to-back calls over the weight copies."""

    def __init__(self, shape: tuple[str, int, int, int], name: str, fn, calls: int, meta: dict) -> None:
        self.shape, self.name, self.fn, self.calls, self.meta = shape, name, fn, calls, meta
        self.graph: torch.cuda.CUDAGraph | None = None
        self.times_us: list[float] = []

    def capture(self, copies: int) -> None:
        for i in range(copies):
            self.fn(i)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for j in range(self.calls):
                self.fn(j % copies)
        self.graph.replay()


def build_variants(shape: tuple[str, int, int, int], dtype: torch.dtype, algos: int) -> tuple[list[Variant], dict]:
    _name, rows, n, k = shape
    copies = max(2, -(-(512 << 20) // (n * k * 2))) if rows <= 512 else 2
    est_us = max(2.0 * rows * n * k / 650e12, n * k * 2 / 3.5e12) * 1e6
    calls = max(copies, round(TARGET_REPLAY_US / est_us / copies) * copies)
    weights = [torch.randn(n, k, dtype=dtype, device="cuda") * 0.02 for _ in range(copies)]
    transposed = [w.t().contiguous() for w in weights]
    x = torch.randn(rows, k, dtype=dtype, device="cuda")
    out = torch.empty(rows, n, dtype=dtype, device="cuda")
    variants = [Variant(shape, "linear", lambda i: torch.mm(x, weights[i].t(), out=out), calls, {})]

    def with_lt_pref(i: int) -> None:
        previous = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            torch.mm(x, weights[i].t(), out=out)
        finally:
            torch.backends.cuda.preferred_blas_library(previous)

    variants.append(Variant(shape, "lt_pref", with_lt_pref, calls, {}))
    variants.append(Variant(shape, "kn", lambda i: torch.mm(x, transposed[i], out=out), calls, {}))
    errors = []
    try:
        for j, algo in enumerate(cublaslt.heuristic_algos(rows, n, k, dtype, algos)):
            variants.append(Variant(shape, f"lt{j}", lambda i, a=algo: cublaslt.lt_linear(x, weights[i], a, out=out),
                                    calls, {"algo": algo}))
    except cublaslt.CublasLtError as err:
        errors.append(f"heuristics: {err}")
    # Each variant's output on copy 0 against torch's, before anything is timed; one that fails is dropped.
    reference = torch.mm(x, weights[0].t())
    kept = []
    for v in variants:
        out.fill_(float("nan"))
        try:
            v.fn(0)
            torch.cuda.synchronize()
        except Exception as err:  # a variant's failure is a finding, the others still run
            errors.append(f"{v.name}: {err!r}"[:300])
            continue
        kept.append(v)
        diff = (out.float() - reference.float()).norm() / reference.float().norm()
        v.meta.update(rel_diff=float(diff), bit_equal=bool(torch.equal(out, reference)),
                      finite=bool(torch.isfinite(out).all()))
    for v in kept:
        v.capture(copies)
    if errors:
        logger.warning("%s: %s", shape, errors)
    return kept, {"copies": copies, "calls": calls, "errors": errors}


def run_round_robin(variants: list[Variant], heat_s: float, rounds: int, seed: int) -> dict:
    rng = random.Random(seed)
    order = list(variants)
    started, heated = time.monotonic(), 0
    while time.monotonic() - started < heat_s:
        rng.shuffle(order)
        for v in order:
            v.graph.replay()
        torch.cuda.synchronize()
        heated += 1
    logger.info("heated %.1f s (%d rounds of %d graphs); timing %d rounds", time.monotonic() - started, heated,
                len(order), rounds)
    timed_from = time.time()
    for _ in range(rounds):
        rng.shuffle(order)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(order) + 1)]
        events[0].record()
        for v, end in zip(order, events[1:], strict=True):
            v.graph.replay()
            end.record()
        events[-1].synchronize()
        for v, a, b in zip(order, events, events[1:], strict=False):
            v.times_us.append(a.elapsed_time(b) * 1e3 / v.calls)
    return {"heat_rounds": heated, "timed_from_unix": timed_from, "timed_to_unix": time.time()}


def tunableop_probe(dtype: torch.dtype, folder: Path) -> dict:
    """What TunableOp finds for one shape on this build (on CUDA it registers only "Default")."""
    from torch.cuda import tunable

    tunable.enable(True)
    tunable.tuning_enable(True)
    tunable.set_max_tuning_iterations(20)
    tunable.set_filename(str(folder / "tunableop_results.csv"))
    x = torch.randn(256, 4096, dtype=dtype, device="cuda")
    w = torch.randn(4096, 4096, dtype=dtype, device="cuda")
    torch.nn.functional.linear(x, w)
    torch.cuda.synchronize()
    results, validators = tunable.get_results(), tunable.get_validators()
    tunable.enable(False)
    return {"results": [str(r) for r in (results.items() if isinstance(results, dict) else results)],
            "validators": [str(v) for v in (validators.items() if isinstance(validators, dict) else validators)]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--rows", type=int, nargs="+", default=[2048, 256])
    parser.add_argument("--lm-head-rows", type=int, nargs="*", default=[256])
    parser.add_argument("--algos", type=int, default=8, help="cuBLASLt heuristic candidates per shape")
    parser.add_argument("--heat-s", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--win", type=float, default=0.98, help="table entries only for algorithms at most this "
                                                                 "fraction of linear's time")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--table-out", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    dtype = torch.bfloat16
    cfg = SHAPES[args.shape]
    started = time.monotonic()
    variants, built = [], {}
    for shape in shapes_of(cfg, args.rows, set(args.lm_head_rows)):
        vs, info = build_variants(shape, dtype, args.algos)
        variants += vs
        built[f"{shape[0]}@{shape[1]}"] = {**info, "variants": len(vs)}
        logger.info("%s: %d variants, %s", shape, len(vs), info)
    logger.info("built %d graphs in %.1f s", len(variants), time.monotonic() - started)
    timing = run_round_robin(variants, args.heat_s, args.rounds, seed=16)
    rows_out, table = [], []
    by_shape: dict[tuple, list[Variant]] = {}
    for v in variants:
        by_shape.setdefault(v.shape, []).append(v)
    for shape, vs in by_shape.items():
        name, rows, n, k = shape
        linear_us = statistics.median(vs[0].times_us)
        for v in vs:
            us = statistics.median(v.times_us)
            algo = v.meta.get("algo")
            rows_out.append({"proj": name, "rows": rows, "n": n, "k": k, "variant": v.name, "us": us,
                             "us_all": v.times_us, "spread": (max(v.times_us) - min(v.times_us)) / us,
                             "tflops": 2.0 * rows * n * k / us / 1e6, "over_linear": us / linear_us,
                             "rel_diff": v.meta["rel_diff"], "bit_equal": v.meta["bit_equal"],
                             "finite": v.meta["finite"], "config": algo.config if algo else None,
                             "workspace_bytes": algo.workspace_bytes if algo else None})
        lts = [v for v in vs if v.name.startswith("lt") and v.name != "lt_pref" and v.meta["finite"]
               and v.meta["rel_diff"] < 1e-2]
        if lts:
            best = min(lts, key=lambda v: statistics.median(v.times_us))
            ratio = statistics.median(best.times_us) / linear_us
            if ratio <= args.win:
                table.append(gemm_algos.entry(rows, n, k, best.meta["algo"], ratio))
    report = {"shape": args.shape, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cublaslt_version": cublaslt.version(), "built": built, "timing": timing, "rows": rows_out,
              "heat_s": args.heat_s, "rounds": args.rounds}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            report["tunableop"] = tunableop_probe(dtype, Path(tmp))
        except Exception as err:  # a probe: its failure is a finding, not the run's end
            report["tunableop"] = {"error": repr(err)[:300]}
    if args.table_out:
        gemm_algos.write_table(args.table_out, dtype, table)
        report["table"] = table
    if args.output:
        args.output.write_text(json.dumps(report, indent=1, default=str))
    timed_s = timing["timed_to_unix"] - timing["timed_from_unix"]
    print(f"{report['device']}, torch {report['torch']}, cuBLASLt {report['cublaslt_version']}; "
          f"{args.heat_s:.0f} s heat + {args.rounds} rounds ({timed_s:.1f} s)")
    print("proj     rows | variant | us      | TFLOP/s | / linear | spread | rel diff | config")
    for r in rows_out:
        cfgs = ",".join(f"{k}={v}" for k, v in (r["config"] or {}).items() if k in ("tile", "split_k", "stages",
                                                                                      "cluster_shape"))
        print(f"{r['proj']:<8} {r['rows']:4} | {r['variant']:<7} | {r['us']:7.1f} | {r['tflops']:7.0f} | "
              f"{r['over_linear']:8.3f} | {r['spread']:6.3f} | {r['rel_diff']:.1e} | {cfgs}")
    print("tunableop:", json.dumps(report["tunableop"])[:600])
    print("table entries:", len(table))


if __name__ == "__main__":
    main()
