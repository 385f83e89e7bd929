"""Where a mixed step's time goes: the paged attention kernels against FlashAttention (SDPA) on
the same causal work, and whole runner steps (prompt chunks beside decode rows) against a plain
prefill of as many tokens.

  python3 -P benchmarks/mixed_steps.py [--shape llama-3.1-8b]
"""

from __future__ import annotations

import argparse
import gc
import logging

import torch
from torch.nn.attention.bias import causal_lower_right
from triton.testing import do_bench

from splitserve.bench.engine_steps import EngineUnderTest
from splitserve.engine.layers.attention import PagedAttention
from splitserve.engine.layers.extend_plan import block_tokens, extend_plan_values, padded
from splitserve.engine.runner.forward_batch import ForwardBatch
from splitserve.engine.runner.model_runner import build_forward_batch
from splitserve.engine.scheduler import ScheduledChunk

logger = logging.getLogger("mixed_steps")
HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16


def attention_case(lengths: list[int], kv_lens: list[int], decode_rows: int) -> tuple[float, float, float]:
    """(paged kernels ms, SDPA-per-sequence ms on contiguous KV, causal TFLOP of the work)."""
    dev = torch.device("cuda")
    n = len(lengths)
    max_pages = -(-max(kv_lens) // PAGE)
    pages = torch.randperm(n * max_pages, device=dev).view(n, max_pages).int() + 1
    k_cache = torch.randn(n * max_pages * PAGE + PAGE, KV_HEADS, DIM, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(sum(lengths), HEADS, DIM, device=dev, dtype=torch.bfloat16)
    slots = list(range(n))
    tokens = block_tokens(HEADS // KV_HEADS, wide=False)
    plan, chunks, blocks = extend_plan_values(lengths, kv_lens, slots, tokens, decode_rows)
    meta = torch.tensor(padded(slots[:decode_rows]) + padded(kv_lens[:decode_rows]) + plan, dtype=torch.int32,
                        device=dev)
    batch = ForwardBatch(input_ids=q.new_zeros(1), positions=q.new_zeros(1), out_cache_loc=q.new_zeros(1),
                         seq_lens=torch.tensor(kv_lens, device=dev), logits_index=q.new_zeros(1), attn_meta=meta,
                         decode_rows=decode_rows, extend_chunks=chunks, extend_blocks=blocks, page_table=pages,
                         page_size=PAGE)
    attn = PagedAttention(HEADS, KV_HEADS, DIM, 0)
    paged_ms = do_bench(lambda: attn._paged_extend(q, batch, k_cache, v_cache), warmup=25, rep=100,
                        return_mode="median")
    # FlashAttention on each sequence's KV laid out contiguously (what a gather would have to build).
    contiguous = []
    row = 0
    for length, kv_len in zip(lengths, kv_lens, strict=True):
        qs = q[row:row + length].transpose(0, 1).unsqueeze(0)
        ks = torch.randn(1, KV_HEADS, kv_len, DIM, device=dev, dtype=torch.bfloat16)
        contiguous.append((qs, ks, torch.randn_like(ks), causal_lower_right(length, kv_len)))
        row += length

    def sdpa() -> None:
        for qs, ks, vs, mask in contiguous:
            torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)

    sdpa_ms = do_bench(sdpa, warmup=25, rep=100, return_mode="median")
    visible = sum(sum(kv - ln + i + 1 for i in range(ln)) for ln, kv in zip(lengths, kv_lens, strict=True))
    return paged_ms, sdpa_ms, 4 * DIM * HEADS * visible / 1e12


def runner_steps(shape: str) -> list[tuple[str, float]]:
    """Whole forward passes of the 8B shape: mixed steps against a plain prefill of as many tokens."""
    eut = EngineUnderTest(shape, "cuda", 264, 264 * 700 + 8192)
    page_table, ps, dev = eut.kv.page_table, eut.cfg.page_size, eut.device
    tpb = eut.runner.extend_block_tokens
    decoders = eut._requests(256, 600, 8)
    for r in decoders:
        r.kv_len, r.output_ids = 600, [1]
    (long,) = eut._requests(1, 8192, 1)
    prompts = eut._requests(4, 512, 1)
    cases = {
        "prefill 2048 alone": [ScheduledChunk(long, 0, 2048, True)],
        "4 prompts x 512": [ScheduledChunk(r, 0, 512, True) for r in prompts],
        "chunk 2048 after 6144 cached": [ScheduledChunk(long, 6144, 2048, True)],
        "256 decodes + chunk 1792": [ScheduledChunk(r, 600, 1, True) for r in decoders]
                                    + [ScheduledChunk(long, 0, 1792, True)],
        "64 decodes + chunk 1984": [ScheduledChunk(r, 600, 1, True) for r in decoders[:64]]
                                   + [ScheduledChunk(long, 0, 1984, True)],
    }
    rows = []
    runner = eut.runner
    with torch.inference_mode():
        for name, chunks in cases.items():
            batch = build_forward_batch(chunks, page_table, ps, dev, tokens_per_block=tpb)
            ms = do_bench(lambda b=batch, r=runner: r.forward(b), warmup=50, rep=200, return_mode="median")
            rows.append((name, ms))
            logger.info("%s: %.2f ms", name, ms)
        graphs = runner.decode_graphs
        ids, pos, slots = [1] * 256, [600] * 256, [r.slot for r in decoders]
        rows.append(("256 decodes (graph)", do_bench(lambda g=graphs: g.replay(ids, pos, slots), warmup=20, rep=100,
                                                      return_mode="median")))
    del eut, runner, graphs
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama-3.1-8b")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    cases = {
        "1 x 2048": ([2048], [2048], 0),
        "1 x 8192": ([8192], [8192], 0),
        "chunk 2048 after 6144": ([2048], [8192], 0),
        "4 x 512": ([512] * 4, [512] * 4, 0),
        "256 decodes (ctx 600) + 1792": ([1] * 256 + [1792], [600] * 256 + [1792], 256),
    }
    print("attention, 32/8 heads x 128, bf16 | paged ms | SDPA ms (contiguous KV) | paged TFLOP/s | paged/SDPA")
    for name, (lengths, kv_lens, dec) in cases.items():
        paged, sdpa, tflop = attention_case(lengths, kv_lens, dec)
        print(f"{name:<34} | {paged:8.3f} | {sdpa:23.3f} | {tflop / paged * 1e3:13.0f} | {paged / sdpa:.2f}")
    rows = runner_steps(args.shape)
    base = dict(rows)["prefill 2048 alone"]
    print(f"runner step ({args.shape})            | ms     | / prefill 2048 alone")
    for name, ms in rows:
        print(f"{name:<36} | {ms:6.2f} | {ms / base:.2f}")


if __name__ == "__main__":
    main()
