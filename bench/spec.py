"""`splitserve bench --profile spec`: decode tokens/s with a drafter vs plain decoding, same engine, same run.

The target is a model shape with random weights in which every layer from the (draft_layers+1)th
on has zero `o_proj` and `down_proj`: those layers add exact zeros to the residual stream, so the
target's output equals that of its first `draft_layers` layers (in bf16 too) while it still costs
all of its layers. The exact drafter is those first layers with the same embeddings, norm and
head: every draft is accepted. A perturbed drafter (noise on its layers, its scale calibrated on
the device so that its greedy token agrees with the target's at --perturbed-acceptance of the
positions) is accepted that often.

The verifier engine runs in this process; each drafter is a `splitserve serve --role drafter`
process on the same device and the same draft-mesh port (the verifier rejoins when the next one
starts). For each drafter, K and batch size the report gives tokens/s, the ratio to plain decoding
at that batch size (measured first, before any drafter runs) and the acceptance rate.
Verify steps run as decode rows through their own CUDA graphs (engine/runner/decode_graphs.py), as
plain decode steps do; the verifier's speculation gate (draft_mesh/speculation_gate.py) is on
(--no-speculation-gate: off).

  splitserve bench --profile spec --shape llama-3.1-8b --device cuda        # the H200 setup
  splitserve bench --profile spec --shape spec-cpu --device cpu \\
      --batch-sizes 1 4 --ks 2 4 --output-len 48                            # a CPU run of the same
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from splitserve.bench.report_file import write_report
from splitserve.bench.workload import random_prompts
from splitserve.config_flags import add_config_flags, config_from_args
from splitserve.draft_mesh import SpecConfig
from splitserve.draft_mesh.speculation_gate import PLAIN, SPECULATE
from splitserve.engine.checkpoints.model_config import ModelConfig
from splitserve.engine.checkpoints.model_shapes import SHAPES
from splitserve.engine.checkpoints.tiny_model import TINY_CONFIG, byte_level_tokenizer
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.offline import generate_tokens
from splitserve.engine.request import Request
from splitserve.engine.role import ComposedRole
from splitserve.engine.roles.verifier import VerifierRole
from splitserve.engine.runner.model_runner import ModelRunner, build_forward_batch
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import ScheduledChunk
from splitserve.transfer import TransferConfig

logger = logging.getLogger(__name__)

# A CPU-sized target: deep and wide enough that its layers, not the loop, cost the time.
SPEC_CPU: dict[str, Any] = {**TINY_CONFIG, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 16,
                            "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64}
BENCH_SHAPES = {**SHAPES, "spec-cpu": SPEC_CPU}
KEY = "5bec" * 16


@dataclass
class SpecBenchConfig:
    """What `bench --profile spec` measures."""

    profile: str = field(default="spec", metadata={"help": "spec (this benchmark)"})
    shape: str = field(default="llama-3.1-8b", metadata={"help": f"target shape: {', '.join(BENCH_SHAPES)}"})
    device: str = field(default="cuda", metadata={"help": "cpu or cuda (the verifier and the drafters share it)"})
    draft_layers: int = field(default=4, metadata={"help": "layers of the drafter (the target's live layers)"})
    perturbed_acceptance: float = field(default=0.6, metadata={
        "help": "per-token agreement the perturbed drafter is calibrated to (0: no perturbed drafter)"})
    perturb: float = field(default=0.0, metadata={
        "help": "noise on the perturbed drafter's layers relative to each weight's std (0: calibrate it)"})
    drafters: list[str] = field(default_factory=lambda: ["exact", "perturbed"], metadata={
        "help": "which drafters to run: exact, perturbed or both (the exact one's checkpoint is written "
                "either way: the perturbed one is made from it)"})
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32], metadata={"help": "decode batch sizes"})
    ks: list[int] = field(default_factory=lambda: [2, 4, 8], metadata={"help": "draft tokens per step (K)"})
    prompt_len: int = field(default=128, metadata={"help": "prompt tokens per request"})
    output_len: int = field(default=128, metadata={"help": "output tokens per request"})
    draft_wait_ms: float = field(default=4.0, metadata={"help": "the verifier's --draft-wait-ms"})
    speculation_gate: bool = field(default=True, metadata={
        "help": "the verifier's --speculation-gate (--no-speculation-gate: every step verifies what the drafter "
                "offers, e.g. to measure verify steps and their identity where the gate would decode plainly)"})
    speculation_budget: bool = field(default=SpecConfig.speculation_budget, metadata={
        "help": "the verifier's speculation budget (the gate bounds speculating's loss by measurement; "
                "--no-speculation-budget: its rates alone decide)"})
    speculation_margin: float = field(default=SpecConfig.speculation_margin, metadata={
        "help": "the verifier's --speculation-margin (the gate's budget)"})
    speculation_budget_steps: float = field(default=SpecConfig.speculation_budget_steps, metadata={
        "help": "the verifier's --speculation-budget-steps"})
    row_invariant_rows: int | None = field(default=None, metadata={
        "help": "the verifier's and drafters' --row-invariant-rows (default: the engine's, 32)"})
    batch_invariant: bool = field(default=False, metadata={
        "help": "the verifier's --batch-invariant (row-invariant projections up to its largest verify step, "
                "one decode split count at every batch)"})
    cublas_plain: bool = field(default=True, metadata={
        "help": "also measure plain decoding with 16-bit rows past 16 on cuBLAS (as without a verifier)"})
    drafter_cudnn_attention: bool = field(default=True, metadata={
        "help": "the drafters' --drafter-cudnn-attention (--no-drafter-cudnn-attention: their one-prompt prefills "
                "without cuDNN's per-length plans)"})
    drafter_prefix_cache: bool = field(default=SpecConfig.drafter_prefix_cache, metadata={
        "help": "the drafters' --drafter-prefix-cache (--no-drafter-prefix-cache: every DraftSync prefilled whole)"})
    drafter_overlap: bool = field(default=True, metadata={
        "help": "the drafters' overlap scheduler (--no-drafter-overlap: each draft step read back before the next)"})
    max_total_tokens: int = field(default=65536, metadata={"help": "KV cache tokens of each engine"})
    seed: int = field(default=0, metadata={"help": "weights seed"})
    workdir: str | None = field(default=None, metadata={"help": "where checkpoints go (default: a temp dir)"})
    output: str | None = field(default=None, metadata={"help": "write the report as JSON here"})

    def __post_init__(self) -> None:
        unknown = sorted(set(self.drafters) - {"exact", "perturbed"})
        if unknown or not self.drafters:
            raise ValueError(f"--drafters takes exact and/or perturbed, got {' '.join(self.drafters) or 'none'}")


# ---- checkpoints ---------------------------------------------------------------------------


def _save(folder: Path, config: dict[str, Any], weights: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous().cpu() for k, v in weights.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    byte_level_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>",
                                                              "eos_token": "<|end_of_text|>"}))
    return folder


def spec_checkpoints(shape: dict[str, Any], folder: Path, draft_layers: int, seed: int, device: str) -> dict[str, Path]:
    """The target and the exact drafter, as checkpoint folders (kept from an earlier run into the same
    folder with the same shape, drafter layers and seed: writing the 8B target takes a while)."""
    made = {"target": folder / "target", "exact": folder / "drafter-exact"}
    stamp = json.dumps({"shape": shape, "draft_layers": draft_layers, "seed": seed}, sort_keys=True)
    if (folder / "made.json").is_file() and (folder / "made.json").read_text() == stamp:
        return made
    dtype = getattr(torch, shape.get("torch_dtype", "float32"))
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape.get("head_dim") or hidden // heads
    std = 0.02 if hidden >= 2048 else 0.08

    def rand(*size: int, scale: float = std) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)

    shared = {"model.embed_tokens.weight": rand(vocab, hidden, scale=0.25 if hidden < 2048 else std),
              "model.norm.weight": torch.ones(hidden, dtype=dtype, device=device),
              "lm_head.weight": rand(vocab, hidden, scale=0.25 if hidden < 2048 else std)}
    target = dict(shared)
    shapes = {"self_attn.q_proj.weight": (heads * head_dim, hidden), "self_attn.k_proj.weight": (kv_heads * head_dim,
              hidden), "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
              "self_attn.o_proj.weight": (hidden, heads * head_dim), "mlp.gate_proj.weight": (inter, hidden),
              "mlp.up_proj.weight": (inter, hidden), "mlp.down_proj.weight": (hidden, inter)}
    for i in range(shape["num_hidden_layers"]):
        for name, size in shapes.items():
            dead = i >= draft_layers and name in ("self_attn.o_proj.weight", "mlp.down_proj.weight")
            target[f"model.layers.{i}.{name}"] = torch.zeros(size, dtype=dtype, device=device) if dead else rand(*size)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            target[f"model.layers.{i}.{norm}.weight"] = torch.ones(hidden, dtype=dtype, device=device)
    draft_cfg = {**shape, "num_hidden_layers": draft_layers}
    drafter = {k: v for k, v in target.items()
               if not k.startswith("model.layers.") or int(k.split(".")[2]) < draft_layers}
    _save(made["target"], shape, target)
    _save(made["exact"], draft_cfg, drafter)
    (folder / "made.json").write_text(stamp)
    return made


def with_noise(weight: torch.Tensor, scale: float, gen: torch.Generator) -> torch.Tensor:
    """weight + Gaussian noise of `scale` times its own std."""
    w = weight.float()
    noise = torch.randn(w.shape, generator=gen, device=w.device)
    return (w + noise * scale * w.std()).to(weight.dtype)


def perturbed_drafter(exact: Path, folder: Path, scale: float, seed: int, device: str) -> Path:
    """The exact drafter with noise on every layer matrix."""
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    weights = {k: v.to(device) for k, v in load_file(str(exact / "model.safetensors")).items()}
    weights = {k: with_noise(v, scale, gen) if k.startswith("model.layers.") and v.dim() == 2 else v
               for k, v in weights.items()}
    return _save(folder, json.loads((exact / "config.json").read_text()), weights)


@torch.inference_mode()
def argmax_at_every_position(runner: ModelRunner, kv: KVCache, tokens: list[int]) -> torch.Tensor:
    """The model's greedy next token after each prefix of `tokens` (one prefill)."""
    req = Request("calibration", tokens, SamplingParams(), lambda _out: None)
    kv.admit(req, max_prefix_tokens=0)
    kv.grow(req, len(tokens))
    batch = build_forward_batch([ScheduledChunk(req, 0, len(tokens), True)], kv.page_table, kv.page_size,
                                runner.device)
    batch.logits_index = torch.arange(len(tokens), device=runner.device)
    out = runner.forward(batch).argmax(dim=-1)
    kv.release(req, cache_prefix=False)
    return out


