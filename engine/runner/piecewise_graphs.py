"""Piecewise CUDA graphs for extend steps: the row-wise layers graphed at a padded token count, attention eager.

A mixed step (prompt chunks beside decode rows: what a loaded server runs whenever a request arrives), several
prompts packed, or a chunk after a cached prefix cannot take one graph: its attention metadata (the paged
kernels' plan, the decode rows, the prefix chunks, the page table's rows) changes every step. Eagerly it launches
~15 kernels a layer, and on the H200's host an 8B forward of a few hundred tokens takes 2-5x its kernel time
(benchmarks/prefill_host_share.py). But everything of the forward except attention works row by row, so it can
run at a bucket's token count T >= the step's n tokens inside CUDA graphs, and attention, the only part that mixes
rows, run eagerly on the n real rows between them (the idea of vLLM's piecewise graphs):

    piece 0:        embedding, layer 0's input norm and qkv projection
    piece l (1..L-1): layer l-1's o_proj, post-attention norm and MLP, layer l's input norm and qkv projection
    between piece l and l+1 (and after piece L-1): layer l's attention part (LlamaAttention.attention) on rows
                    [:n] of the qkv, written to rows [:n] of the attention output that piece l+1 reads

then the last layer's o_proj, post-attention norm and MLP, the final norm and the LM head run eagerly on the rows
that are sampled alone, as the plain forward runs them (LlamaForCausalLM.hidden_states): their count varies, and at
2,048 tokens the last layer's half at every row would cost ~1 ms of a ~46 ms 8B step for 4 rows' logits.
Padding rows (n..T) are token 0, run no attention (they store no KV) and read whatever attention output rows hold
from an earlier step (the buffer is zeroed at allocation and then written only with attention outputs), row-wise,
never read by a real row: every real row of every buffer is written before it is read each step (a GPU test fills
the buffers with NaN before a step and gets the same bits). The projections run at T rows, not n, so a row's
rounding is a T-row GEMM's: with --disable-cuda-graph the same padded pieces run eagerly, so an engine's tokens do
not depend on graphs.

Memory: every tensor that outlives a piece (the token ids, the residual stream, the qkv projection, the attention
output) is a static buffer of the largest bucket's rows, allocated outside the graphs, and the pieces write them in
place: the norms add into the residual where it lies, the qkv projection's GEMM writes its rows of the buffer, the
paged extend kernels write the attention output's. Copies remain where a kernel has no `out`: the embedding, once
a step; the qkv projection where the skinny GEMM or a tuned cuBLASLt algorithm runs it (the 16-token bucket, float32
at any count, the shapes of --gemm-algos); and the attention of steps off the paged kernels' plan (a lone prompt's
cuDNN or SDPA path, the CPU's reference). A first version
copied each piece's residual and qkv in, and the attention output after it: 56 KB a token a layer, ~0.9 ms of an 8B
step at 2,048 tokens, about what the graphs saved (0.94-1.00x of eager past 512 tokens on an H200). So no graph's
output lives in the graphs' memory pool, which holds only each piece's temporaries, dead at the piece's end, and
all pieces of all buckets share one pool: replays run one at a time on one stream, each graph finished before the
next starts, so a graph may reuse any memory another graph's temporaries used. (Keeping every piece's outputs of
every bucket alive instead would cost 32 layers x T x (hidden + qkv) x 2 B, 1.3 GB at T = 2048, per bucket.)
`capture` logs the pool's size.
"""

from __future__ import annotations

import logging
import time

import torch

from splitserve.engine.kv_pool import KVPool
from splitserve.engine.models.llama import LlamaForCausalLM, attention_mask
from splitserve.engine.runner.decode_graphs import capture_graphs
from splitserve.engine.runner.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

# Token counts of the graphs. Up to ~128 rows an 8B step's projections take about their weights' read time at any
# row count, so padding costs little there; past it they are compute-bound and padding rows cost their share: past
# 64 tokens at most a third of a bucket's rows are padding (65 -> 96: 31 of 96), past 96 at most a quarter (193 ->
# 256: 63 of 256), past 256 at most a fifth (257 -> 320, 513 -> 640, 1025 -> 1280). The first bucket is
# skinny.MAX_ROWS: in the default mode the pieces run in, a 16-bit step of up to that many rows takes the
# row-invariant projections padded or not and one past it cuBLAS both ways, so padding never moves a step from one
# projection path to the other (float32 takes the row-invariant kernel at every count). 21 buckets x one piece a
# layer: 672 graphs for 32 layers.
BUCKETS = (16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)


# The default limit on a GPU. On the H200 (benchmarks/prefill_host_share.py) an eager 8B forward costs
# the host ~18 ms whatever its size, so mixed steps of 72-464 tokens ran 1.13-2.15x faster through the pieces, while
# steps of 576-1024 tokens, whose kernels take longer than that, ran 0.94-1.00x (padding and the copies between
# pieces, with nothing to hide). On the CPU no graph runs: the padded pieces would only cost.
DEFAULT_GPU_TOKENS = 512


