"""`splitserve bench --profile qwen-vl`: Qwen2.5-VL (7B-shaped, random weights by default) with image-heavy chat.

1. The vision tower: time per image at a few sides (448 to 1,344 px) against its FLOP bound (every matmul
   and attention FLOP of the tower and merger, over the device's peak), in process.
2. Embedding transfer: one 1,344 px image's rows (tokens x text hidden, bfloat16) from an embedding sender to a
   receiver on loopback (bench/epd.py's path), against a copy of the same bytes on the device.
3. Time to first token (p50/p99) and throughput of chat requests with 1-4 images of 448-1,344 px per side,
   streamed, at several request rates (Poisson arrivals): `up --unified 1` against `up --encode 1 --prefill 1
   --decode 1`, every engine on the same device(s). Prefix caching is off in both, so images are always
   encoded.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import importlib.util
import io
import itertools
import logging
import random
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from splitserve.bench.report_file import write_report
from splitserve.bench.stats import percentiles
from splitserve.config_flags import add_config_flags, config_from_args

SHAPED = "qwen2.5-vl-7b-shape"

logger = logging.getLogger(__name__)


@dataclass
class QwenVLBenchConfig:
    """What the Qwen-VL benchmark runs."""

    model: str = field(default=SHAPED, metadata={
        "help": f"'{SHAPED}' (random weights of Qwen2.5-VL-7B's shape), tiny-qwen2.5-vl, or a checkpoint folder"})
    device: str = field(default="cuda", metadata={"help": "engine device"})
    rates: list[float] = field(default_factory=lambda: [0.5, 1.0, 2.0],
                               metadata={"help": "request rates (requests/s) to load at"})
    num_requests: int = field(default=24, metadata={"help": "requests per rate"})
    max_tokens: int = field(default=32, metadata={"help": "output tokens per request"})
    min_images: int = field(default=1, metadata={"help": "fewest images in a request"})
    max_images: int = field(default=4, metadata={"help": "most images in a request"})
    min_side: int = field(default=448, metadata={"help": "shortest image side (pixels)"})
    max_side: int = field(default=1344, metadata={"help": "longest image side (pixels)"})
    tower_sides: list[int] = field(default_factory=lambda: [448, 896, 1344],
                                   metadata={"help": "square image sides the tower part times"})
    tower_iters: int = field(default=5, metadata={"help": "timed tower passes per side"})
    peak_tflops: float = field(default=989.0, metadata={"help": "the device's dense bfloat16 peak (H200: 989)"})
    engine_args: str = field(default="--max-total-tokens 131072", metadata={"help": "extra flags for every engine"})
    skip_serving: bool = field(default=False, metadata={"help": "only the tower and transfer parts"})
    output: str | None = field(default=None, metadata={"help": "write the report as JSON here"})


def model_folder(cfg: QwenVLBenchConfig, tmp: Path) -> tuple[str, list[str]]:
    """The --model to serve and the engine flags it needs (the shape: dummy weights)."""
    if cfg.model == SHAPED:
        from splitserve.engine.checkpoints.tiny_qwen_vl import write_qwen_vl_shape

        return str(write_qwen_vl_shape(tmp / SHAPED, max_pixels=cfg.max_side ** 2)), ["--load-format", "dummy"]
    return cfg.model, []


# ---- 1. the tower ---------------------------------------------------------------------------------

def tower_flops(vision, grid: tuple[int, int, int]) -> float:
    """Matmul and attention FLOPs of one image through the tower and merger (2 per multiply-add)."""
    from splitserve.engine.models.qwen_vl_vision import image_bounds, window_order

    n, d, inner = grid[0] * grid[1] * grid[2], vision.hidden_size, vision.intermediate_size
    mlp = 3 if vision.is_qwen2_5 else 2  # gate, up, down / fc1, fc2
    per_layer = 2 * n * d * (4 * d + mlp * inner)
    full = image_bounds([grid])
    windowed = full
    if vision.window_size:
        blocks = vision.window_size // vision.spatial_merge_size // vision.patch_size
        windowed = window_order([grid], vision.spatial_merge_size, blocks)[1]

    def attention(bounds: list[int]) -> float:
        return 4 * d * sum((b - a) ** 2 for a, b in itertools.pairwise(bounds))

    layers = sum(per_layer + attention(full if not vision.window_size or i in vision.fullatt_block_indexes
                                       else windowed) for i in range(vision.num_layers))
    merged, wide = n // vision.spatial_merge_size ** 2, d * vision.spatial_merge_size ** 2
    return 2 * n * vision.patch_dim * d + layers + 2 * merged * wide * (wide + vision.out_hidden_size)


def tower_timing(cfg: QwenVLBenchConfig, folder: str) -> dict:
    import torch

    from splitserve.engine.checkpoints.model_config import ModelConfig
    from splitserve.engine.checkpoints.model_names import resolve_model_path
    from splitserve.engine.models.qwen_vl_vision import QwenVisionTower
    from splitserve.engine.multimodal.qwen_vl_processor import QwenVLImageProcessor
    from splitserve.engine.runner.model_runner import init_dummy_weights

    path = resolve_model_path(folder)
    vision = ModelConfig.from_folder(path).vision
    processor = QwenVLImageProcessor.from_folder(path)
    device = torch.device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        tower = QwenVisionTower(vision, dtype).eval()  # type: ignore[arg-type]
    init_dummy_weights(tower, 0)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    out = {}
    for side in cfg.tower_sides:
        grid = processor.grid(side, side)
        patches = torch.randn(grid[1] * grid[2], vision.patch_dim, device=device, dtype=dtype)  # type: ignore[union-attr]
        with torch.inference_mode():
            for _ in range(2):
                tower(patches, [grid])
            sync()
            started = time.perf_counter()
            for _ in range(cfg.tower_iters):
                tower(patches, [grid])
            sync()
        seconds = (time.perf_counter() - started) / cfg.tower_iters
        flops = tower_flops(vision, grid)
        bound = flops / (cfg.peak_tflops * 1e12)
        out[side] = {"grid": list(grid), "tokens": vision.tokens_for_grid(grid), "ms": seconds * 1e3,  # type: ignore[union-attr]
                     "gflops": flops / 1e9, "tflops_achieved": flops / seconds / 1e12, "bound_ms": bound * 1e3,
                     "time_over_bound": seconds / bound}
    return out


# ---- 2. transfer ----------------------------------------------------------------------------------

def transfer_vs_device_copy(cfg: QwenVLBenchConfig, folder: str) -> dict:
    import torch

    from splitserve.bench.epd import EPDBenchConfig, transfer_throughput
    from splitserve.engine.checkpoints.model_config import ModelConfig
    from splitserve.engine.checkpoints.model_names import resolve_model_path
    from splitserve.engine.multimodal.qwen_vl_processor import QwenVLImageProcessor

    path = resolve_model_path(folder)
    mc = ModelConfig.from_folder(path)
    rows = mc.vision.tokens_for_grid(QwenVLImageProcessor.from_folder(path).grid(cfg.max_side, cfg.max_side))  # type: ignore[union-attr]
    out = transfer_throughput(EPDBenchConfig(transfer_rows=rows, transfer_hidden=mc.hidden_size))
    device = torch.device(cfg.device)
    src = torch.randn(rows, mc.hidden_size, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(20):
        dst.copy_(src)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    copy_s = (time.perf_counter() - started) / 20
    out.update({"rows": rows, "hidden": mc.hidden_size, "device_copy_gb_s": out["bytes_per_item"] / copy_s / 1e9,
                "device_copy_ms": copy_s * 1e3, "embedding_over_device_copy": copy_s * 1e3 / out["embedding_ms"]})
    return out


# ---- 3. serving -----------------------------------------------------------------------------------

def chat_bodies(cfg: QwenVLBenchConfig, seed: int) -> list[dict]:
    """`num_requests` chats of 1-4 random images of random sides, each image new."""
    from PIL import Image

    rnd, rng = random.Random(seed), np.random.default_rng(seed)
    bodies = []
    for i in range(cfg.num_requests):
        parts: list[dict] = []
        for _ in range(rnd.randint(cfg.min_images, cfg.max_images)):
            w, h = rnd.randint(cfg.min_side, cfg.max_side), rnd.randint(cfg.min_side, cfg.max_side)
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
            parts.append({"type": "image_url",
                          "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}})
        parts.append({"type": "text", "text": f"compare these images ({i})"})
        # Token ids in the stream: a random model's tokens often decode to no text.
        bodies.append({"model": "m", "stream": True, "max_tokens": cfg.max_tokens, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True,
                       "messages": [{"role": "user", "content": parts}]})
    return bodies


async def streamed(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, float] | None:
    """(time to the first content token, time to the end) of one streamed chat; None if it failed."""
    started = time.perf_counter()
    first = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return None
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: ") and re.search(r'"token_ids":\[\d', line):
                first = time.perf_counter() - started
    return None if first is None else (first, time.perf_counter() - started)


async def load_at_rate(url: str, bodies: list[dict], rate: float, max_tokens: int, seed: int) -> dict:
    rnd = random.Random(seed)
    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = []
        for body in bodies:
            tasks.append(asyncio.ensure_future(streamed(client, url, body)))
            await asyncio.sleep(rnd.expovariate(rate))
        results = await asyncio.gather(*tasks)
    wall = time.perf_counter() - started
    ok = [r for r in results if r is not None]
    return {"requests": len(bodies), "ok": len(ok), "ttft_s": percentiles([r[0] for r in ok]),
            "wall_s": wall, "requests_per_s": len(ok) / wall, "output_tokens_per_s": len(ok) * max_tokens / wall}


def mooncake_missing() -> str:
    """Why the encoder-disaggregated parts cannot run here ("" when they can): the encode role ships embeddings
    through Mooncake."""
    if importlib.util.find_spec("mooncake") is None:
        return ("skipped: Mooncake is not installed (the encode role ships embeddings through it: install "
                "mooncake-transfer-engine, or the -cuda13 wheel on CUDA 13)")
    return ""


def serving(cfg: QwenVLBenchConfig, folder: str, flags: list[str]) -> dict:
    from splitserve.launcher.up import Deployment, UpConfig, free_port

    engine_args = " ".join(["--disable-prefix-cache", "--served-model-name", "m", *flags, cfg.engine_args]).strip()
    out: dict = {"rates": cfg.rates, "unified": {}, "epd": {}}
    shapes = [("unified", {"unified": 1, "prefill": 0, "decode": 0})]
    missing = mooncake_missing()
    if missing:
        out["epd"] = {"skipped": missing}
    else:
        shapes.append(("epd", {"encode": 1, "prefill": 1, "decode": 1}))
    for name, shape in shapes:
        deployment = Deployment(UpConfig(model=folder, device=cfg.device, port=free_port(), engine_args=engine_args,
                                         **shape))
        try:
            url = deployment.start()
            warm = chat_bodies(QwenVLBenchConfig(num_requests=2, max_images=1), seed=999)
            asyncio.run(load_at_rate(url, warm, 100.0, cfg.max_tokens, 0))
            for i, rate in enumerate(cfg.rates):
                out[name][rate] = asyncio.run(load_at_rate(url, chat_bodies(cfg, seed=i), rate, cfg.max_tokens, i))
                logger.info("%s at %g req/s: TTFT p50 %.0f ms", name, rate, out[name][rate]["ttft_s"]["p50"] * 1e3)
        except (RuntimeError, TimeoutError) as exc:  # it did not start, or died: what it measured still counts
            logger.error("%s deployment failed: %s", name, exc)
            out[name]["failed"] = str(exc)
        finally:
            deployment.stop()
    if missing or any("failed" in out[name] for name, _ in shapes):
        return out
    out["ratios"] = {rate: {
        "ttft_p50_epd_over_unified": out["epd"][rate]["ttft_s"]["p50"] / out["unified"][rate]["ttft_s"]["p50"],
        "ttft_p99_epd_over_unified": out["epd"][rate]["ttft_s"]["p99"] / out["unified"][rate]["ttft_s"]["p99"],
        "throughput_epd_over_unified": out["epd"][rate]["output_tokens_per_s"]
        / out["unified"][rate]["output_tokens_per_s"],
    } for rate in cfg.rates}
    return out


def print_tower(tower: dict) -> None:
    for side, t in tower.items():
        print(f"tower {side} px ({t['tokens']} tokens): {t['ms']:.2f} ms, {t['gflops']:.0f} GFLOP, "
              f"{t['tflops_achieved']:.1f} TFLOP/s, bound {t['bound_ms']:.2f} ms ({t['time_over_bound']:.1f}x)",
              flush=True)


def print_transfer_part(t: dict) -> None:
    if "skipped" in t:
        print(f"embedding transfer {t['skipped']}", flush=True)
    else:
        print_transfer(t)


def print_serving(s: dict) -> None:
    for name, label in (("unified", "unified"), ("epd", "encode + prefill + decode")):
        if "skipped" in s[name]:
            print(f"{label} {s[name]['skipped']}")  # the reason starts "skipped: "
        if "failed" in s[name]:
            print(f"{label} failed: {s[name]['failed']}")
    for rate in s["rates"]:
        line = [f"rate {rate:>4} req/s"]
        for name in ("unified", "epd"):
            if rate in s[name]:
                h = s[name][rate]
                line.append(f"{name} TTFT p50 {h['ttft_s']['p50'] * 1e3:7.0f} ms p99 {h['ttft_s']['p99'] * 1e3:7.0f} "
                            f"ms, {h['output_tokens_per_s']:.0f} tok/s ({h['ok']}/{h['requests']})")
        print(" | ".join(line))


def print_transfer(t: dict) -> None:
    print(f"embedding transfer of {t['rows']} x {t['hidden']} rows ({t['bytes_per_item'] / 1e6:.1f} MB): "
          f"{t['embedding_gb_s']:.2f} GB/s ({t['embedding_ms']:.2f} ms); "
          f"raw Mooncake {t['raw_mooncake_gb_s']:.2f} GB/s; "
          f"device copy {t['device_copy_gb_s']:.1f} GB/s ({t['device_copy_ms']:.3f} ms)", flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="splitserve bench --profile qwen-vl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser, QwenVLBenchConfig, "SPLITSERVE_BENCH_QWEN_VL")
    cfg = config_from_args(QwenVLBenchConfig, parser.parse_args(argv), "SPLITSERVE_BENCH_QWEN_VL")
    report: dict = {"config": asdict(cfg)}

    with tempfile.TemporaryDirectory() as tmp:
        folder, flags = model_folder(cfg, Path(tmp))
        report["tower"] = tower_timing(cfg, folder)
        print_tower(report["tower"])
        write_report(report, cfg.output)
        missing = mooncake_missing()
        report["transfer"] = {"skipped": missing} if missing else transfer_vs_device_copy(cfg, folder)
        print_transfer_part(report["transfer"])
        write_report(report, cfg.output)
        if not cfg.skip_serving:
            report["serving"] = serving(cfg, folder, flags)
            print_serving(report["serving"])
            write_report(report, cfg.output)
    failed = "serving" in report and any("failed" in report["serving"][n] for n in ("unified", "epd"))
    return 1 if failed else 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
