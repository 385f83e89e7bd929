"""Turns a step plan into tensors, runs the model and samples: the only code that touches the GPU."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from splitserve.engine.checkpoints.model_config import ModelConfig
from splitserve.engine.checkpoints.weight_loader import load_weights
from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_pool import COPY_PAGE_OP, KVPool, KVPoolShape
from splitserve.engine.layers import gemm_algos, pdl, skinny, sm_cap_gemms
from splitserve.engine.layers.decode_splits import step_splits
from splitserve.engine.layers.e4m3_prompt_attention import e4m3_prompt_attention_runs
from splitserve.engine.layers.extend_plan import (
    CUDNN_CHUNK_MIN,
    PrefixChunk,
    block_tokens,
    cudnn_prefixes,
    extend_plan_values,
    padded,
    prefix_chunks,
    wide_tiles,
)
from splitserve.engine.layers.prompt_attention import bucket_lengths, bucket_limit
from splitserve.engine.models import build_model
from splitserve.engine.multimodal.mrope import batch_rope_positions, decode_rope_offsets
from splitserve.engine.multimodal.prompt_embeds import image_rows, missing_embeddings, touches_images
from splitserve.engine.quantization.fp8 import online_scheme
from splitserve.engine.quantization.kv_fp8 import checkpoint_kv_scales, rank_share, scales_digest
from splitserve.engine.request import Request
from splitserve.engine.runner.decode_graphs import DecodeGraphs
from splitserve.engine.runner.forward_batch import ForwardBatch, decode_batch, kv_token_locations
from splitserve.engine.runner.host_to_device import to_device
from splitserve.engine.runner.piecewise_graphs import PiecewiseGraphs, piecewise_tokens
from splitserve.engine.runner.prompt_graphs import PromptGraphs
from splitserve.engine.sampling.base import SampleOutput, SamplingBatch, TopLogprobs
from splitserve.engine.sampling.full import FullSampler
from splitserve.engine.sampling.greedy import GreedySampler
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import ScheduledChunk
from splitserve.engine.tp.parallel_state import SINGLE, TensorParallel
from splitserve.engine.tp.step_broadcast import StepBroadcaster

logger = logging.getLogger(__name__)

# On CPU the KV cache is sized from a fixed budget: several engines often share one machine.
CPU_KV_BUDGET_BYTES = 512 << 20


@dataclass
class VerifiedChunk:
    """What verifying one chunk's draft gave: the tokens it emits, in order (the accepted draft
    tokens, then the target's correction or bonus token), and their logprobs if asked for."""

    chunk: ScheduledChunk
    tokens: list[int]
    logprobs: list[float] | None = None
    top_logprobs: TopLogprobs | None = None

    @property
    def accepted(self) -> int:
        return len(self.tokens) - 1


@dataclass
class PendingStep:
    """A step queued on the device; `result()` waits for its tokens (host copies in flight).
    `verified`: the verify chunks' outcomes (read back before the step returns)."""

    sampled_chunks: list[ScheduledChunk]
    tokens: torch.Tensor | None
    logprobs: torch.Tensor | None
    top_logprobs: list[TopLogprobs | None] | None
    done: torch.cuda.Event | None = None
    verified: list[VerifiedChunk] = field(default_factory=list)

    def ready(self) -> bool:
        """Whether the device has finished the step (result() would not wait)."""
        return self.done is None or self.done.query()

    def result(self) -> StepOutput:
        if self.done is not None:
            self.done.synchronize()
        if self.tokens is None:
            return StepOutput([], [], None, None, self.verified)
        logprobs = self.logprobs.tolist() if self.logprobs is not None else None
        return StepOutput(self.sampled_chunks, self.tokens.tolist(), logprobs, self.top_logprobs, self.verified)


@dataclass
class StepOutput:
    """What one forward pass produced for the chunks that asked to sample (plain chunks: one
    token each; verify chunks: in `verified`)."""

    sampled_chunks: list[ScheduledChunk]
    tokens: list[int]
    logprobs: list[float] | None
    top_logprobs: list[TopLogprobs | None] | None
    verified: list[VerifiedChunk] = field(default_factory=list)


def verified_chunks(chunks: list[ScheduledChunk], out: SampleOutput) -> list[VerifiedChunk]:
    """Host copies of a verify() output, one per chunk, cut to each row's accepted length."""
    lengths = out.accept_lengths.tolist()
    tokens = out.tokens.tolist()
    logprobs = out.logprobs.tolist() if out.logprobs is not None else None
    return [VerifiedChunk(c, tokens[i][:n], logprobs[i][:n] if logprobs is not None else None,
                          out.top_logprobs[i] if out.top_logprobs is not None else None)
            for i, (c, n) in enumerate(zip(chunks, lengths, strict=True))]


def logit_rows(chunks: list[ScheduledChunk]) -> list[int]:
    """Flat indices of the tokens whose logits a step needs: the last of each sampling chunk, and
    every position of a verify chunk (the last known token's and each draft token's)."""
    rows, offset = [], 0
    for c in chunks:
        if c.draft:
            rows.extend(range(offset, offset + c.length))
        elif c.sample:
            rows.append(offset + c.length - 1)
        offset += c.length
    return rows


def patch_batches(patches: list[int], budget: int) -> list[range]:
    """Consecutive images grouped into passes of at most `budget` patches each (an image larger than the
    budget alone in its pass)."""
    batches: list[range] = []
    start, total = 0, 0
    for i, n in enumerate(patches):
        if i > start and total + n > budget:
            batches.append(range(start, i))
            start, total = i, 0
        total += n
    if patches:
        batches.append(range(start, len(patches)))
    return batches


def kv_locations(table: torch.Tensor, slot: int, kv_len: int, page_size: int) -> torch.Tensor:
    """[kv_len] int64: the KV pool location of each of a sequence's first kv_len positions."""
    return kv_token_locations(table, slot, torch.arange(kv_len, device=table.device), page_size)


