"""The cuDNN attention paths' outputs on seeded inputs, saved to compare two trees bit for bit (a change
that should move no bit: run it under each tree's PYTHONPATH, then compare the two files).

Saves, for Llama-3.1-8B's attention shape (32/8 heads x 128, bf16) and a small one (6/2 x 16): a long
chunk after a cached prefix (engine/layers/prefix_chunk_attention.py) and a lone prompt at its cuDNN bucket
and through flash attention (engine/layers/prompt_attention.py), q, k and v views of one projection as the
engine passes them (and the projection itself, to a tree whose function takes it).

  python3 -P benchmarks/cudnn_paths_bits.py --save /tmp/a.pt
  python3 -P benchmarks/cudnn_paths_bits.py --compare /tmp/a.pt /tmp/b.pt
"""

from __future__ import annotations

import argparse
import inspect
import logging

import torch

logger = logging.getLogger("cudnn_paths_bits")
SHAPES = [(32, 8, 128), (6, 2, 16)]


def projection(length: int, heads: int, kv_heads: int, dim: int, seed: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A seeded [length, (H + 2 Hkv) D] projection (drawn on the CPU: the same values in any process) and
    its q, k, v views."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(length, (heads + 2 * kv_heads) * dim, generator=gen).to("cuda", torch.bfloat16)
    q, k, v = (t.view(length, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1))
    return qkv, q, k, v


def outputs() -> dict[str, torch.Tensor]:
    from splitserve.engine.layers.extend_plan import PrefixChunk
    from splitserve.engine.layers.prefix_chunk_attention import prefix_chunk_attention
    from splitserve.engine.layers.prompt_attention import cudnn_at_bucket, flash_attention, prompt_bucket

    takes_qkv = "qkv" in inspect.signature(cudnn_at_bucket).parameters
    saved = {}
    for heads, kv_heads, dim in SHAPES:
        scale = dim ** -0.5
        for chunk, prefix in ((256, 512), (512, 1024), (1024, 2048)):
            _, q, _, _ = projection(chunk, heads, kv_heads, dim, seed=chunk + prefix)
            gen = torch.Generator().manual_seed(prefix)
            keys, values = (torch.randn(prefix + chunk, kv_heads, dim, generator=gen).to("cuda", torch.bfloat16)
                            for _ in range(2))
            out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
            prefix_chunk_attention(q, keys, values, PrefixChunk(0, 0, chunk, prefix, 0), scale, out)
            saved[f"prefix_chunk {heads}/{kv_heads}x{dim} {chunk} after {prefix}"] = out.cpu()
        for length in (1, 97, 300, 1000, 2047):
            qkv, q, k, v = projection(length, heads, kv_heads, dim, seed=length)
            bucket = prompt_bucket(length, 2048)
            packed = {"qkv": qkv} if takes_qkv else {}
            saved[f"bucket {heads}/{kv_heads}x{dim} {length} at {bucket}"] = cudnn_at_bucket(
                q, k, v, scale, bucket, **packed).cpu()
            saved[f"flash {heads}/{kv_heads}x{dim} {length}"] = flash_attention(q, k, v, scale).cpu()
    return saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--save", help="write this tree's outputs here")
    parser.add_argument("--compare", nargs=2, help="two saved files: which outputs differ, and by how much")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.save:
        torch.save(outputs(), args.save)
    if args.compare:
        a, b = (torch.load(f) for f in args.compare)
        assert a.keys() == b.keys()
        for key in a:
            same = torch.equal(a[key], b[key])
            diff = float((a[key].float() - b[key].float()).abs().max())
            logger.info("%-40s %s (largest difference %.3g, finite %s)", key, "same bits" if same else "DIFFERENT",
                        diff, bool(torch.isfinite(a[key]).all() and torch.isfinite(b[key]).all()))
        logger.info("%d of %d outputs the same bit for bit", sum(torch.equal(a[k], b[k]) for k in a), len(a))


if __name__ == "__main__":
    main()