@torch.inference_mode()
def calibrate_perturbation(exact: Path, device: str, rate: float, prompts: list[list[int]], new_tokens: int) -> float:
    """The noise scale at which the perturbed drafter's greedy token agrees with the exact one's
    (= the target's) at about `rate` of the positions of the exact drafter's own continuations."""
    cfg = EngineConfig(model=str(exact), device=device, max_total_tokens=8192, max_running_requests=1,
                       disable_cuda_graph=True)
    model_cfg = ModelConfig.from_folder(exact)
    runner = ModelRunner(cfg, exact, model_cfg)
    kv = KVCache(runner.kv_shape.num_pages, cfg.page_size, 1, runner.context_length, runner.device,
                 prefix_caching=False)
    sequences = []
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(new_tokens):
            seq.append(int(argmax_at_every_position(runner, kv, seq)[-1]))
        sequences.append((len(prompt), seq))
    reference = [argmax_at_every_position(runner, kv, seq)[n - 1:-1] for n, seq in sequences]
    params = {name: p for name, p in runner.model.named_parameters() if "layers." in name and p.dim() == 2}
    originals = {name: p.detach().clone() for name, p in params.items()}

    def agreement(scale: float) -> float:
        gen = torch.Generator(device=runner.device).manual_seed(1)
        for name, p in params.items():
            p.copy_(with_noise(originals[name], scale, gen))
        hits = [(argmax_at_every_position(runner, kv, seq)[n - 1:-1] == ref).float().mean().item()
                for (n, seq), ref in zip(sequences, reference, strict=True)]
        return sum(hits) / len(hits)

    low, high = 1e-3, 1.0  # agreement falls as the noise grows: bisect in log scale
    for _ in range(8):
        mid = (low * high) ** 0.5
        if agreement(mid) > rate:
            low = mid
        else:
            high = mid
    scale = (low * high) ** 0.5
    logger.info("perturbed drafter: noise %.4f x std gives %.2f agreement (asked %.2f)", scale, agreement(scale),
                rate)
    return scale  # the runner and its KV pool go with this frame


