"""`splitserve bench --profile epd`: encoder disaggregation against the unified engine, in one run.

1. Embedding transfer: image rows (rows x hidden of the dtype) from an embedding sender to a
   receiver on loopback (the whole path: stage, ask, check, Mooncake write, status, poll), in GB/s,
   against raw Mooncake `batch_transfer_sync_write` of the same bytes between two engines.
2. Time to first token of image requests, streamed, at a few request rates (Poisson arrivals):
   `up --encode 1 --prefill 1 --decode 1` against `up --unified 1` on the same model and images.
3. The encoder cache: the same requests again (every image cached at the encoder) against the
   first pass (every image new). Prefix caching is off in both deployments, so only the encoder
   cache differs.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import os
import random
import secrets
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np

from splitserve.bench.report_file import write_report
from splitserve.bench.stats import percentiles, scrape_metric_totals
from splitserve.config_flags import add_config_flags, config_from_args


@dataclass
class EPDBenchConfig:
    """What the EPD benchmark runs."""

    model: str = field(default="tiny-llava", metadata={"help": "a multimodal checkpoint folder, or tiny-llava"})
    device: str = field(default="cpu", metadata={"help": "engine device"})
    rates: list[float] = field(default_factory=lambda: [1.0, 2.0, 4.0],
                               metadata={"help": "request rates (requests/s) to load at"})
    num_requests: int = field(default=12, metadata={"help": "image requests per rate"})
    max_tokens: int = field(default=8, metadata={"help": "output tokens per request"})
    image_size: int = field(default=336, metadata={"help": "side of the (random) images sent"})
    transfer_rows: int = field(default=576, metadata={"help": "rows per embedding item (LLaVA-1.5 at 336 px)"})
    transfer_hidden: int = field(default=4096, metadata={"help": "hidden size of the rows (a 7B text model)"})
    transfer_items: int = field(default=20, metadata={"help": "items timed in the transfer part"})
    skip_ttft: bool = field(default=False, metadata={"help": "only the transfer part"})
    engine_args: str = field(default="", metadata={"help": "extra flags for every engine"})
    output: str | None = field(default=None, metadata={"help": "write the report as JSON here"})


# ---- 1. transfer ---------------------------------------------------------------------------------

def transfer_throughput(cfg: EPDBenchConfig) -> dict:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    import torch
    from prometheus_client import CollectorRegistry

    from splitserve.transfer import TransferConfig
    from splitserve.transfer.embedding.receiver import LANDED, RECEIVING, EmbeddingReceiver, WantedItem
    from splitserve.transfer.embedding.sender import EmbeddingChunk, EmbeddingSender
    from splitserve.transfer.embedding.slots import EmbeddingSlots
    from splitserve.transfer.mooncake.engine import MooncakeEngine

    rows, hidden, dtype = cfg.transfer_rows, cfg.transfer_hidden, torch.bfloat16
    nbytes = rows * hidden * 2
    config = TransferConfig()
    src = EmbeddingSlots(2, rows, hidden, dtype)
    src.buffer.normal_()
    dst = EmbeddingSlots(2, rows, hidden, dtype)
    sender = EmbeddingSender(config, src, CollectorRegistry())
    receiver = EmbeddingReceiver(config, dst, timeout_s=30.0, metrics_registry=CollectorRegistry())
    try:
        def one(i: int) -> None:
            room = secrets.randbits(63)
            receiver.stage(f"r{i}", [WantedItem(room, sender.endpoint, rows, f"{i:064x}")])
            sender.begin(room)
            sender.send(EmbeddingChunk(room, i % 2, rows, hidden, "bfloat16", nbytes))
            while receiver.poll()[f"r{i}"] == RECEIVING:
                time.sleep(0.0002)
            landed, failed = receiver.settle({f"r{i}": LANDED})
            assert landed and not failed, failed
            receiver.release(landed[0][1])
            sender.concluded()

        one(-1)  # warm: the Mooncake connection
        started = time.perf_counter()
        for i in range(cfg.transfer_items):
            one(i)
        layer_s = (time.perf_counter() - started) / cfg.transfer_items
        assert torch.equal(dst.buffer[0], src.buffer[0]) or torch.equal(dst.buffer[0], src.buffer[1])
    finally:
        receiver.close()
        sender.close()
    a = MooncakeEngine("127.0.0.1", "tcp")
    b = MooncakeEngine("127.0.0.1", "tcp")
    ta, tb = torch.randn(rows, hidden).to(dtype), torch.zeros(rows, hidden, dtype=dtype)
    a.register(ta.data_ptr(), nbytes)
    b.register(tb.data_ptr(), nbytes)
    try:
        assert a.write(b.session_id, [ta.data_ptr()], [tb.data_ptr()], [nbytes]) == 0
        started = time.perf_counter()
        for _ in range(cfg.transfer_items):
            assert a.write(b.session_id, [ta.data_ptr()], [tb.data_ptr()], [nbytes]) == 0
        raw_s = (time.perf_counter() - started) / cfg.transfer_items
    finally:
        a.close()
        b.close()
    return {"bytes_per_item": nbytes, "embedding_gb_s": nbytes / layer_s / 1e9,
            "raw_mooncake_gb_s": nbytes / raw_s / 1e9, "embedding_over_raw": raw_s / layer_s,
            "embedding_ms": layer_s * 1e3, "raw_ms": raw_s * 1e3}


# ---- 2./3. TTFT ------------------------------------------------------------------------------------

def image_urls(n: int, size: int, seed: int) -> list[str]:
    from PIL import Image

    rng = np.random.default_rng(seed)
    urls = []
    for _ in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
        urls.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    return urls


async def streamed_ttft(client: httpx.AsyncClient, url: str, image: str, max_tokens: int) -> float | None:
    body = {"model": "m", "stream": True, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                      {"type": "text", "text": "describe the image"}]}]}
    started = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return None
        async for line in r.aiter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                return time.perf_counter() - started
    return None


async def load_at_rate(url: str, images: list[str], rate: float, max_tokens: int, seed: int) -> dict:
    rnd = random.Random(seed)
    async with httpx.AsyncClient(timeout=300) as client:
        tasks = []
        for image in images:
            tasks.append(asyncio.ensure_future(streamed_ttft(client, url, image, max_tokens)))
            await asyncio.sleep(rnd.expovariate(rate))
        results = await asyncio.gather(*tasks)
    ok = [t for t in results if t is not None]
    return {"requests": len(images), "ok": len(ok), "ttft_s": percentiles(ok)}


def ttft_comparison(cfg: EPDBenchConfig) -> dict:
    from splitserve.launcher.up import Deployment, UpConfig, free_port

    out: dict = {"rates": cfg.rates, "unified": {}, "epd": {}, "epd_cached": {}}
    engine_args = f"--disable-prefix-cache --served-model-name m {cfg.engine_args}".strip()
    for name, shape in (("unified", {"unified": 1, "prefill": 0, "decode": 0}),
                        ("epd", {"encode": 1, "prefill": 1, "decode": 1})):
        deployment = Deployment(UpConfig(model=cfg.model, device=cfg.device, port=free_port(),
                                         engine_args=engine_args, **shape))
        try:
            url = deployment.start()
            asyncio.run(load_at_rate(url, image_urls(2, cfg.image_size, 999), 100.0, 2, 0))  # warm up
            for i, rate in enumerate(cfg.rates):
                images = image_urls(cfg.num_requests, cfg.image_size, seed=i)
                out[name][rate] = asyncio.run(load_at_rate(url, images, rate, cfg.max_tokens, i))
                if name == "epd":  # the same images again: every one is in the encoder's cache
                    out["epd_cached"][rate] = asyncio.run(load_at_rate(url, images, rate, cfg.max_tokens, i))
            if name == "epd":
                out["encoder_metrics"] = scrape_metric_totals(deployment, "splitserve_embedding_")
        finally:
            deployment.stop()
    out["ratios"] = {rate: {
        "ttft_p50_epd_over_unified": out["epd"][rate]["ttft_s"]["p50"] / out["unified"][rate]["ttft_s"]["p50"],
        "ttft_p50_cached_over_fresh": out["epd_cached"][rate]["ttft_s"]["p50"] / out["epd"][rate]["ttft_s"]["p50"],
    } for rate in cfg.rates}
    return out


def print_report(report: dict) -> None:
    t = report["transfer"]
    print(f"embedding transfer, {t['bytes_per_item'] / 1e6:.2f} MB per item: {t['embedding_gb_s']:.3f} GB/s "
          f"({t['embedding_ms']:.2f} ms) vs raw Mooncake {t['raw_mooncake_gb_s']:.3f} GB/s ({t['raw_ms']:.2f} ms): "
          f"{t['embedding_over_raw']:.2f} of raw")
    if "ttft" not in report:
        return
    r = report["ttft"]
    for rate in r["rates"]:
        line = [f"rate {rate:>4} req/s"]
        for name in ("unified", "epd", "epd_cached"):
            h = r[name][rate]
            line.append(f"{name} TTFT p50 {h['ttft_s']['p50'] * 1e3:7.1f} ms p90 {h['ttft_s']['p90'] * 1e3:7.1f} ms "
                        f"({h['ok']}/{h['requests']})")
        ratio = r["ratios"][rate]
        line.append(f"EPD/unified p50 {ratio['ttft_p50_epd_over_unified']:.2f}, "
                    f"cached/fresh p50 {ratio['ttft_p50_cached_over_fresh']:.2f}")
        print(" | ".join(line))
    m = r.get("encoder_metrics", {})
    hits = m.get("splitserve_embedding_cache_hits_total", 0)
    misses = m.get("splitserve_embedding_cache_misses_total", 0)
    print(f"encoder cache: {hits:.0f} hits, {misses:.0f} misses")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="splitserve bench --profile epd", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser, EPDBenchConfig, "SPLITSERVE_BENCH_EPD")
    cfg = config_from_args(EPDBenchConfig, parser.parse_args(argv), "SPLITSERVE_BENCH_EPD")
    report: dict = {"config": asdict(cfg), "transfer": transfer_throughput(cfg)}
    if not cfg.skip_ttft:
        report["ttft"] = ttft_comparison(cfg)
    print_report(report)
    write_report(report, cfg.output)
    return 0