def build_forward_batch(chunks: list[ScheduledChunk], page_table: torch.Tensor, page_size: int,
                        device: torch.device, relay: torch.Tensor | None = None,
                        tokens_per_block: int | None = None, cudnn_chunk: int | None = None,
                        prompt_buckets: int | None = None) -> ForwardBatch:
    """Flattens the chunks' tokens and derives every KV location from the page table.

    With `tokens_per_block` (the paged CUDA kernels' query block), the batch carries their plan;
    without it, every sequence's KV locations padded to the longest (the reference path).
    `cudnn_chunk` (with a plan): chunks of that many tokens after a whole number of them leave the plan
    for the cuDNN path (engine/layers/prefix_chunk_attention.py), with their KV locations.
    `prompt_buckets`: the batch's ForwardBatch.prompt_buckets (a lone fresh prompt's cuDNN buckets).
    """
    ids: list[int] = []
    positions: list[int] = []
    for c in chunks:
        known = c.request.all_ids[c.start:c.start + c.length - len(c.draft)] + c.draft
        # A decode whose input token is still being sampled on the device (overlap): -1, from the relay.
        ids.extend(known + [-1] * (c.length - len(known)))
        positions.extend(range(c.start, c.start + c.length))
    lengths = [c.length for c in chunks]
    kv_lens = [c.start + c.length for c in chunks]
    slot_list = [c.request.slot for c in chunks]
    slots = to_device(slot_list, torch.int64, device)
    extend_lens = to_device(lengths, torch.int64, device)
    seq_lens = to_device(kv_lens, torch.int64, device)
    pos = to_device(positions, torch.int64, device)
    token_batch_index = torch.repeat_interleave(torch.arange(len(chunks), device=device), extend_lens,
                                                output_size=len(positions))  # no device sync
    token_query_index = pos - (seq_lens - extend_lens)[token_batch_index]
    table = page_table.long()
    out_cache_loc = kv_token_locations(table, slots[token_batch_index], pos, page_size)
    max_kv = max(kv_lens)
    kv_indices = attn_meta = prefix_chunk_loc = None
    decode_rows = extend_chunks = extend_blocks = 0
    long_chunks: tuple[PrefixChunk, ...] = ()
    if tokens_per_block is None:
        kv_pos = torch.arange(max_kv, device=device)
        kv_indices = table[slots][:, kv_pos // page_size] * page_size + kv_pos % page_size
        kv_indices = torch.where(kv_pos.unsqueeze(0) < seq_lens.unsqueeze(1), kv_indices, 0)
    else:
        while decode_rows < len(chunks) and lengths[decode_rows] == 1:
            decode_rows += 1
        if cudnn_chunk:
            long_chunks = prefix_chunks(lengths, kv_lens, cudnn_chunk, first_chunk=decode_rows)
        if long_chunks:
            prefix_chunk_loc = torch.cat([kv_locations(table, slot_list[c.index], c.kv_len, page_size)
                                          for c in long_chunks])
        plan, extend_chunks, extend_blocks = extend_plan_values(lengths, kv_lens, slot_list, tokens_per_block,
                                                                first_chunk=decode_rows,
                                                                skip_rows=frozenset(c.row for c in long_chunks))
        decode_meta = padded(slot_list[:decode_rows]) + padded(kv_lens[:decode_rows])
        attn_meta = to_device(decode_meta + plan, torch.int32, device)
    if any(c.draft for c in chunks):
        logits_index = to_device(logit_rows(chunks), torch.int64, device)
    else:  # each sampling chunk's last row, computed here: a boolean mask on the device would sync
        ends = list(itertools.accumulate(lengths))
        logits_index = to_device([end - 1 for c, end in zip(chunks, ends, strict=True) if c.sample], torch.int64,
                                 device)
    input_ids = to_device(ids, torch.int64, device)
    if relay is not None:
        input_ids = torch.where(input_ids >= 0, input_ids, relay[slots[token_batch_index]])
    return ForwardBatch(
        input_ids=input_ids, positions=pos, out_cache_loc=out_cache_loc,
        seq_lens=seq_lens, extend_lens=extend_lens, kv_indices=kv_indices,
        token_batch_index=token_batch_index, token_query_index=token_query_index,
        logits_index=logits_index, max_extend=max(lengths), max_kv=max_kv,
        no_prefix=all(c.start == 0 for c in chunks),
        attn_meta=attn_meta, decode_rows=decode_rows, extend_chunks=extend_chunks, extend_blocks=extend_blocks,
        prefix_chunks=long_chunks, prefix_chunk_loc=prefix_chunk_loc,
        page_table=page_table if attn_meta is not None else None, page_size=page_size,
        prompt_buckets=prompt_buckets,
    )


# Rows per request (K+1) of the verify graphs: a step's longest draft is padded up to the next.
VERIFY_ROWS = (2, 3, 5, 9, 17)
MAX_VERIFY_GRAPH_ROWS = 1024  # graphs up to this many rows; bigger verify steps run eagerly
# 16-bit projections of up to this many rows take the row-invariant path on a verifier and a drafter.
# On an H200 (benchmarks/gemv_sweep.py --rows) it costs one 8B step's projections 1.10x cuBLAS's time
# at 32 rows, and past 32 (the wide-tile kernel) 1.06-1.16x at 40-96 and 1.52x at 160-288: bigger
# steps go to cuBLAS, whose rounding depends on the row count (--row-invariant-rows and
# --batch-invariant raise this, at that cost).
ROW_INVARIANT_ROWS = 32


def verify_shaped(chunks: list[ScheduledChunk]) -> bool:
    """Whether a step is decodes and verify chunks only (no prompt chunk): it can run as decode rows."""
    return all(c.sample and c.length == 1 + len(c.draft) for c in chunks)


def verify_row_count(longest_draft: int, graphs: dict[int, object]) -> int:
    """Rows per request for a verify step: the smallest captured count that holds the longest draft
    and its input token, else exactly that."""
    return min((r for r in graphs if r >= longest_draft + 1), default=longest_draft + 1)


def build_verify_rows(chunks: list[ScheduledChunk], rows: int, padding_slot: int
                      ) -> tuple[list[int], list[int], list[int]]:
    """Token ids, positions and slots of a verify step as `rows` decode rows per request: the last
    known token and the draft at their positions, then scratch rows (the padding slot, position 0)."""
    ids, positions, slots = [], [], []
    for c in chunks:
        req = c.request
        known = req.all_ids[c.start] if c.start < req.total_len else -1
        pad = rows - c.length
        ids += [known, *c.draft, *[0] * pad]
        positions += [*range(c.start, c.start + c.length), *[0] * pad]
        slots += [req.slot] * c.length + [padding_slot] * pad
    return ids, positions, slots


def build_decode_inputs(chunks: list[ScheduledChunk]) -> tuple[list[int], list[int], list[int]]:
    """Token ids, positions and slots of a decode step (each chunk is one token).

    A token the host does not know yet (sampled by the step still running on the GPU, under
    the overlap scheduler) is -1: the device takes it from the relay buffer instead.
    """
    ids = [c.request.all_ids[c.start] if c.start < c.request.total_len else -1 for c in chunks]
    positions = [c.start for c in chunks]
    slots = [c.request.slot for c in chunks]
    return ids, positions, slots


@dataclass(frozen=True)
class AttentionDims:
    """One rank's attention heads, KV heads and head size (what the KV pool and the kernels are planned for)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


def attention_dims(model_cfg: ModelConfig, tp: TensorParallel) -> AttentionDims:
    """This rank's share of the heads, as the attention layers shard them (also without a text model built)."""
    return AttentionDims(tp.shard(model_cfg.num_heads, "attention heads")[1],
                         tp.shard(model_cfg.num_kv_heads, "KV heads")[1], model_cfg.head_dim)


# Device memory a KV cache leaves free in any case: activations, CUDA graphs and the CUDA context of every process
# on the device come out of it.
KV_HEADROOM_FRACTION = 0.05
ENCODER_KV_PAGES = 2  # an encode engine's KV pool: the scratch page and one (it never runs a text step)


def device_kv_budget(total: int, free: int, own: int, mem_fraction: float) -> int:
    """Bytes of KV cache an engine may take on a device of `total` bytes with `free` free, holding `own` itself
    (its weights): its fraction of the device less what it holds, and never past what is free less the headroom.
    Counting its own memory, not the device's use, lets engines that share a device start at the same time,
    each with its own fraction (`splitserve up` splits the default between them), where counting every
    process's use made the last one to measure find the others' KV in its budget."""
    return min(int(total * mem_fraction) - own, free - int(total * KV_HEADROOM_FRACTION))


def kv_pages_for_budget(cfg: EngineConfig, shape_args: dict, device: torch.device, weight_bytes: int) -> int:
    """How many KV pages fit: --max-total-tokens if given, else --mem-fraction of memory. An encoder runs no text
    step: the scratch page and one, whatever the flags (its memory goes to the embedding slots)."""
    if not cfg.runs_text:
        return ENCODER_KV_PAGES
    if cfg.max_total_tokens is not None:
        return -(-cfg.max_total_tokens // cfg.page_size) + 1  # + the scratch page
    per_page = KVPoolShape.bytes_per_page_all_layers(page_size=cfg.page_size, **shape_args)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = device_kv_budget(total, free, torch.cuda.memory_reserved(device), cfg.mem_fraction)
    else:
        budget = int(CPU_KV_BUDGET_BYTES * cfg.mem_fraction)
    pages = budget // per_page
    if pages < 2:
        raise MemoryError(f"no room for the KV cache: {budget / 2**30:.2f} GiB left after weights "
                          f"({weight_bytes / 2**30:.2f} GiB) and other processes on the device; lower the model size, "
                          "raise --mem-fraction or free the device")
    return int(pages)


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights in place (norms at 1), for benchmarks of a shape without its checkpoint. Each weight is
    drawn in float32 from a generator seeded by `seed` and its name, whatever its dtype or quantization: a model
    and its FP8 twin (an FP8 projection quantizes its draw per channel) get the same weights, so their outputs
    compare (bench/fp8.py), and so do a multimodal model and its image side alone (an encode engine)."""
    gen = torch.Generator(device=next(model.parameters()).device)
    quantized = {id(m.weight): m for m in model.modules() if getattr(m, "quant", None) is not None}
    scales = {id(p) for m in quantized.values() for p in (m.weight_scale, m.input_scale) if p is not None}
    for name, param in model.named_parameters():
        if id(param) in scales:
            continue  # the quantized layer's, set with its weight
        if "norm" in name:
            param.fill_(1.0)
            continue
        gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        w = torch.empty(param.shape, dtype=torch.float32, device=param.device).normal_(0.0, 0.02, generator=gen)
        if id(param) in quantized:
            quantized[id(param)].init_from(w)
        else:
            param.copy_(w)


class ModelRunner:
    """Holds the model, the KV pool and the samplers; runs one step at a time."""

    def __init__(self, cfg: EngineConfig, model_folder: Path, model_cfg: ModelConfig,
                 tp: TensorParallel = SINGLE) -> None:
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.device = cfg.torch_device()
        self.dtype = cfg.torch_dtype()
        self.tp = tp
        self.context_length = cfg.context_length or model_cfg.max_position_embeddings
        started = time.monotonic()
        if cfg.quantization == "fp8" and model_cfg.quantization is None:  # FP8 on load (docs/fp8.md)
            model_cfg = self.model_cfg = dataclasses.replace(model_cfg, quantization=online_scheme())
        if model_cfg.quantization is not None and model_cfg.quantization.decode_rows != cfg.fp8_decode_rows:
            model_cfg = self.model_cfg = dataclasses.replace(model_cfg, quantization=dataclasses.replace(
                model_cfg.quantization, decode_rows=cfg.fp8_decode_rows))
        with torch.device(self.device):  # an encode engine: the image side alone, no text model in memory
            self.model = build_model(model_cfg, tp, self.dtype, max_positions=self.context_length,
                                     image_side_only=not cfg.runs_text)
        checkpoint_scales: dict[str, torch.Tensor] = {}
        if cfg.load_format == "dummy":
            init_dummy_weights(self.model, cfg.seed)
        else:
            checkpoint_scales = load_weights(self.model, model_folder, tied_lm_head=model_cfg.tie_word_embeddings)
        # Inference only: no parameter records an autograd graph, whichever entry point runs the model (the
        # encode role calls the tower outside a step; with graphs recorded it held every block's activations).
        self.model.eval().requires_grad_(False)
        # Under an MPS SM cap cuBLAS's own pick is wrong for some shapes (engine/layers/sm_cap_gemms.py).
        sm_cap = sm_cap_gemms.sm_cap_percent() if self.device.type == "cuda" else None
        self.sm_capped = sm_cap is not None
        # One table per process, the last engine built sets it: an engine without --gemm-algos after one
        # with it must not keep the first one's algorithms.
        gemm_algos.install(gemm_algos.load(cfg.gemm_algos, self.device)
                           if cfg.gemm_algos and self.device.type == "cuda" else {}, sm_capped=self.sm_capped)
        if self.sm_capped:
            from splitserve.engine.layers import cublaslt

            plain = sorted({name.rsplit(".", 1)[0] for name, m in self.model.named_modules()
                            if isinstance(m, torch.nn.Linear)})
            if plain and cfg.role not in ("decode", "drafter"):  # an image side's, which decode and drafter never run
                raise sm_cap_gemms.CappedGemmError(
                    f"under the MPS SM cap ({sm_cap_gemms.SM_PERCENT_ENV}) this model's {', '.join(plain[:3])} "
                    "layers would run cuBLAS's own GEMMs, which a cap can make wrong: run it without the cap")

            cublaslt.prepare(self.device)  # handle and workspace now, not inside a graph capture
            logger.info("MPS SM cap %d%%: 16-bit projections past the skinny kernel's rows run cuBLASLt algorithms "
                        "with clusters of at most two CTAs", sm_cap)
        pdl.install(pdl.resolve(cfg.pdl, self.device))
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        fp8 = model_cfg.quantization
        logger.info("model %s loaded: %.1f M parameters, %.2f GiB in %s%s on %s, %.1f s",
                    model_cfg.architecture, sum(p.numel() for p in self.model.parameters()) / 1e6,
                    weight_bytes / 2**30, self.dtype,
                    f" (FP8 projections: {fp8.source}, {fp8.weight_strategy} weight scales, {fp8.activation} "
                    f"activations, {'W8A8' if fp8.quantizes_decode_rows else 'W8A16'} decode rows"
                    f"{'' if self.device.type == 'cuda' else '; dequantized on load'})" if fp8 else "",
                    self.device, time.monotonic() - started)
        attn = self.attention = attention_dims(model_cfg, tp)
        shape_args = {"num_layers": model_cfg.num_layers, "num_kv_heads": attn.num_kv_heads,
                      "head_dim": attn.head_dim, "dtype": cfg.kv_dtype()}
        num_pages = kv_pages_for_budget(cfg, shape_args, self.device, weight_bytes)
        self.kv_shape = KVPoolShape(num_pages=num_pages, page_size=cfg.page_size, **shape_args)
        self.kv_pool = KVPool(self.kv_shape, self.device)
        self.kv_pool.e4m3_prompts = e4m3_prompt_attention_runs(cfg.fp8_prompt_attention, self.kv_shape.dtype,
                                                               self.dtype, attn.head_dim, self.device)
        logger.info("KV cache: %d pages of %d tokens (%.2f GiB of %s)%s", num_pages - 1, cfg.page_size,
                    self.kv_shape.total_bytes / 2**30, self.kv_shape.dtype,
                    "; prompts attend in e4m3 where a 16-bit cache takes cuDNN" if self.kv_pool.e4m3_prompts
                    else "")
        self.kv_scales_digest = self._use_checkpoint_kv_scales(checkpoint_scales, model_cfg)
        max_slots = cfg.max_running_requests
        # Extend batches on CUDA run the paged kernels, planned in blocks of this many queries.
        wide = wide_tiles(attn.head_dim, self.dtype.itemsize)
        group = attn.num_heads // attn.num_kv_heads
        self.extend_block_tokens = block_tokens(group, wide) if self.device.type == "cuda" else None
        # Full prompt chunks after whole chunks attend through cuDNN (16-bit heads of up to 128); None: never.
        cudnn = (self.device.type == "cuda" and self.dtype in (torch.float16, torch.bfloat16)
                 and attn.head_dim % 8 == 0 and attn.head_dim <= 128 and torch.backends.cudnn.is_available())
        chunk = cfg.chunked_prefill_size
        self.cudnn_chunk = chunk if cudnn and CUDNN_CHUNK_MIN <= chunk <= self.context_length // 2 else None
        self.cudnn_attention = cudnn
        # A lone fresh prompt's cuDNN buckets, up to this many tokens: set by warm_up, which builds them.
        self.prompt_buckets: int | None = None
        if self.device.type == "cuda" and self.dtype == torch.float32:
            # float32 runs check exactness: no TF32 anywhere (cuDNN's convolutions allow it by default).
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        self.decode_graphs: DecodeGraphs | None = None
        self.prompt_graphs: PromptGraphs | None = None  # captured by warm_up
        self.piecewise_graphs: PiecewiseGraphs | None = None  # captured (built, on the CPU) by warm_up
        self.warmed_up = False
        # Decode and verify steps attend with one split count at every batch (engine/layers/decode_splits.py).
        self.batch_invariant_attention = False
        self.row_invariant_rows = skinny.MAX_ROWS  # 16-bit projections of up to this many rows are row-invariant
        self.verify_graphs: dict[int, DecodeGraphs] = {}  # by rows per request (K+1)
        self.padding_slot = max_slots  # KVCache's padding slot: its page-table row is all scratch
        # The relay: each slot's latest sampled token, on the device, read by the next decode step.
        self.next_tokens = torch.zeros(max_slots + 1, dtype=torch.int64, device=self.device)
        # Tensor-parallel rank 0 announces every forward pass to the other ranks (engine/tp/supervisor.py).
        self.step_broadcaster: StepBroadcaster | None = None
        self.greedy = GreedySampler()
        self.full = FullSampler(max_slots, model_cfg.vocab_size, self.device)

    def _use_checkpoint_kv_scales(self, found: dict[str, torch.Tensor], model_cfg: ModelConfig) -> str:
        """An FP8 KV pool reads the checkpoint's calibrated KV-cache scales (1.0 where it has none); returns
        their digest (kv_fp8.scales_digest: "" without them), which peers and the store check."""
        if not found:
            return ""
        if self.kv_pool.scales is None:
            logger.info("the checkpoint's %d KV-cache scales are unused: the KV cache holds %s (--kv-cache-dtype "
                        "fp8_e4m3 reads them)", len(found), self.kv_shape.dtype)
            return ""
        scales = checkpoint_kv_scales(found, model_cfg.num_layers, model_cfg.num_kv_heads)  # every KV head
        self.kv_pool.set_scales(rank_share(scales, self.tp).to(self.device))
        logger.info("FP8 KV cache scales from the checkpoint: keys %.4g-%.4g, values %.4g-%.4g",
                    scales[:, 0].min(), scales[:, 0].max(), scales[:, 1].min(), scales[:, 1].max())
        return scales_digest(scales)

    @torch.inference_mode()
    def copy_kv_page(self, src: int, dst: int) -> None:
        """Copies one KV page on this rank and, with tensor parallelism, on every worker's pool too
        (the op travels with the next message, ahead of the forward pass that reads the page)."""
        self.kv_pool.copy_page(src, dst)
        if self.step_broadcaster is not None:
            self.step_broadcaster.queue_op((COPY_PAGE_OP, src, dst))

    def run(self, chunks: list[ScheduledChunk], page_table: torch.Tensor) -> StepOutput:
        """Runs one step and waits for its tokens."""
        return self.launch(chunks, page_table).result()

    @torch.inference_mode()
    def launch(self, chunks: list[ScheduledChunk], page_table: torch.Tensor) -> PendingStep:
        """Queues one step on the device and returns without waiting for it (the overlap scheduler
        prepares the next step meanwhile). Sampled tokens also go to the relay buffer, by slot."""
        sampled = [c for c in chunks if c.sample]
        argmax = None
        # Requests with images on an M-RoPE model rotate at positions of their own: their prompt chunks and
        # verify steps run eagerly with [3, T] positions, their decode rows shifted by an offset (graphs too).
        mrope_images = self.model_cfg.mrope and any(c.request.images for c in chunks)
        plain = not mrope_images and not touches_images(chunks)
        if any(c.draft for c in chunks) and verify_shaped(chunks) and plain:
            return self._verify_rows(chunks, page_table)
        if all(c.length == 1 for c in chunks) and not touches_images(chunks):
            logits, argmax = self._decode(chunks, page_table)
            if len(sampled) < len(chunks):  # a one-token prompt chunk rides along: it samples nothing
                rows = to_device([i for i, c in enumerate(chunks) if c.sample], torch.int64, self.device)
                logits, argmax = logits[rows], (argmax[rows] if argmax is not None else None)
        elif plain and self._lone_prompt_graph_runs(chunks):
            (c,) = chunks
            logits = self.prompt_graphs.run(c.request.all_ids[:c.length], c.request.slot)
        else:
            batch = build_forward_batch(chunks, page_table, self.cfg.page_size, self.device, self.next_tokens,
                                        self.extend_block_tokens, self.cudnn_chunk, self.prompt_buckets)
            if touches_images(chunks):
                batch.image_rows, batch.image_positions = self.prompt_image_rows(chunks)
            if mrope_images:
                batch.rope_positions = self.rope_positions(chunks).to(self.device)  # type: ignore[union-attr]
            logits = self.forward(batch)
            if any(c.draft for c in chunks):
                return self._sample_and_verify(logits, sampled)
        if not sampled:
            return PendingStep([], None, None, None, self._record_done())
        if argmax is not None and all(c.request.params.wants_argmax_only for c in sampled):
            # The graph took the argmax and wrote it to the relay already.
            return PendingStep(sampled, self._to_host(argmax), None, None, self._record_done())
        out = self.sample(logits.float(), sampled)  # a decode graph's logits are in the model's dtype
        self.next_tokens[to_device([c.request.slot for c in sampled], torch.int64, self.device)] = out.tokens
        tokens = self._to_host(out.tokens)
        logprobs = self._to_host(out.logprobs) if out.logprobs is not None else None
        return PendingStep(sampled, tokens, logprobs, out.top_logprobs, self._record_done())

    @torch.inference_mode()
    def encode_images(self, pixels: list[torch.Tensor], grids: Sequence[tuple[int, int, int] | None] | None = None
                      ) -> list[torch.Tensor]:
        """Each image's embedding rows [its tokens, hidden] (vision tower + projector). Qwen-VL images come as
        patches of any count with their patch grids, in tower passes of at most --vision-batch-patches patches
        (an image larger than that alone); LLaVA's as equal-size pixel arrays, in one pass."""
        if self.model_cfg.mrope:
            assert grids is not None and all(g is not None for g in grids), "Qwen-VL images need their patch grids"
            rows: list[torch.Tensor] = []
            for batch in patch_batches([p.shape[0] for p in pixels], self.cfg.vision_batch_patches):
                rows += self.model.encode_images([pixels[i].to(self.device) for i in batch],  # type: ignore[operator]
                                                 [grids[i] for i in batch])
            return rows
        rows = self.model.encode_images(torch.stack(pixels).to(self.device))  # type: ignore[operator]
        return list(rows.unbind(0))

    def rope_positions(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        """[3, T] M-RoPE positions of a step with a request with images (Qwen-VL), else None."""
        vision = self.model_cfg.vision
        if not self.model_cfg.mrope or vision is None:
            return None
        return batch_rope_positions(chunks, vision.spatial_merge_size)  # type: ignore[union-attr]

    def decode_rope_offsets(self, chunks: list[ScheduledChunk]) -> list[int] | None:
        """Each decode row's M-RoPE offset on a Qwen-VL model (0 for text-only requests), else None."""
        vision = self.model_cfg.vision
        if not self.model_cfg.mrope or vision is None:
            return None
        return decode_rope_offsets(chunks, vision.spatial_merge_size)  # type: ignore[union-attr]

    def prompt_image_rows(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunks' image rows and their flat positions; images not yet encoded are, now (on this
        rank alone: the vision tower is not sharded, and the rows reach the other ranks with the batch)."""
        missing = missing_embeddings(chunks)
        if missing:
            rows_of = self.encode_images([m.pixels for m in missing], [m.grid for m in missing])  # type: ignore[misc]
            for item, rows in zip(missing, rows_of, strict=True):
                item.embedding, item.pixels = rows, None
        return image_rows(chunks, self.device)

    def _verify_rows(self, chunks: list[ScheduledChunk], page_table: torch.Tensor) -> PendingStep:
        """A step of decodes and verify chunks only: every request as R = K+1 decode rows (its last
        token, its drafts, scratch rows after a shorter draft), through a verify CUDA graph where one
        was captured for R and the batch. Each row attends as plain decoding would at its position."""
        rows = verify_row_count(max(len(c.draft) for c in chunks), self.verify_graphs)
        ids, positions, slots = build_verify_rows(chunks, rows, self.padding_slot)
        graphs = self.verify_graphs.get(rows) if self.step_broadcaster is None else None
        if graphs is not None and graphs.can_run(len(chunks)):
            logits, _ = graphs.replay(ids, positions, slots)
        else:
            ids_t, positions_t, slots_t = (to_device(x, torch.int64, self.device) for x in (ids, positions, slots))
            logits = self.forward(decode_batch(ids_t, positions_t, slots_t, page_table, self.cfg.page_size,
                                               self.next_tokens, rows_share_slots=True,
                                               decode_splits=self.decode_splits_for(len(chunks), len(ids))))
        if all(c.request.params.wants_argmax_only for c in chunks):
            # One greedy verification for all: a shorter draft's missing candidates (-1) never match,
            # and a request without a draft takes its first row's argmax, as a plain decode would.
            out = self.verify(logits.view(len(chunks), rows, -1), chunks, rows - 1)
            last = out.tokens.gather(1, (out.accept_lengths - 1).unsqueeze(1)).squeeze(1)
            self.next_tokens[to_device([c.request.slot for c in chunks], torch.int64, self.device)] = last
            tokens = out.tokens.tolist()
            plain = [(c, t[0]) for c, t in zip(chunks, tokens, strict=True) if not c.draft]
            drafted = [i for i, c in enumerate(chunks) if c.draft]
            lengths = out.accept_lengths.tolist()
            verified = [VerifiedChunk(chunks[i], tokens[i][:lengths[i]]) for i in drafted]
            plain_tokens = torch.tensor([t for _, t in plain], dtype=torch.int64) if plain else None
            return PendingStep([c for c, _ in plain], plain_tokens, None, None, None, verified)
        rows_of = [i * rows + j for i, c in enumerate(chunks) for j in range(c.length if c.draft else 1)]
        return self._sample_and_verify(logits[to_device(rows_of, torch.int64, self.device)], chunks)

    def decode_splits_for(self, requests: int, rows: int) -> int | None:
        """The paged decode kernel's splits for a step of `requests` decoding requests in `rows` rows
        (None on CPU, whose reference attention has no splits): plain decoding's count for that batch,
        or in batch-invariant mode, where the rows' projections are row-invariant, one count for all."""
        if self.device.type != "cuda":
            return None
        rows_invariant = self.dtype == torch.float32 or rows <= self.row_invariant_rows
        return step_splits(requests, self.attention.num_kv_heads, self.batch_invariant_attention,
                           rows_invariant)

    def _sample_and_verify(self, logits: torch.Tensor, sampled: list[ScheduledChunk]) -> PendingStep:
        """A step with verify chunks: plain chunks sample their token, verify chunks (grouped by
        draft length) verify their draft. Beside prompt chunks it runs eagerly (the extend path, no
        CUDA graph); its outcome is read back at once: the next step is planned from it."""
        plain: list[ScheduledChunk] = []
        plain_rows: list[int] = []
        groups: dict[int, list[tuple[ScheduledChunk, int]]] = {}
        row = 0
        for c in sampled:
            if c.draft:
                groups.setdefault(len(c.draft), []).append((c, row))
            else:
                plain.append(c)
                plain_rows.append(row)
            row += c.length if c.draft else 1
        verified: list[VerifiedChunk] = []
        for k, members in groups.items():
            chunks = [c for c, _ in members]
            rows = to_device([r + j for _, r in members for j in range(k + 1)], torch.int64, self.device)
            out = self.verify(logits[rows].view(len(members), k + 1, -1), chunks)
            last = out.tokens.gather(1, (out.accept_lengths - 1).unsqueeze(1)).squeeze(1)
            self.next_tokens[to_device([c.request.slot for c in chunks], torch.int64, self.device)] = last
            verified += verified_chunks(chunks, out)
        if not plain:
            return PendingStep([], None, None, None, self._record_done(), verified)
        out = self.sample(logits[to_device(plain_rows, torch.int64, self.device)], plain)
        self.next_tokens[to_device([c.request.slot for c in plain], torch.int64, self.device)] = out.tokens
        return PendingStep(plain, out.tokens, out.logprobs, out.top_logprobs, self._record_done(), verified)

    def verify(self, logits: torch.Tensor, chunks: list[ScheduledChunk], k: int | None = None) -> SampleOutput:
        """Verifies each chunk's draft against logits [B, K+1, V]; drafts shorter than `k` (greedy
        only; default: all drafts have the same length) are padded with -1, which never matches."""
        params = [c.request.params for c in chunks]
        host_slots = [c.request.slot for c in chunks]
        batch = SamplingBatch(slots=to_device(host_slots, torch.int64, self.device), params=params,
                              host_slots=host_slots)
        k = len(chunks[0].draft) if k is None else k
        candidates = to_device([t for c in chunks for t in [*c.draft, *[-1] * (k - len(c.draft))]], torch.int64,
                               self.device).view(len(chunks), k)
        if all(p.is_greedy for p in params):
            return self.greedy.verify(logits, candidates, batch)
        for c in chunks:
            self.prepare_sampler_slot(c)
        # Token-only drafts (no draft probabilities): accept x with p(x), else draw from p without
        # x; the emitted token is distributed as p whatever the drafter's own distribution was.
        return self.full.verify(logits, candidates, batch)

    def _decode(self, chunks: list[ScheduledChunk], page_table: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of a step of one-token chunks, and their argmax when a CUDA graph ran it."""
        ids, positions, slots = build_decode_inputs(chunks)
        offsets = self.decode_rope_offsets(chunks)
        graphs = self.decode_graphs
        # Tensor-parallel rank 0 broadcasts the batch it built (its workers replay from that).
        if graphs is not None and self.step_broadcaster is None and graphs.can_run(len(chunks)):
            return graphs.replay(ids, positions, slots, offsets)
        ids_t, positions_t, slots_t = (to_device(x, torch.int64, self.device) for x in (ids, positions, slots))
        return self.forward(decode_batch(ids_t, positions_t, slots_t, page_table, self.cfg.page_size,
                                         self.next_tokens,
                                         decode_splits=self.decode_splits_for(len(chunks), len(chunks)),
                                         rope_offsets=None if offsets is None else
                                         to_device(offsets, torch.int64, self.device))), None

    def _lone_prompt_graph_runs(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether a step is one fresh prompt chunk (nothing cached before it, no drafts, no images) that a
        lone-prompt graph holds; tensor-parallel rank 0 broadcasts its batches instead."""
        if self.prompt_graphs is None or self.step_broadcaster is not None or len(chunks) != 1:
            return False
        (c,) = chunks
        return (c.start == 0 and not c.draft and not touches_images(chunks) and self.prompt_graphs.can_run(c.length)
                and len(c.request.all_ids) >= c.length)

    @torch.inference_mode()
    def capture_prompt_graphs(self, page_table: torch.Tensor) -> None:
        """Captures lone-prompt CUDA graphs up to --prompt-graph-tokens (GPU only, after the warm-up built the
        cuDNN buckets they attend at; not on tensor-parallel ranks). With --disable-cuda-graph their padded
        batches run eagerly instead: the same bits either way (engine/runner/prompt_graphs.py). Graphs captured before
        go first, also where none is captured now: they attend at buckets the last warm-up built."""
        self.prompt_graphs = None  # their memory goes back before the new capture, not beside it
        if (self.device.type != "cuda" or self.tp.size > 1 or not self.prompt_buckets
                or self.cfg.prompt_graph_tokens <= 0):
            return
        graphs = PromptGraphs(lambda b: self.model.logits(b, self.kv_pool), page_table, self.cfg.page_size,
                              self.padding_slot, min(self.cfg.prompt_graph_tokens, self.context_length - 64),
                              self.prompt_buckets, self.device)
        if not self.cfg.disable_cuda_graph:
            self.check_capped_gemms(graphs.lengths, lm_head=False)
            graphs.capture()
        self.prompt_graphs = graphs if graphs.lengths else None

    def _record_done(self) -> torch.cuda.Event | None:
        """An event that completes with the work queued so far (None on CPU, where work is done)."""
        if self.device.type != "cuda":
            return None
        done = torch.cuda.Event()
        done.record()
        return done

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """Starts a device-to-host copy; valid once the step's event has completed."""
        if self.device.type != "cuda":
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return host.copy_(tensor, non_blocking=True)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits of the batch's `logits_index` tokens (every TP rank runs this for every step)."""
        if self.step_broadcaster is not None:
            self.step_broadcaster.broadcast(batch)
        if (batch.is_decode and not batch.rows_share_slots and self.decode_graphs is not None
                and self.decode_graphs.can_run(batch.batch_size)):
            return self.decode_graphs.run(batch)
        if self._piecewise_runs(batch):
            return self.piecewise_graphs.run(batch)
        return self.model(batch, self.kv_pool)

    def _piecewise_runs(self, batch: ForwardBatch) -> bool:
        """Whether an extend batch runs through the piecewise graphs: text only (no image rows), of up to their
        largest bucket's tokens, while 16-bit projections past skinny.MAX_ROWS rows take cuBLAS and attention
        splits are plain decoding's (else padding a step would change which projection path its rows take)."""
        graphs = self.piecewise_graphs
        return (graphs is not None and not batch.is_decode and batch.image_rows is None
                and batch.rope_positions is None
                and graphs.can_run(batch.input_ids.shape[0]) and self._piecewise_mode())

    def _piecewise_mode(self) -> bool:
        """Whether the runner is in the mode piecewise steps run in: the default (not row- or batch-invariant)."""
        return self.row_invariant_rows <= skinny.MAX_ROWS and not self.batch_invariant_attention

    @torch.inference_mode()
    def capture_piecewise_graphs(self) -> None:
        """Captures the piecewise graphs of extend steps up to --piecewise-graph-tokens (and the step budget) on
        the GPU, after the prompt graphs; on the CPU and with --disable-cuda-graph their padded pieces run
        eagerly instead (engine/runner/piecewise_graphs.py). Not on tensor-parallel ranks, nor in a row- or
        batch-invariant mode. Graphs captured before go first, also where none is captured now."""
        self.piecewise_graphs = None  # their memory goes back before the new capture, not beside it
        tokens = piecewise_tokens(self.cfg.piecewise_graph_tokens, self.device)
        if self.cfg.chunked_prefill_size > 0:  # no step is larger than the budget
            tokens = min(tokens, self.cfg.chunked_prefill_size)
        if self.tp.size > 1 or tokens <= 0 or not self._piecewise_mode() or not self.cfg.runs_text:
            return
        text_model = getattr(self.model, "language_model", self.model)  # a multimodal model's text steps
        graphs = PiecewiseGraphs(text_model, self.kv_pool, tokens, self.device)
        if self.device.type == "cuda" and not self.cfg.disable_cuda_graph:
            self.check_capped_gemms(graphs.buckets, lm_head=False)
            graphs.capture()
        self.piecewise_graphs = graphs

    @torch.inference_mode()
    def capture_decode_graphs(self, page_table: torch.Tensor, padding_slot: int) -> None:
        """Captures decode CUDA graphs (GPU only, unless --disable-cuda-graph)."""
        if self.device.type != "cuda" or self.cfg.disable_cuda_graph or not self.cfg.runs_text:
            return
        # The graphs keep the model's dtype: the argmax needs no float32 copy (sampling steps cast after).
        graphs = DecodeGraphs(lambda b: self.model.logits(b, self.kv_pool), page_table, self.cfg.page_size,
                              padding_slot, min(self.cfg.max_running_requests, self.cfg.cuda_graph_max_batch),
                              self.device, self.next_tokens, decode_splits=self.decode_splits_for,
                              rope_offsets=self.model_cfg.mrope)
        self.check_capped_gemms(graphs.buckets)
        graphs.capture()
        self.decode_graphs = graphs

    @torch.inference_mode()
    def check_capped_gemms(self, rows: Iterable[int], lm_head: bool = True) -> None:
        """Under an MPS SM cap, every projection of `rows` rows that reaches cuBLASLt is checked against float32
        before a graph captures it, and a wrong algorithm replaced (engine/layers/sm_cap_gemms.py); FP8
        projections are checked too, and an engine with a wrong one refuses to start. `lm_head`: the graphs
        run it on these rows too (a prompt step runs it on its logits rows only)."""
        if not self.sm_capped:
            return
        started = time.monotonic()
        sixteen_bit, fp8 = sm_cap_gemms.projection_shapes(self.model.modules(), rows, lm_head)
        replaced = sm_cap_gemms.check_shapes(sixteen_bit, gemm_algos.active_table())
        sm_cap_gemms.check_fp8_layers(fp8)
        torch.cuda.empty_cache()  # the float32 references' memory, back before the graphs' pool takes its own
        logger.info("MPS SM cap: %d projection shapes checked in %.1f s%s", len(sixteen_bit) + len(fp8),
                    time.monotonic() - started, f"; replaced {', '.join(replaced)}" if replaced else "")

    def set_row_invariant_rows(self, rows: int, page_table: torch.Tensor, padding_slot: int) -> None:
        """16-bit projections of up to `rows` rows (at least 16) take the row-invariant path (engine/layers/
        skinny.py: the skinny kernel, the wide-tile kernel past 32 rows) instead of cuBLAS, in plain decode
        and verify steps alike: a verifier's rows then have plain decoding's bits at every batch that fits.
        Decode graphs already captured with cuBLAS for batches over 16 are captured again."""
        self.set_invariance(rows, self.batch_invariant_attention, page_table, padding_slot)

    def set_invariance(self, rows: int, batch_invariant: bool, page_table: torch.Tensor, padding_slot: int) -> None:
        """The row-invariant rows (as set_row_invariant_rows) and, with `batch_invariant`, one attention
        split count at every batch for decode and verify steps whose projections are row-invariant
        (engine/layers/decode_splits.py: a row's bits then depend on its own sequence only), set together:
        the graphs either change touches are captured again once (a capture of every decode bucket takes
        seconds; set one after the other they were captured twice). Verify graphs are captured again when
        the split count changes only: at start they are captured after this (Engine.prepare_speculation);
        a change of rows alone leaves those already captured on the rows they were captured with. Piecewise
        graphs go when the runner leaves the default mode and are captured again when it returns to it."""
        if self.device.type != "cuda" or self.step_broadcaster is not None:
            return  # CPU has no skinny kernel nor splits; tensor-parallel ranks keep their own kernels
        rows = max(rows, skinny.MAX_ROWS)
        piecewise_mode = self._piecewise_mode()
        layers = [m for m in self.model.modules() if hasattr(m, "skinny_rows")]
        before = max((m.skinny_rows for m in layers), default=skinny.MAX_ROWS)
        for m in layers:
            m.skinny_rows = rows
        self.row_invariant_rows = rows
        splits_changed = batch_invariant != self.batch_invariant_attention
        self.batch_invariant_attention = batch_invariant
        buckets = self.decode_graphs.buckets if self.decode_graphs is not None else []
        rows_changed = any(min(before, rows) < b <= max(before, rows) for b in buckets)
        if self.decode_graphs is not None and (rows_changed or splits_changed):
            self.decode_graphs = None  # their memory goes back before the new capture
            self.capture_decode_graphs(page_table, padding_slot)
        lengths = self.prompt_graphs.lengths if self.prompt_graphs is not None else []
        if any(min(before, rows) < n <= max(before, rows) for n in lengths):  # their projections' path changed
            self.capture_prompt_graphs(page_table)
        if self.verify_graphs and splits_changed:
            most = max(self.verify_graphs) - 1
            self.verify_graphs = {}
            self.capture_verify_graphs(page_table, padding_slot, most)
        if self.warmed_up and piecewise_mode != self._piecewise_mode():  # out of the default mode, or back in
            self.capture_piecewise_graphs()

    @torch.inference_mode()
    def capture_verify_graphs(self, page_table: torch.Tensor, padding_slot: int, max_draft_tokens: int) -> None:
        """Captures verify CUDA graphs for drafts of up to `max_draft_tokens` (a graph per bucket of
        requests and per row count in VERIFY_ROWS up to K+1; GPU only, unless --disable-cuda-graph).
        Steps with more drafts than any graph holds run eagerly."""
        if self.device.type != "cuda" or self.cfg.disable_cuda_graph or self.step_broadcaster is not None:
            return
        counts = [r for r in VERIFY_ROWS if r < max_draft_tokens + 1] + [max_draft_tokens + 1]
        max_batch = min(self.cfg.max_running_requests, self.cfg.cuda_graph_max_batch)
        pool = None
        for rows in sorted(set(counts) - set(self.verify_graphs), reverse=True):
            graphs = DecodeGraphs(lambda b: self.model(b, self.kv_pool), page_table, self.cfg.page_size,
                                  padding_slot, max(1, min(max_batch, MAX_VERIFY_GRAPH_ROWS // rows)), self.device,
                                  self.next_tokens, rows_per_request=rows, decode_splits=self.decode_splits_for)
            self.check_capped_gemms(b * rows for b in graphs.buckets)
            pool = graphs.capture(pool)
            self.verify_graphs[rows] = graphs

    @torch.inference_mode()
    def warm_up(self, page_table: torch.Tensor) -> None:
        """Runs every kind of extend step and both samplers once, so that no kernel compiles
        (Triton) or picks its algorithm (cuBLAS, SDPA) while a served request waits (GPU only).

        Runs before any request holds a slot: slot 0's page-table row is all scratch page, so
        these steps read and write nothing but scratch. The decode graphs' capture has already
        compiled the decode kernels.
        """
        self.warmed_up = True
        if not self.cfg.runs_text:
            return  # an encoder: no text step to compile for (the tower's kernels compile at its first batch)
        if self.device.type != "cuda":
            self.capture_piecewise_graphs()  # built only: their pieces run eagerly on the CPU
            return
        started = time.monotonic()
        greedy = SamplingParams(max_new_tokens=1, temperature=0.0)
        sampled = SamplingParams(max_new_tokens=1, temperature=0.7, top_k=8, top_p=0.9, seed=1,
                                 repetition_penalty=1.1)

        def chunk(length: int, start: int = 0, params: SamplingParams = greedy) -> ScheduledChunk:
            req = Request("warm-up", [1] * (start + length), params, on_output=lambda _out: None)
            req.slot, req.kv_len = 0, start
            return ScheduledChunk(req, start, length, sample=True)

        # Prompts of the sizes steps have (cuBLAS picks its kernels per shape on first use), and one at
        # each cuDNN bucket a lone prompt attends at (its graph; not where cuDNN's SDPA is turned off, as
        # by a drafter's --no-drafter-cudnn-attention: the default dispatch then, which builds nothing).
        budget = self.cfg.chunked_prefill_size if self.cfg.chunked_prefill_size > 0 else 2048
        longest_lone_prompt = budget if self.cfg.chunked_prefill_size > 0 else self.context_length
        if self.cudnn_attention and torch.backends.cuda.cudnn_sdp_enabled():
            self.prompt_buckets = bucket_limit(longest_lone_prompt, self.context_length)
        buckets = bucket_lengths(self.prompt_buckets or 0)
        sizes = sorted({min(n, self.context_length - 64) for n in (64, 512, budget, *buckets)})
        steps = [
            *([chunk(n)] for n in sizes),  # one prompt: SDPA's causal kernel
            [chunk(24), chunk(9, params=sampled)],  # several prompts: the paged extend kernel, the full sampler
            [chunk(1, start=40), chunk(16, start=32)],  # a decode row beside a chunk over a cached prefix
            [chunk(1, start=7), chunk(1, start=3, params=sampled)],  # an eager decode step (no graph)
        ]
        if self.cudnn_chunk:  # a chunk through the cuDNN path (its gather and merge kernel)
            steps.append([chunk(self.cudnn_chunk, start=self.cudnn_chunk)])
        # Eager steps, as at a first warm-up: a second one's lone prompts would replay the graphs captured after
        # the first (captured again below), and the decode steps the decode graphs.
        self.prompt_graphs = self.piecewise_graphs = None
        graphs, self.decode_graphs = self.decode_graphs, None
        try:
            for chunks in steps:
                self.run(chunks, page_table)
        finally:
            self.decode_graphs = graphs
        if self.cudnn_chunk and not self.kv_pool.e4m3_prompts:  # in e4m3 those chunks take no cuDNN graph
            from splitserve.engine.layers.prefix_chunk_attention import build_cudnn_graphs

            attn = self.attention
            build_cudnn_graphs(self.cudnn_chunk, cudnn_prefixes(self.cudnn_chunk, self.context_length),
                               attn.num_heads, attn.num_kv_heads, attn.head_dim, self.dtype, self.device)
        self.capture_prompt_graphs(page_table)
        self.capture_piecewise_graphs()
        torch.cuda.synchronize(self.device)
        logger.info("warm-up: every step kind compiled in %.1f s (with %d cuDNN prompt buckets up to %d tokens, "
                    "~62 ms a graph on an H200)", time.monotonic() - started, len(buckets), self.prompt_buckets or 0)

    def close(self) -> None:
        """Gives the device memory back (the engine has stopped): graphs, KV pool, weights."""
        self.decode_graphs = None
        self.verify_graphs = {}
        self.prompt_graphs = None
        self.piecewise_graphs = None
        self.model = None
        self.kv_pool = None
        self.full = None
        self.next_tokens = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> SampleOutput:
        params = [c.request.params for c in chunks]
        host_slots = [c.request.slot for c in chunks]
        slots = to_device(host_slots, torch.int64, self.device)
        batch = SamplingBatch(slots=slots, params=params, host_slots=host_slots)
        if all(p.wants_argmax_only for p in params):
            return self.greedy.sample(logits, batch)
        for c in chunks:
            self.prepare_sampler_slot(c)
        return self.full.sample(logits, batch)

    def prepare_sampler_slot(self, chunk: ScheduledChunk) -> None:
        """Resets the full sampler's per-slot state when a request (re)takes its slot."""
        req = chunk.request
        if req.sampler_slot != req.slot:
            self.full.reset_slot(req.slot, req.params, req.prompt_ids)
            if req.output_ids:
                self.full.commit(to_device([req.slot], torch.int64, self.device), [list(req.output_ids)])
            req.sampler_slot = req.slot

    def commit_verified(self, verified: list[VerifiedChunk]) -> None:
        """Records verify chunks' emitted tokens in the per-slot penalty state, like `commit`."""
        rows = [(v.chunk.request.slot, v.tokens) for v in verified
                if v.chunk.request.sampler_slot == v.chunk.request.slot]
        if rows:
            self.full.commit(to_device([s for s, _ in rows], torch.int64, self.device), [t for _, t in rows])

    def commit(self, chunks: list[ScheduledChunk], tokens: list[int]) -> None:
        """Records sampled tokens in the per-slot penalty state of requests that use it."""
        rows = [(c.request.slot, t) for c, t in zip(chunks, tokens, strict=True)
                if c.request.sampler_slot == c.request.slot]
        if rows:
            slots = to_device([s for s, _ in rows], torch.int64, self.device)
            self.full.commit(slots, [[t] for _, t in rows])