# ---- measuring ---------------------------------------------------------------------------------


def drafter_drafted(http_port: int | None) -> int | None:
    """Tokens the drafter process has drafted so far (its /health), None without one."""
    if http_port is None:
        return None
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=5) as resp:
        return int(json.loads(resp.read())["drafted"])


def gate_saved_s(verifier: VerifierRole) -> float:
    """Seconds the verifier's speculating saved against plain decoding's measured rate so far (all buckets)."""
    return sum(budget.saved_s for budget in verifier.gate.budgets.values())


def decode_run(engine: Engine, prompts: list[list[int]], output_len: int, verifier: VerifierRole | None = None,
               drafter_port: int | None = None) -> dict[str, Any]:
    """One greedy run of `prompts`: tokens/s, steps, drafts verified and accepted; with the verifier,
    its steps per gate mode, verify steps and seconds waited for drafts, and the drafter's drafted
    tokens (those not verified were drafted past a rejection or past the run's end)."""
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    m = engine.metrics
    drafted0, accepted0, steps0 = m.spec_draft_tokens._value.get(), m.spec_accepted_tokens._value.get(), engine.steps
    gate0 = (dict(verifier.mode_steps), verifier.verify_steps, verifier.waited_s, dict(verifier.gate.switches),
             gate_saved_s(verifier)) if verifier else None
    made0 = drafter_drafted(drafter_port)
    start = time.perf_counter()
    outs = generate_tokens(engine, prompts, params)
    elapsed = time.perf_counter() - start
    drafted, accepted = m.spec_draft_tokens._value.get() - drafted0, m.spec_accepted_tokens._value.get() - accepted0
    tokens = sum(len(o) for o in outs)
    run = {"tokens_per_s": tokens / elapsed, "seconds": elapsed, "steps": engine.steps - steps0,
           "drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else 0.0,
           "outputs": outs}
    if verifier is not None and gate0 is not None:
        run.update(speculating_steps=verifier.mode_steps[SPECULATE] - gate0[0][SPECULATE],
                   plain_steps=verifier.mode_steps[PLAIN] - gate0[0][PLAIN],
                   verify_steps=verifier.verify_steps - gate0[1], waited_s=verifier.waited_s - gate0[2],
                   gate_switches={k: n - gate0[3].get(k, 0) for k, n in verifier.gate.switches.items()
                                  if n > gate0[3].get(k, 0)},
                   gate_saved_s=gate_saved_s(verifier) - gate0[4])
    if made0 is not None:
        run["drafter_drafted"] = drafter_drafted(drafter_port) - made0
    return run


