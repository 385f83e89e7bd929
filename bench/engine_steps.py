"""The engine benchmark on a real model shape with random weights, against the device's limits
and against Hugging Face transformers measured in the same run.

Prints and writes (JSON, and a PNG plot when matplotlib is there):
- the measured limits: device copy bandwidth and dense matmul throughput;
- prefill tokens/s at several prompt lengths and the MFU against the measured matmul peak;
- decode step time at several batch sizes against that step's memory roofline
  ((weights + KV read) / measured bandwidth), and beside it the roofline that counts compute
  (bench/step_roofline.py: per operation, the longer of its bytes and its FLOPs at the measured peak);
- transformers on the same shape: prefill time and `generate` tokens/s, and ours beside it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from splitserve.bench.step_roofline import decode_step_rooflines
from splitserve.engine.checkpoints.model_config import ModelConfig
from splitserve.engine.checkpoints.model_shapes import SHAPES, prompt_matmul_flops, write_shape_folder
from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.request import Request
from splitserve.engine.runner.forward_batch import ForwardBatch
from splitserve.engine.runner.model_runner import ModelRunner, build_forward_batch
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import ScheduledChunk

logger = logging.getLogger(__name__)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profiled_device_events(fn, calls: int) -> list[dict[str, Any]]:
    """Every kernel, copy and memset (`name`, `ts` and `dur` in us) of `calls` calls of `fn`, by torch.profiler
    (CUPTI sees the kernels inside CUDA graphs too), in the order they ran."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    path = Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return sorted(events, key=lambda e: e["ts"])


def sm_clock_mhz() -> int | None:
    """The GPU's SM clock now (NVML), or None where it cannot be read."""
    try:
        return int(torch.cuda.clock_rate())
    except Exception:  # no NVML: the figure is left out
        return None


def timed(fn, device: torch.device, reps: int, warmup: int = 2) -> float:
    """Median seconds of `fn()` over `reps` runs after `warmup`."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def device_limits(device: torch.device, dtype: torch.dtype, hold_s: float = 0.0) -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second) and dense matmul FLOP/s, measured here: the median of a few
    calls, or with `hold_s` the rate held over that many seconds of back-to-back calls each (sustained_rate)."""
    def rate(fn) -> float:
        return sustained_rate(fn, device, hold_s) if hold_s > 0 else 1.0 / timed(fn, device, reps=10)

    nbytes = (2 << 30) if device.type == "cuda" else (256 << 20)
    buffers = [torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device) for _ in range(2)]
    copies = rate(lambda: buffers[1].copy_(buffers[0]))
    buffers.clear()
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    matmuls = rate(lambda: a @ b)
    limits = {"copy_bandwidth_Bps": 2 * nbytes * copies, "matmul_flops": 2 * n**3 * matmuls}
    return {**limits, "seconds": hold_s} if hold_s > 0 else limits


def sustained_rate(fn, device: torch.device, seconds: float) -> float:
    """Calls of `fn` per second over the second half of `seconds` of back-to-back calls: long enough for a
    power-capped GPU to reach the clocks it holds under load (an H200 at its 700 W cap drops from 1,980 MHz
    to 1,400-1,800 within a second of heavy GEMMs), where a short burst measures the uncapped clocks. One call
    in flight at a time (a synchronize after each): each is timed whole, as the loop runs it."""
    def call() -> float:
        fn()
        sync(device)
        return time.perf_counter()

    start = call()  # the first call (compiles, picks kernels) is not timed
    timed_from = now = call()
    while now - start < seconds / 2:
        timed_from = now = call()
    calls = 0
    while calls == 0 or now - start < seconds:
        now = call()
        calls += 1
    return calls / (now - timed_from)