def piecewise_tokens(configured: int, device: torch.device) -> int:
    """The largest step the pieces run: --piecewise-graph-tokens, or for -1 (its default) DEFAULT_GPU_TOKENS on a
    GPU and 0 (eagerly) on the CPU."""
    if configured >= 0:
        return configured
    return DEFAULT_GPU_TOKENS if device.type == "cuda" else 0


def piecewise_buckets(max_tokens: int) -> tuple[int, ...]:
    """The graphs' token counts for steps of up to `max_tokens` tokens: BUCKETS below it, then itself; () for 0."""
    if max_tokens <= 0:
        return ()
    return (*(b for b in BUCKETS if b < max_tokens), max_tokens)


class PiecewiseGraphs:
    """A text model's forward as L pieces per bucket (see the module docstring); `run` gives a batch's logits."""

    def __init__(self, model: LlamaForCausalLM, kv: KVPool, max_tokens: int, device: torch.device) -> None:
        """`max_tokens`: the largest step a graph runs; the pieces are captured by `capture` (GPU only), and run
        eagerly, on the same buffers, where not."""
        self.model = model
        self.kv = kv
        self.device = device
        self.buckets = piecewise_buckets(max_tokens)
        self.longest = self.buckets[-1] if self.buckets else 0
        attn = model.layers[0].self_attn
        dtype = model.embed_tokens.weight.dtype

        def buffer(width: int) -> torch.Tensor:
            return torch.zeros(self.longest, width, dtype=dtype, device=device)

        self.input_ids = torch.zeros(self.longest, dtype=torch.int64, device=device)
        self.residual = buffer(model.cfg.hidden_size)
        self.qkv = buffer(attn.qkv_proj.weight.shape[0])
        self.attn_out = buffer(attn.num_heads * attn.head_dim)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # by (bucket, piece)
        self.pool_bytes = 0  # the graphs' memory pool (device memory reserved by the capture)

    @property
    def pieces(self) -> int:
        return len(self.model.layers)

    def bucket(self, tokens: int) -> int | None:
        """The token count of the graphs a step of `tokens` tokens runs at; None: more than the largest."""
        return next((b for b in self.buckets if b >= tokens), None)

    def can_run(self, tokens: int) -> bool:
        return 0 < tokens <= self.longest

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket's pieces, largest bucket first, a bucket's pieces in order, into one pool."""
        started = time.monotonic()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # what the pool takes is then what the capture reserved
        reserved = torch.cuda.memory_reserved(self.device)
        keys = [(bucket, piece) for bucket in reversed(self.buckets) for piece in range(self.pieces)]
        self.graphs, _, _ = capture_graphs(keys, lambda key: self.run_piece(*key), self.device)
        torch.cuda.empty_cache()
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - reserved
        logger.info("captured %d piecewise CUDA graphs (%d buckets of %d pieces, %s tokens) in %.1f s, pool %.1f MiB",
                    len(self.graphs), len(self.buckets), self.pieces, ",".join(map(str, self.buckets)),
                    time.monotonic() - started, self.pool_bytes / 2**20)

    def run_piece(self, bucket: int, piece: int) -> None:
        """One piece over rows [:bucket] of the buffers (what each graph runs)."""
        layers = self.model.layers
        residual = self.residual[:bucket]
        if piece == 0:
            residual.copy_(self.model.embed_tokens(self.input_ids[:bucket]))
            layers[0].attention_input(residual, None, out=self.qkv[:bucket])
        else:
            x, _ = layers[piece - 1].after_attention(self.attn_out[:bucket], residual, residual_out=residual)
            layers[piece].attention_input(x, residual, residual_out=residual, out=self.qkv[:bucket])

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits of the batch's `logits_index` rows (an extend batch of up to `longest` tokens, text
        only): its bucket's pieces, replayed (run eagerly where not captured), with each layer's attention
        part run eagerly on the batch's rows between them, then the last layer's rest on the sampled rows."""
        n = batch.input_ids.shape[0]
        bucket = self.bucket(n)
        assert bucket is not None and not batch.is_decode, f"no piecewise graph holds a step of {n} tokens"
        self.input_ids[:n].copy_(batch.input_ids)
        self.input_ids[n:bucket].zero_()
        mask = attention_mask(batch)
        layers = self.model.layers
        for piece in range(self.pieces):
            graph = self.graphs.get((bucket, piece))
            if graph is None:
                self.run_piece(bucket, piece)
            else:
                graph.replay()
            layers[piece].self_attn.attention(self.qkv[:n], batch, self.kv, mask, out=self.attn_out[:n])
        rows = batch.logits_index
        x, residual = layers[-1].after_attention(self.attn_out[:n][rows], self.residual[:n][rows])
        hidden, _ = self.model.norm(x, residual)
        return self.model.lm_head.compute_logits(hidden).float()