def on_loop_thread(engine: Engine, change: Callable[[], None], what: str) -> None:
    """Runs `change` on the engine's loop thread (graphs are captured again there) and waits for it."""
    done = threading.Event()

    def run() -> None:
        change()
        done.set()

    engine.call_soon(run)
    if not done.wait(300):
        raise TimeoutError(f"the engine did not change its {what}")


def set_invariance(engine: Engine, rows: int, batch_invariant: bool) -> None:
    """Changes the engine's row-invariant row count and batch-invariant decode attention together (the
    graphs they touch are captured again, once: ModelRunner.set_invariance)."""
    on_loop_thread(engine, lambda: engine.runner.set_invariance(rows, batch_invariant, engine.kv.page_table,
                                                                engine.kv.padding_slot),
                   "row-invariant rows and batch-invariant attention")


def start_drafter(folder: Path, device: str, mesh_port: int, http_port: int, cfg: SpecBenchConfig,
                  log: Path) -> subprocess.Popen:
    args = [sys.executable, "-P", "-m", "splitserve", "serve", "--role", "drafter", "--model", str(folder),
            "--device", device, "--port", str(http_port), "--draft-mesh-port", str(mesh_port),
            "--max-total-tokens", str(cfg.max_total_tokens), "--max-draft-ahead", str(2 * max(cfg.ks) + 1),
            "--max-running-requests", str(max(cfg.batch_sizes))]
    if cfg.row_invariant_rows is not None:
        args += ["--row-invariant-rows", str(cfg.row_invariant_rows)]
    if not cfg.drafter_overlap:
        args.append("--no-drafter-overlap")
    if not cfg.drafter_cudnn_attention:
        args.append("--no-drafter-cudnn-attention")
    if not cfg.drafter_prefix_cache:
        args.append("--no-drafter-prefix-cache")
    env = {**os.environ, "SPLITSERVE_TRANSFER_CONTROL_KEY": KEY, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def wait_joined(verifier: VerifierRole, proc: subprocess.Popen, timeout: float = 900.0) -> None:
    deadline = time.monotonic() + timeout
    while not verifier.drafters:
        if proc.poll() is not None:
            raise RuntimeError(f"the drafter exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError("the verifier did not join the drafter")
        verifier.engine.call_soon(lambda: None)  # the loop takes join events on its polls
        time.sleep(0.2)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_spec_benchmark(cfg: SpecBenchConfig) -> dict[str, Any]:
    shape = BENCH_SHAPES[cfg.shape]
    work = Path(cfg.workdir or tempfile.mkdtemp(prefix="splitserve-spec-bench-"))
    started = time.monotonic()
    weights_device = "cuda" if cfg.device.startswith("cuda") else "cpu"
    folders = spec_checkpoints(shape, work, cfg.draft_layers, cfg.seed, weights_device)
    prompts = {b: random_prompts(b, cfg.prompt_len, seed=b) for b in cfg.batch_sizes}
    if "perturbed" in cfg.drafters and (cfg.perturbed_acceptance > 0 or cfg.perturb > 0):
        scale = cfg.perturb or calibrate_perturbation(folders["exact"], cfg.device, cfg.perturbed_acceptance,
                                                      random_prompts(4, cfg.prompt_len, seed=99), 48)
        folders["perturbed"] = perturbed_drafter(folders["exact"], work / "drafter-perturbed", scale, cfg.seed,
                                                 weights_device)
    if weights_device == "cuda":
        torch.cuda.empty_cache()  # the calibration runner's memory
    logger.info("checkpoints written to %s in %.0f s", work, time.monotonic() - started)
    mesh_port = free_port()
    spec = SpecConfig(drafter=[f"127.0.0.1:{mesh_port}"], num_draft_tokens=max(cfg.ks),
                      draft_wait_ms=cfg.draft_wait_ms, row_invariant_rows=cfg.row_invariant_rows,
                      speculation_gate=cfg.speculation_gate, speculation_budget=cfg.speculation_budget,
                      speculation_margin=cfg.speculation_margin, speculation_budget_steps=cfg.speculation_budget_steps,
                      batch_invariant=cfg.batch_invariant)
    verifier = VerifierRole(spec, TransferConfig(transfer_control_key=KEY))
    engine = Engine(EngineConfig(model=str(folders["target"]), device=cfg.device, max_total_tokens=cfg.max_total_tokens,
                                 max_running_requests=max(cfg.batch_sizes)), role=ComposedRole("unified", [verifier]))
    engine.start()
    report: dict[str, Any] = {"config": asdict(cfg), "plain": {}, "runs": []}
    try:
        def warm_up() -> None:
            # Each batch once: its prompts go into the prefix cache, as for every later run (the first
            # run of a batch otherwise pays the only full prefill, and its kernels' first launches).
            for b in cfg.batch_sizes:
                generate_tokens(engine, prompts[b], SamplingParams(max_new_tokens=4))

        warm_up()
        plain_outputs = {}
        if cfg.cublas_plain:  # plain decoding as without a verifier: 16-bit rows past 16 on cuBLAS
            report["plain_cublas"] = {}
            rows = engine.runner.row_invariant_rows
            set_invariance(engine, 16, False)  # and plain decoding's attention splits
            warm_up()
            for b in cfg.batch_sizes:
                r = decode_run(engine, prompts[b], cfg.output_len)
                r.pop("outputs")
                report["plain_cublas"][b] = r
                logger.info("plain batch %d, cuBLAS past 16 rows: %.1f tok/s", b, r["tokens_per_s"])
            set_invariance(engine, rows, cfg.batch_invariant)
            warm_up()
        for b in cfg.batch_sizes:
            r = decode_run(engine, prompts[b], cfg.output_len)
            plain_outputs[b] = r.pop("outputs")
            report["plain"][b] = r
            logger.info("plain batch %d: %.1f tok/s%s", b, r["tokens_per_s"],
                        f" ({r['tokens_per_s'] / report['plain_cublas'][b]['tokens_per_s']:.3f}x of cuBLAS past 16 "
                        "rows)" if cfg.cublas_plain else "")
        drafters = [(name, folders[name]) for name in ("exact", "perturbed")
                    if name in cfg.drafters and name in folders]
        for name, folder in drafters:
            http_port = free_port()
            proc = start_drafter(folder, cfg.device, mesh_port, http_port, cfg, work / f"drafter-{name}.log")
            try:
                wait_joined(verifier, proc)
                # Each batch once with the drafter, K = max, every step speculating: the drafter process's
                # first prefills and catch-ups at these shapes, and the verifier's first verify steps, cost
                # far more than later ones (on the H200 a drafter's first prefill of a 129-token request
                # took ~100 ms); then the gate forgets what speculating measured meanwhile.
                # Every K: on the H200 the drafter's first steps of the first K=2 run after a K=8 pass still
                # took ~100 ms each (host side: something compiled), 220 ms of a 390 ms run without drafts.
                gated, verifier.spec = verifier.spec, dataclasses.replace(verifier.spec, speculation_gate=False)
                for k in cfg.ks:
                    verifier.num_draft_tokens = k
                    for b in cfg.batch_sizes:
                        generate_tokens(engine, prompts[b], SamplingParams(max_new_tokens=16, ignore_eos=True))
                verifier.spec = gated
                verifier.gate.forget_speculation()
                for k in cfg.ks:
                    for b in cfg.batch_sizes:
                        # The peer under the same load: K=0 (no drafts offered, the drafter paced to
                        # nothing) right before the run. On a shared machine this is the fairer one;
                        # `plain` (before any drafter, overlap scheduler on) is the stricter one.
                        verifier.num_draft_tokens = 0
                        peer = decode_run(engine, prompts[b], cfg.output_len)
                        verifier.num_draft_tokens = k
                        r = decode_run(engine, prompts[b], cfg.output_len, verifier, http_port)
                        same = r.pop("outputs") == plain_outputs[b] == peer.pop("outputs")
                        r.update(drafter=name, k=k, batch=b, identical_to_plain=same,
                                 speedup=r["tokens_per_s"] / report["plain"][b]["tokens_per_s"],
                                 peer_tokens_per_s=peer["tokens_per_s"],
                                 speedup_vs_peer=r["tokens_per_s"] / peer["tokens_per_s"])
                        report["runs"].append(r)
                        logger.info("%s K=%d batch %d: %.1f tok/s (x%.2f of plain, x%.2f of the K=0 peer), "
                                    "acceptance %.2f, %d steps: %d speculating (%d verified), %d plain, "
                                    "%.1f ms waiting for drafts; drafter drafted %s, verified %d; gate: saved %.1f ms, "
                                    "switches %s%s",
                                    name, k, b, r["tokens_per_s"], r["speedup"], r["speedup_vs_peer"],
                                    r["acceptance"], r["steps"], r["speculating_steps"], r["verify_steps"],
                                    r["plain_steps"], 1e3 * r["waited_s"], r.get("drafter_drafted"), r["drafted"],
                                    1e3 * r["gate_saved_s"], r["gate_switches"] or "none",
                                    "" if same else " OUTPUT DIFFERS")
            finally:
                proc.terminate()
                proc.wait(timeout=60)
                deadline = time.monotonic() + 10
                while verifier.drafters and time.monotonic() < deadline:  # the lease is dropped
                    engine.call_soon(lambda: None)
                    time.sleep(0.1)
    finally:
        engine.stop()
        if cfg.workdir is None:
            shutil.rmtree(work, ignore_errors=True)  # checkpoints of the size of the shape
    return report


def print_spec_report(report: dict[str, Any]) -> None:
    cfg = report["config"]
    print(f"\nspeculative decoding, target {cfg['shape']} ({cfg['draft_layers']} live layers), device {cfg['device']}, "
          f"prompt {cfg['prompt_len']}, output {cfg['output_len']}, draft wait {cfg['draft_wait_ms']} ms")
    print(f"{'drafter':<10} {'K':>2} {'batch':>5} {'tok/s':>9} {'plain':>9} {'speedup':>8} {'K=0 peer':>9} "
          f"{'vs peer':>8} {'accept':>7} {'tok/step':>8} {'same':>5}")
    for r in report["runs"]:
        plain = report["plain"][r["batch"]]
        per_step = r["batch"] * cfg["output_len"] / max(r["steps"], 1)
        same = "yes" if r["identical_to_plain"] else "NO"
        print(f"{r['drafter']:<10} {r['k']:>2} {r['batch']:>5} {r['tokens_per_s']:>9.1f} "
              f"{plain['tokens_per_s']:>9.1f} {r['speedup']:>7.2f}x {r['peer_tokens_per_s']:>9.1f} "
              f"{r['speedup_vs_peer']:>7.2f}x {r['acceptance']:>7.2f} {per_step:>8.2f} {same:>5}")
    differ = sum(not r["identical_to_plain"] for r in report["runs"])
    if differ:  # the exit status says so too
        print(f"{differ} of {len(report['runs'])} runs' greedy output differs from plain decoding's"
              + ("" if cfg["batch_invariant"] or cfg["device"] == "cpu" else
                 ": without --batch-invariant a 16-bit verify step rounds as a step of its own row count does, "
                 "not as plain decoding's steps"))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="splitserve bench --profile spec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser, SpecBenchConfig, "SPLITSERVE_BENCH")
    cfg = config_from_args(SpecBenchConfig, parser.parse_args(argv), "SPLITSERVE_BENCH")
    report = run_spec_benchmark(cfg)
    print_spec_report(report)
    write_report(report, cfg.output)
    return 0 if all(r["identical_to_plain"] for r in report["runs"]) else 1

