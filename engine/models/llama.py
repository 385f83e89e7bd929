"""The Llama family (Llama 2/3, Qwen2/2.5/3, Mistral) as plain torch modules over paged KV."""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.checkpoints.model_config import ModelConfig
from splitserve.engine.kv_pool import KVPool
from splitserve.engine.layers.activation import silu_and_mul
from splitserve.engine.layers.attention import PagedAttention, causal_padded_mask
from splitserve.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding, with_image_rows
from splitserve.engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from splitserve.engine.layers.rmsnorm import RMSNorm
from splitserve.engine.layers.rotary import MRotaryEmbedding, RotaryEmbedding
from splitserve.engine.quantization.fp8 import Fp8Scheme, swiglu_quantized
from splitserve.engine.runner.forward_batch import ForwardBatch
from splitserve.engine.tp.parallel_state import SINGLE, TensorParallel


def projection_quant(cfg: ModelConfig, layer_index: int, name: str) -> Fp8Scheme | None:
    """The FP8 scheme of layer `layer_index`'s projection `name` (`self_attn.q_proj`), None if it stays
    unquantized (no scheme, or the checkpoint's ignore list names it). A fused layer asks for its first part."""
    quant = cfg.quantization
    return quant if quant is not None and quant.quantizes(f"model.layers.{layer_index}.{name}") else None


def attention_mask(batch: ForwardBatch) -> torch.Tensor | None:
    """The mask of a batch's attention: only the padded extend path (the reference) needs one; the paged
    kernels, decodes and plain causal prefills do not."""
    needs_mask = batch.kv_indices is not None and not (batch.no_prefix and batch.batch_size == 1)
    return causal_padded_mask(batch) if needs_mask else None


def rotary_positions(batch: ForwardBatch) -> torch.Tensor:
    """The positions tokens rotate at: their KV positions, or M-RoPE's ([3, T], or shifted decode rows)."""
    if batch.rope_positions is not None:
        return batch.rope_positions
    if batch.rope_offsets is not None:
        return batch.positions + batch.rope_offsets
    return batch.positions