class EngineUnderTest:
    """A model runner and KV cache of one shape with random weights, driven directly."""

    def __init__(self, shape: str, device: str, max_batch: int, max_tokens: int, gemm_algos: str = "",
                 warm_up: bool = False, quantization: str = "auto", kv_cache_dtype: str = "auto",
                 fp8_decode_rows: str = "w8a8") -> None:
        self.folder = write_shape_folder(shape, Path(tempfile.mkdtemp(prefix=f"splitserve-{shape}-")))
        self.cfg = EngineConfig(model=str(self.folder), device=device, load_format="dummy",
                                max_running_requests=max_batch, max_total_tokens=max_tokens,
                                context_length=16384, page_size=16, cuda_graph_max_batch=max_batch,
                                gemm_algos=gemm_algos, piecewise_graph_tokens=0,  # its forward: the eager peer
                                quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                                fp8_decode_rows=fp8_decode_rows)
        self.model_cfg = ModelConfig.from_folder(self.folder)
        self.runner = ModelRunner(self.cfg, self.folder, self.model_cfg)
        self.device = self.runner.device
        self.kv = KVCache(self.runner.kv_shape.num_pages, self.cfg.page_size, max_batch, 16384, self.device)
        self.runner.capture_decode_graphs(self.kv.page_table, self.kv.padding_slot)
        if warm_up:  # as an engine starts: the cuDNN prompt buckets and the lone-prompt graphs (GPU), seconds
            self.runner.warm_up(self.kv.page_table)
        self.uniform_ids = False  # benchmarks/peer_inputs.py: prompts of one id repeated, as the peer had before

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.runner.model.parameters())

    @property
    def kv_bytes_per_token(self) -> int:
        s = self.runner.kv_shape
        return s.page_bytes * 2 * s.num_layers // s.page_size

    def _requests(self, n: int, length: int, extra: int) -> list[Request]:
        """`n` admitted requests of `length` random token ids, as the engine loads send (a prompt of one id
        repeated makes every row of every activation the same: GEMMs over such rows switch fewer bits and draw
        less power, and on a power-capped GPU power sets the clock, so a peer must compute rows like the loop's)."""
        from splitserve.bench.workload import random_prompts

        reqs = []
        prompts = random_prompts(n, length, seed=n * 31 + length) if not self.uniform_ids else [[1] * length] * n
        for i, ids in enumerate(prompts):
            req = Request(f"bench-{i}", ids, SamplingParams(max_new_tokens=extra, temperature=0.0),
                          on_output=lambda _o: None)
            self.kv.admit(req, max_prefix_tokens=0)
            if not self.kv.grow(req, length + extra):
                raise MemoryError(f"KV cache too small for {n} x {length + extra} tokens")
            reqs.append(req)
        return reqs

    def _release(self, reqs: list[Request]) -> None:
        for r in reqs:
            self.kv.release(r, cache_prefix=False)

    @torch.inference_mode()
    @contextlib.contextmanager
    def prefill_step(self, tokens: int, prompts: int = 1) -> Iterator[tuple[list[Request], ForwardBatch]]:
        """`prompts` fresh prompts of `tokens` each, admitted, and their prefill packed in one batch as the runner
        builds it (a lone prompt attends at the cuDNN buckets once the runner's warm-up has built them, packed
        prompts through the paged extend kernel); released after."""
        reqs = self._requests(prompts, tokens, 1)
        try:
            yield reqs, self._batch([ScheduledChunk(r, 0, tokens, True) for r in reqs])
        finally:
            self._release(reqs)

    def _batch(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        """The extend batch the runner's `launch` builds for these chunks: on CUDA over the paged kernels (packed
        prompts through the paged extend kernel, as the engine loop runs them), else the reference path."""
        return build_forward_batch(chunks, self.kv.page_table, self.cfg.page_size, self.device,
                                   tokens_per_block=self.runner.extend_block_tokens,
                                   cudnn_chunk=self.runner.cudnn_chunk, prompt_buckets=self.runner.prompt_buckets)

    def prefill_path(self, tokens: int, prompts: int = 1) -> str:
        """How an engine runs prefill_step(tokens, prompts): a lone prompt that a lone-prompt graph holds replays
        it (GPU, once warmed up), anything else runs eagerly."""
        graphs = self.runner.prompt_graphs
        return "lone-prompt graph" if prompts == 1 and graphs is not None and graphs.can_run(tokens) else "eager"

    def prefill_seconds(self, tokens: int, reps: int = 5, prompts: int = 1) -> float:
        """Median seconds of one forward of prefill_step(tokens, prompts), on prefill_path's path."""
        with self.prefill_step(tokens, prompts) as (reqs, batch):
            if self.prefill_path(tokens, prompts) == "eager":
                return timed(lambda: self.runner.forward(batch), self.device, reps)
            graphs, (req,) = self.runner.prompt_graphs, reqs
            assert graphs is not None

            @torch.inference_mode()  # as the runner replays it (its input buffers are inference tensors)
            def replay() -> None:
                graphs.run(req.all_ids[:tokens], req.slot)
            return timed(replay, self.device, reps)

    def sustained_prefill_seconds(self, tokens: int, prompts: int, seconds: float) -> float:
        """Seconds per eager forward of prefill_step(tokens, prompts) held back to back for `seconds`
        (sustained_rate: the rate a power-capped GPU keeps, as in a loop's seconds of prefill)."""
        with self.prefill_step(tokens, prompts) as (_, batch):
            return 1.0 / sustained_rate(lambda: self.runner.forward(batch), self.device, seconds)

    @torch.inference_mode()
    @contextlib.contextmanager
    def mixed_step(self, prompts: int, tokens: int, decodes: int, context: int
                   ) -> Iterator[tuple[list[Request], ForwardBatch]]:
        """A mixed step as a server under load runs it: `decodes` decode rows at `context` tokens each (first, as
        the scheduler orders them), then `prompts` fresh prompts of `tokens` each, in one extend batch over the
        paged kernels; everything admitted, released after."""
        rows = self._requests(decodes, context + 1, 1)
        fresh = self._requests(prompts, tokens, 1)
        try:
            chunks = ([ScheduledChunk(r, context, 1, True) for r in rows]
                      + [ScheduledChunk(r, 0, tokens, True) for r in fresh])
            yield rows + fresh, self._batch(chunks)
        finally:
            self._release(rows + fresh)

    @torch.inference_mode()
    def decode_step_seconds(self, batch: int, context: int, steps: int = 20, blocks: int = 5) -> float:
        """Seconds per decode step at `batch` sequences of `context` tokens, host work included: the median over
        `blocks` runs of `steps` steps, each run from `context` again (its KV past it written over), so one slow
        stretch (a clock still ramping, a host hiccup) does not set the figure and every run reads the same KV."""
        reqs = self._requests(batch, context, steps + 4)

        def rewind() -> None:
            for r in reqs:
                r.kv_len = context
                r.output_ids = [1]

        def step() -> None:
            chunks = [ScheduledChunk(r, r.kv_len, 1, True) for r in reqs]
            out = self.runner.run(chunks, self.kv.page_table)  # samples: one host sync per step, as serving
            for r, tok in zip(reqs, out.tokens, strict=True):
                r.output_ids.append(tok)
                r.kv_len += 1

        try:
            rewind()
            for _ in range(2):
                step()
            runs = []
            for _ in range(blocks):
                rewind()
                sync(self.device)
                start = time.perf_counter()
                for _ in range(steps):
                    step()
                sync(self.device)
                runs.append((time.perf_counter() - start) / steps)
        finally:
            self._release(reqs)
        return statistics.median(runs)


def loop_bench_config(folder: Path, device: str, max_batch: int, tokens_per_request: int) -> EngineConfig:
    """An engine over random weights sized for `max_batch` requests of `tokens_per_request` tokens:
    whole prompts in one step, graphs up to the batch, no prefix cache (every prompt is computed)."""
    return EngineConfig(model=str(folder), device=device, load_format="dummy", page_size=16,
                        max_running_requests=max_batch, cuda_graph_max_batch=max_batch,
                        max_total_tokens=max_batch * (tokens_per_request + 32), context_length=16384,
                        chunked_prefill_size=16384, disable_prefix_cache=True)


def engine_loop_decode(folder: Path, device: str, batches: list[int], context: int, bandwidth: float,
                       weight_bytes: int, kv_bytes_per_token: int, output_len: int = 64,
                       shape_cfg: dict[str, Any] | None = None, peak_flops: float = 0.0) -> list[dict[str, Any]]:
    """Decode step time through the Engine itself: the figure a served request sees (with `shape_cfg`
    and `peak_flops`, also against the roofline that counts compute)."""
    from splitserve.bench.workload import random_prompts, run_engine_batch
    from splitserve.engine.engine import Engine

    engine = Engine(loop_bench_config(folder, device, max(batches), context + output_len))
    engine.start()
    rows = []
    try:
        run_engine_batch(engine, random_prompts(2, 32, 1, vocab=250), 8)  # warm-up
        for b in batches:
            r = run_engine_batch(engine, random_prompts(b, context, 7 + b, vocab=250), output_len)
            roofline = (weight_bytes + b * (context + output_len / 2) * kv_bytes_per_token) / bandwidth
            rows.append({"batch": b, "context": context, "step_s": r["decode_step_s"], "roofline_s": roofline,
                         "step_over_roofline": r["decode_step_s"] / roofline, "overlap": engine.overlap})
            if shape_cfg is not None and peak_flops > 0:
                compute = decode_step_rooflines(shape_cfg, b, context + output_len / 2, weight_bytes, bandwidth,
                                                peak_flops, engine.runner.dtype.itemsize)["compute_s"]
                rows[-1].update(compute_roofline_s=compute, step_over_compute_roofline=r["decode_step_s"] / compute)
            logger.info("engine loop decode batch %d: %.2f ms/step, %.2fx the roofline (overlap %s)", b,
                        r["decode_step_s"] * 1e3, r["decode_step_s"] / roofline, engine.overlap)
    finally:
        engine.stop()
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def attention_flops(cfg: dict[str, Any], tokens: int) -> float:
    """Causal attention FLOPs of one prompt: QK^T and PV over the lower triangle."""
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * 2 * heads * head_dim * (tokens * (tokens + 1) / 2) * cfg["num_hidden_layers"]


@torch.inference_mode()
def hf_peer(shape: str, device: torch.device, dtype: torch.dtype, prefill_lens: list[int], gen_batches: list[int],
            prompt_len: int, new_tokens: int) -> dict[str, Any]:
    """transformers on the same shape with random weights: prefill seconds and generate tokens/s."""
    import transformers

    config = transformers.AutoConfig.for_model(**{k: v for k, v in SHAPES[shape].items() if k != "architectures"})
    with torch.device(device):
        models = [transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()]
    model = models[0]
    vocab = min(1000, config.vocab_size)
    out: dict[str, Any] = {"transformers_version": transformers.__version__, "prefill_s": {}, "generate": {}}
    for n in prefill_lens:
        ids = torch.randint(0, vocab, (1, n), device=device)
        out["prefill_s"][n] = timed(lambda ids=ids: model(ids, logits_to_keep=1), device, reps=3, warmup=1)
    gen_cfg = transformers.GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                            eos_token_id=None, pad_token_id=0)
    for b in gen_batches:
        ids = torch.randint(1, vocab, (b, prompt_len), device=device)
        mask = torch.ones_like(ids)
        model.generate(ids, attention_mask=mask, generation_config=gen_cfg.__class__(
            **{**gen_cfg.to_dict(), "max_new_tokens": 2, "min_new_tokens": 2}))
        sync(device)
        t = time.perf_counter()
        model.generate(ids, attention_mask=mask, generation_config=gen_cfg)
        sync(device)
        seconds = time.perf_counter() - t
        out["generate"][b] = {"seconds": seconds, "tokens_per_s": b * new_tokens / seconds}
        logger.info("transformers generate batch %d: %.1f tokens/s", b, b * new_tokens / seconds)
    models.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def run_engine_benchmark(shape: str, device: str, prefill_lens: list[int], decode_batches: list[int],
                         decode_context: int, hf: bool, gen_batches: list[int], gen_prompt: int,
                         gen_new: int) -> dict[str, Any]:
    cfg = SHAPES[shape]
    max_batch = max(decode_batches)
    kv_tokens = max(max_batch * (decode_context + 64), max(prefill_lens) + 64,
                    max(gen_batches) * (gen_prompt + gen_new + 64))
    eut = EngineUnderTest(shape, device, max_batch, kv_tokens, warm_up=True)  # lone prompts as an engine runs them
    dev, dtype = eut.device, eut.runner.dtype
    limits = device_limits(dev, dtype)
    bw, peak = limits["copy_bandwidth_Bps"], limits["matmul_flops"]
    logger.info("limits: copy %.0f GB/s, matmul %.0f TFLOP/s", bw / 1e9, peak / 1e12)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    report: dict[str, Any] = {"shape": shape, "device": name,
                              "dtype": str(dtype), "limits": limits, "weight_bytes": eut.weight_bytes,
                              "kv_bytes_per_token": eut.kv_bytes_per_token, "prefill": [], "decode": []}
    for n in prefill_lens:
        seconds = eut.prefill_seconds(n)
        flops = prompt_matmul_flops(cfg, n) + attention_flops(cfg, n)
        row = {"tokens": n, "path": eut.prefill_path(n), "seconds": seconds, "tokens_per_s": n / seconds,
               "tflops": flops / seconds / 1e12, "mfu_vs_measured_matmul": flops / seconds / peak}
        report["prefill"].append(row)
        logger.info("prefill %d tokens: %.0f tok/s, %.2f of the matmul peak", n, row["tokens_per_s"],
                    row["mfu_vs_measured_matmul"])
    for b in decode_batches:
        seconds = eut.decode_step_seconds(b, decode_context)
        roofline = (eut.weight_bytes + b * (decode_context + 10) * eut.kv_bytes_per_token) / bw
        compute = decode_step_rooflines(cfg, b, decode_context + 10, eut.weight_bytes, bw, peak, dtype.itemsize)
        row = {"batch": b, "context": decode_context, "step_s": seconds, "roofline_s": roofline,
               "step_over_roofline": seconds / roofline, "tokens_per_s": b / seconds,
               "compute_roofline_s": compute["compute_s"], "step_over_compute_roofline": seconds / compute["compute_s"],
               "compute_roofline_ops": compute["ops"]}
        report["decode"].append(row)
        logger.info("decode batch %d: %.2f ms/step, %.2fx the roofline", b, seconds * 1e3, seconds / roofline)
    # Ours at HF's generate batches and lengths (decode steps at the mid-generation context).
    report["ours_generate_equivalent"] = {
        b: {"step_s": (s := eut.decode_step_seconds(b, gen_prompt + gen_new // 2)), "tokens_per_s": b / s}
        for b in gen_batches}
    folder = eut.folder
    del eut
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    # The whole engine loop (scheduler, sampling, outputs; the overlap scheduler on GPUs), steady state.
    report["engine_decode"] = engine_loop_decode(folder, device, decode_batches, decode_context, bw,
                                                 report["weight_bytes"], report["kv_bytes_per_token"],
                                                 shape_cfg=cfg, peak_flops=peak)
    if hf:
        peer = hf_peer(shape, dev, dtype, prefill_lens, gen_batches, gen_prompt, gen_new)
        report["transformers"] = peer
        for row in report["prefill"]:
            row["speedup_vs_transformers"] = peer["prefill_s"][row["tokens"]] / row["seconds"]
        for b, ours in report["ours_generate_equivalent"].items():
            ours["decode_speedup_vs_transformers_generate"] = (ours["tokens_per_s"]
                                                               / peer["generate"][b]["tokens_per_s"])
    return report


def print_engine_report(report: dict[str, Any]) -> None:
    lim = report["limits"]
    lines = [f"{report['shape']} on {report['device']} ({report['dtype']}): copy {lim['copy_bandwidth_Bps'] / 1e9:.0f} "
             f"GB/s, matmul {lim['matmul_flops'] / 1e12:.0f} TFLOP/s (measured)",
             "prefill tokens | tok/s      | TFLOP/s | of matmul peak | vs transformers | path"]
    for r in report["prefill"]:
        lines.append(f"{r['tokens']:>14} | {r['tokens_per_s']:10.0f} | {r['tflops']:7.1f} | "
                     f"{r['mfu_vs_measured_matmul']:14.2f} | {r.get('speedup_vs_transformers', float('nan')):14.2f}x | "
                     f"{r.get('path', 'eager')}")
    nan = float("nan")
    lines.append("decode batch | ctx  | step ms | HBM roofline ms | step/HBM | compute-counting roofline ms | "
                 "step/compute-counting | tok/s")
    for r in report["decode"]:
        lines.append(f"{r['batch']:>12} | {r['context']:4d} | {r['step_s'] * 1e3:7.2f} | "
                     f"{r['roofline_s'] * 1e3:15.2f} | {r['step_over_roofline']:8.2f} | "
                     f"{r.get('compute_roofline_s', nan) * 1e3:28.2f} | "
                     f"{r.get('step_over_compute_roofline', nan):21.2f} | {r['tokens_per_s']:.0f}")
    lines.append("engine loop (scheduler, sampling, overlap) decode batch | step ms | step/HBM | step/compute-counting")
    for r in report.get("engine_decode", []):
        lines.append(f"{r['batch']:>54} | {r['step_s'] * 1e3:7.2f} | {r['step_over_roofline']:8.2f} | "
                     f"{r.get('step_over_compute_roofline', nan):.2f}")
    for b, r in report["ours_generate_equivalent"].items():
        extra = r.get("decode_speedup_vs_transformers_generate")
        lines.append(f"batch {b}: ours {r['tokens_per_s']:.0f} tok/s" +
                     (f", {extra:.1f}x transformers generate" if extra is not None else ""))
    for line in lines:
        print(line)  # the report is the command's output


def plot_engine_report(report: dict[str, Any], path: Path) -> bool:
    """Step time vs batch: ours, the roofline, transformers. False if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib not installed: no plot (the JSON has the figures)")
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    dec = report["decode"]
    ax.plot([r["batch"] for r in dec], [r["step_s"] * 1e3 for r in dec], "o-", label="splitserve runner step")
    loop = report.get("engine_decode", [])
    if loop:
        ax.plot([r["batch"] for r in loop], [r["step_s"] * 1e3 for r in loop], "^-",
                label="splitserve engine loop step (overlap)")
    ax.plot([r["batch"] for r in dec], [r["roofline_s"] * 1e3 for r in dec], "k--", label="HBM roofline")
    if "transformers" in report:
        gen = report["transformers"]["generate"]
        bs = sorted(int(b) for b in gen)
        ax.plot(bs, [int(b) / gen[b if b in gen else str(b)]["tokens_per_s"] * 1e3 for b in bs], "s-",
                label="transformers generate (per step)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"{report['shape']} on {report['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True