class LlamaAttention(nn.Module):
    """Fused QKV projection, RoPE, paged attention, output projection: parts the decoder layer calls in turn
    (its last layer keeps only the sampled rows between attention and the output projection)."""

    def __init__(self, cfg: ModelConfig, layer_index: int, rotary: RotaryEmbedding,
                 tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        _, self.num_heads = tp.shard(cfg.num_heads, "attention heads")
        _, self.num_kv_heads = tp.shard(cfg.num_kv_heads, "KV heads")
        self.head_dim = cfg.head_dim
        self.layer_index = layer_index
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q_size, kv_size, kv_size],
                                             bias=cfg.attention_bias, tp=tp, dtype=dtype,
                                             quant=projection_quant(cfg, layer_index, "self_attn.q_proj"))
        self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, bias=False, tp=tp, dtype=dtype,
                                        quant=projection_quant(cfg, layer_index, "self_attn.o_proj"))
        self.rotary = rotary
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, layer_index)

    def attention(self, qkv: torch.Tensor, batch: ForwardBatch, kv: KVPool, mask: torch.Tensor | None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """[T, H*D] from the fused projection `qkv` [T, (H + 2 Hkv) D]: qk-norm and RoPE, the KV store and
        attention over the paged cache, all of the layer between its two projections (the part that a
        piecewise graph leaves to run eagerly: engine/runner/piecewise_graphs.py). `out`: [T, H*D] to write
        (an extend step's; a decode step's attention is always a new tensor)."""
        q_len, kv_len = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        k_cache, v_cache = kv.k_cache(self.layer_index), kv.v_cache(self.layer_index)
        scales = kv.layer_scales(self.layer_index)  # None unless the pool is FP8
        q, k, v = qkv.split([q_len, kv_len, kv_len], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        # The fused kernels rotate at the KV position: not M-RoPE rows, whose rotary positions differ from it.
        if qkv.is_cuda and self.q_norm is None and batch.rope_positions is None and batch.rope_offsets is None:
            if batch.is_decode:  # RoPE, the KV store and attention: one kernel
                return self.attn.decode_new_token(q, k, v, batch, k_cache, v_cache, self.rotary, scales)
            from splitserve.engine.layers.fused_triton import rope_and_store_kv
            rope_and_store_kv(qkv, batch.positions, self.rotary.cos, self.rotary.sin, self.num_heads,
                              self.num_kv_heads, self.head_dim, k_cache, v_cache, batch.out_cache_loc, scales)
            return self.attn(q, k, v, batch, k_cache, v_cache, mask, kv_stored=True, qkv=qkv, out=out, scales=scales)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(rotary_positions(batch), q, k)
        return self.attn(q, k, v, batch, k_cache, v_cache, mask, out=out, scales=scales)


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward with a fused gate/up projection."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, dtype: torch.dtype, layer_index: int = 0) -> None:
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [size, size], bias=False, tp=tp, dtype=dtype,
                                                 quant=projection_quant(cfg, layer_index, "mlp.gate_proj"))
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, bias=False, tp=tp, dtype=dtype,
                                           quant=projection_quant(cfg, layer_index, "mlp.down_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._down(self.gate_up_proj(x))

    def forward_quantized(self, xq: torch.Tensor, xs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """forward of rows given in e4m3 with their scales (gate_up_proj.takes_quantized_rows said yes)."""
        return self._down(self.gate_up_proj.forward_quantized(xq, xs, dtype))

    def _down(self, gate_up: torch.Tensor) -> torch.Tensor:
        down = self.down_proj
        if down.takes_quantized_rows(gate_up):  # FP8 prompt rows: SwiGLU straight to e4m3, one kernel
            return down.forward_quantized(*swiglu_quantized(gate_up, down.quant.activation, down.input_scale),
                                          gate_up.dtype)
        return down(silu_and_mul(gate_up))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residuals carried between norms."""

    def __init__(self, cfg: ModelConfig, layer_index: int, rotary: RotaryEmbedding,
                 tp: TensorParallel, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(cfg, layer_index, rotary, tp, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(cfg, tp, dtype, layer_index)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch,
                kv: KVPool, mask: torch.Tensor | None, rows: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """`rows`: the only rows whose output is read (the last layer of an extend step, see
        LlamaForCausalLM.hidden_states); every row still stores its KV and the kept rows attend as before."""
        qkv, residual = self.attention_input(x, residual)
        x = self.self_attn.attention(qkv, batch, kv, mask)
        if rows is not None:
            x, residual = x[rows], residual[rows]
        return self.after_attention(x, residual)

    def attention_input(self, x: torch.Tensor, residual: torch.Tensor | None,
                        residual_out: torch.Tensor | None = None, out: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused projection of the normed input and the new residual (`x` itself where `residual` is None:
        the first layer). FP8 prompt rows go from the norm to the projection in e4m3, one kernel between.
        `residual_out`, `out`: where the new residual and the projection go."""
        qkv_proj = self.self_attn.qkv_proj
        if qkv_proj.takes_quantized_rows(x):
            quant = qkv_proj.quant
            assert quant is not None
            (xq, xs), residual = self.input_layernorm.forward_quantized(x, residual, residual_out, quant.activation,
                                                                        qkv_proj.input_scale)
            return qkv_proj.forward_quantized(xq, xs, x.dtype, out=out), residual
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual, residual_out)
        return qkv_proj(x, out=out), residual

    def after_attention(self, attn_out: torch.Tensor, residual: torch.Tensor,
                        residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer past its attention: the output projection, the residual add and post-attention norm, the
        MLP; returns (MLP output, new residual). `residual_out`: where the new residual goes (may be
        `residual`). FP8 prompt rows go from the norm to the MLP in e4m3, as in attention_input."""
        x = self.self_attn.o_proj(attn_out)
        gate_up = self.mlp.gate_up_proj
        if gate_up.takes_quantized_rows(x):
            quant = gate_up.quant
            assert quant is not None
            (xq, xs), residual = self.post_attention_layernorm.forward_quantized(
                x, residual, residual_out, quant.activation, gate_up.input_scale)
            return self.mlp.forward_quantized(xq, xs, x.dtype), residual
        x, residual = self.post_attention_layernorm(x, residual, residual_out)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head; returns logits of selected tokens."""

    # Checkpoint name fragment -> (our module name fragment, shard index in a fused projection)
    FUSED = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE, dtype: torch.dtype = torch.float32,
                 max_positions: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        positions = max_positions or cfg.max_position_embeddings
        if cfg.mrope:  # Qwen2-VL's text model
            self.rotary: RotaryEmbedding = MRotaryEmbedding(cfg.head_dim, positions, cfg.rope_theta,
                                                            cfg.vision.mrope_section)  # type: ignore[union-attr]
        else:
            self.rotary = RotaryEmbedding(cfg.head_dim, positions, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, self.rotary, tp, dtype) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def hidden_states(self, batch: ForwardBatch, kv: KVPool,
                      input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden rows of the tokens at `batch.logits_index` (every row of a decode batch).

        An extend step samples a few of its rows (a prompt's last token, its decode rows), and a row's output
        after the last layer's attention feeds nothing but its own logits: the KV that later tokens read is
        stored before it. So the last layer's output projection, MLP and the final norm run on those rows
        alone: 4 of 2,048 rows in a step of four 512-token prompts, ~2.7% of an 8B prefill's FLOPs saved."""
        x = self.embed_tokens(batch.input_ids) if input_embeds is None else input_embeds
        x = with_image_rows(x, batch.image_rows, batch.image_positions)  # a multimodal prompt's image rows
        mask = attention_mask(batch)
        residual = None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            rows = batch.logits_index if i == last and not batch.is_decode else None
            x, residual = layer(x, residual, batch, kv, mask, rows)
        x, _ = self.norm(x, residual)
        return x

    def forward(self, batch: ForwardBatch, kv: KVPool, input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (float32) of the tokens at `batch.logits_index`; `input_embeds` replaces the token
        embeddings; a multimodal prompt's image rows (`batch.image_rows`) go over either."""
        return self.logits(batch, kv, input_embeds).float()

    def logits(self, batch: ForwardBatch, kv: KVPool, input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """The same logits in the model's dtype: a decode graph takes their argmax (the same index as the
        float32 copy's) without writing and reading that copy, 0.2 GB a step at 256 rows of a 128k vocabulary."""
        return self.lm_head.compute_logits(self.hidden_states(batch, kv, input_embeds))

    def weight_targets(self) -> dict[str, tuple[nn.Module, int]]:
        """Maps every checkpoint tensor name this model needs to (module, shard index)."""
        modules = dict(self.named_modules())
        targets: dict[str, tuple[nn.Module, int]] = {
            "model.embed_tokens.weight": (self.embed_tokens, 0),
            "model.norm.weight": (self.norm, 0),
        }
        if not self.cfg.tie_word_embeddings:
            targets["lm_head.weight"] = (self.lm_head, 0)
        for i in range(self.cfg.num_layers):
            prefix = f"model.layers.{i}"
            names = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                     "input_layernorm", "post_attention_layernorm"]
            if self.cfg.qk_norm:
                names += ["self_attn.q_norm", "self_attn.k_norm"]
            for name in names:
                leaf = name.rsplit(".", 1)[-1]
                ours, shard = self.FUSED.get(leaf, (leaf, 0))
                parent = name.rsplit(".", 1)[0] + "." if "." in name else ""
                module = modules[f"layers.{i}.{parent}{ours}"]
                targets[f"{prefix}.{name}.weight"] = (module, shard)
                quant = getattr(module, "quant", None)
                if quant is not None and quant.checkpoint_fp8 and quant.quantizes(f"{prefix}.{name}"):
                    # An FP8 checkpoint's scales (a part the ignore list names comes 16-bit, quantized on load)
                    targets[f"{prefix}.{name}.weight_scale"] = (module, shard)
                    if quant.static_input:
                        targets[f"{prefix}.{name}.input_scale"] = (module, shard)
                if self.cfg.attention_bias and leaf in ("q_proj", "k_proj", "v_proj"):
                    targets[f"{prefix}.{name}.bias"] = (module, shard)
        return targets
