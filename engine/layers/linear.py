"""Linear layers split across tensor-parallel ranks, each able to load its shard of a full weight.

Column-parallel layers split the output features (no communication); row-parallel layers split
the input features and all-reduce the partial sums. Fused projections (q/k/v, gate/up) are one
column-parallel layer whose loader places each checkpoint tensor at its offset.

FP8 (engine/quantization/fp8.py, docs/fp8.md): a layer built with a scheme takes a checkpoint's e4m3 `weight`
with its `weight_scale` (per tensor or per channel) and `input_scale`, or quantizes a 16/32-bit weight on load
(per channel). On CUDA it keeps the weight in e4m3 with a float32 scale per local output channel: a
column-parallel shard's scales are its rows' (split with them), a row-parallel shard's are all the output
channels' (replicated: the channels are not split), a per-tensor scale is written to each row of its part;
static input scales are per tensor, replicated, the largest of a fused layer's parts. On the CPU the weight is
dequantized to the compute dtype as soon as both it and its scale have arrived.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.layers import gemm_algos, skinny
from splitserve.engine.quantization.fp8 import (
    FP8_DTYPE,
    ROW_QUANTIZED_ACTIVATIONS,
    Fp8Scheme,
    decode_rows_quantized,
    dequantize,
    fp8_linear,
    nan_codes,
    quantize_per_channel,
)
from splitserve.engine.tp.parallel_state import SINGLE, TensorParallel


class WeightShapeError(ValueError):
    """A checkpoint tensor does not have the shape the model expects."""


class CorruptWeightError(ValueError):
    """A checkpoint tensor holds values no model runs on (NaN codes in an e4m3 weight)."""


def _check_codes(name: str, q: torch.Tensor) -> None:
    bad = nan_codes(q)
    if bad:
        raise CorruptWeightError(f"{name}: {bad} NaN code(s) in an e4m3 weight of {q.numel()} values")


def _check_shape(name: str, expected: tuple[int, ...], actual: tuple[int, ...]) -> None:
    if expected != actual:
        raise WeightShapeError(f"{name}: expected shape {expected}, checkpoint has {actual}")


def fp8_storage_default() -> bool:
    """FP8 layers keep e4m3 weights where they are built on a CUDA device (the model is built under
    `with torch.device(...)`); elsewhere they dequantize on load."""
    return torch.get_default_device().type == "cuda"


class QuantizableLinear(nn.Module):
    """What column- and row-parallel layers share: their weight, bias and FP8 state, and the FP8 loading.

    Subclasses say where a checkpoint tensor's rows and columns go (`_row_span`, `_local_columns`)."""

    skinny_rows = skinny.MAX_ROWS  # 16-bit rows up to this take the row-invariant kernel (a verifier raises it)

    def _init_params(self, out_local: int, in_local: int, bias: bool, dtype: torch.dtype | None,
                     quant: Fp8Scheme | None, fp8_storage: bool | None) -> None:
        self.quant = quant
        self.compute_dtype = dtype or torch.get_default_dtype()
        self.fp8 = quant is not None and (fp8_storage_default() if fp8_storage is None else fp8_storage)
        self.weight = nn.Parameter(torch.empty(out_local, in_local, dtype=FP8_DTYPE if self.fp8 else dtype),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_local, dtype=dtype), requires_grad=False) if bias else None
        self.weight_scale = self.input_scale = None
        arrivals = None  # the skinny kernel's K parts count in here (CUDA)
        if self.fp8:
            self.weight_scale = nn.Parameter(torch.ones(out_local, dtype=torch.float32), requires_grad=False)
            if quant.static_input:
                self.input_scale = nn.Parameter(torch.zeros(1, dtype=torch.float32), requires_grad=False)
            if torch.get_default_device().type == "cuda":
                from splitserve.engine.quantization.fp8_cuda import arrival_counters

                arrivals = arrival_counters(out_local, torch.get_default_device())
        self.arrivals: torch.Tensor | None
        self.register_buffer("arrivals", arrivals, persistent=False)
        # Dequantizing layers (CPU): a shard's e4m3 rows or scales until the other has arrived.
        self._pending: dict[int, dict[str, torch.Tensor]] = {}

    def _row_span(self, shard_index: int) -> tuple[int, int, int, int]:
        """(offset in this layer's rows, local rows, first checkpoint row, checkpoint rows) of a shard."""
        raise NotImplementedError

    def _local_columns(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def _local_weight(self, name: str, loaded: torch.Tensor, shard_index: int) -> torch.Tensor:
        _, local, first, full = self._row_span(shard_index)
        _check_shape(name, (full, self.in_full), tuple(loaded.shape))
        return self._local_columns(loaded.narrow(0, first, local))

    def load_quantized(self, name: str, loaded: torch.Tensor, shard_index: int) -> bool:
        """Loads what is FP8 about a tensor (an e4m3 weight, a scale, a weight to quantize); False: a plain
        tensor of an unquantized layer, the caller's to copy."""
        offset, local, first, full = self._row_span(shard_index)
        if name.endswith(".input_scale"):
            if self.input_scale is not None:
                self.input_scale.data.copy_(torch.maximum(self.input_scale.data, loaded.float().reshape(-1)[:1]))
            return True
        if name.endswith(".weight_scale"):
            scale = loaded.float().reshape(-1)
            if scale.numel() == 1:
                scale = scale.expand(full)
            _check_shape(name, (full,), tuple(scale.shape))
            scale = scale.narrow(0, first, local)
            if self.fp8:
                self.weight_scale.data[offset:offset + local].copy_(scale)
            else:
                self._stage(shard_index, "scale", scale.clone())
            return True
        if loaded.dim() == 1:
            return False  # a bias
        if loaded.dtype == FP8_DTYPE:
            if self.quant is None:
                raise WeightShapeError(f"{name}: an FP8 tensor, but the checkpoint's config names no FP8 "
                                       "quantization for this layer")
            part = self._local_weight(name, loaded, shard_index)
            if self.fp8:  # checked where it lands: on the GPU, a pass over it costs next to nothing
                rows = self.weight.data[offset:offset + local]
                rows.copy_(part)
                _check_codes(name, rows)
            else:
                _check_codes(name, part)
                self._stage(shard_index, "weight", part.clone())
            return True
        if self.quant is None:
            return False
        # A 16/32-bit weight (--quantization fp8, a GGUF file, a layer an FP8 checkpoint left unquantized):
        # per-channel scales over the whole checkpoint row, then this rank's columns.
        _check_shape(name, (full, self.in_full), tuple(loaded.shape))
        q, scale = quantize_per_channel(loaded.narrow(0, first, local))
        q = self._local_columns(q)
        if self.fp8:
            self.weight.data[offset:offset + local].copy_(q)
            self.weight_scale.data[offset:offset + local].copy_(scale)
        else:
            self.weight.data[offset:offset + local].copy_(dequantize(q, scale, self.weight.dtype))
        return True

    def _stage(self, shard_index: int, kind: str, tensor: torch.Tensor) -> None:
        pending = self._pending.setdefault(shard_index, {})
        pending[kind] = tensor
        if "weight" in pending and "scale" in pending:
            offset, local, _, _ = self._row_span(shard_index)
            self.weight.data[offset:offset + local].copy_(dequantize(pending["weight"], pending["scale"],
                                                                     self.weight.dtype))
            del self._pending[shard_index]

    @torch.no_grad()
    def init_from(self, w: torch.Tensor) -> None:
        """A quantized layer's weight from float32 values (--load-format dummy): quantized per channel."""
        q, scale = quantize_per_channel(w)
        if self.fp8:
            self.weight.copy_(q)
            self.weight_scale.copy_(scale)
            if self.input_scale is not None:
                self.input_scale.fill_(1.0 / 448)
        else:
            self.weight.copy_(dequantize(q, scale, self.weight.dtype))

    def takes_quantized_rows(self, x: torch.Tensor) -> bool:
        """Whether this layer's input made from `x`'s rows (same row count, 16-bit) may come already in e4m3
        (`forward_quantized`): FP8 weights on CUDA, bfloat16 rows, a scheme whose activations quantize per row
        or statically, and past the skinny kernel's rows the W8A8 GEMM's shapes; up to them, a scheme that
        quantizes decode rows on a GPU with e4m3 tensor cores."""
        if not (self.fp8 and x.is_cuda and x.dim() == 2 and x.dtype == torch.bfloat16
                and self.quant.activation in ROW_QUANTIZED_ACTIVATIONS):
            return False
        if x.shape[0] <= self.skinny_rows:
            return self.quant.quantizes_decode_rows and decode_rows_quantized(x)
        return self.weight.shape[0] % 16 == 0 and self.weight.shape[1] % 16 == 0

    def fp8_forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        assert self.quant is not None and self.weight_scale is not None
        return fp8_linear(x, self.weight, self.weight_scale, self.input_scale, bias, self.quant.activation,
                          self.skinny_rows, self.arrivals, decode_w8a8=self.quant.quantizes_decode_rows)

    def quantized_product(self, xq: torch.Tensor, xs: torch.Tensor, dtype: torch.dtype,
                          bias: torch.Tensor | None) -> torch.Tensor:
        """(xq * xs) W^T (+ bias) in `dtype` for e4m3 rows and their [M, 1] scales: the skinny e4m3 kernel up to
        the skinny rows (row-invariant), the W8A8 GEMM past them."""
        from splitserve.engine.quantization.fp8_cuda import scaled_mm_quantized, skinny_fp8_rows

        if xq.shape[0] <= self.skinny_rows:
            return skinny_fp8_rows(xq, xs, self.weight, self.weight_scale, bias, dtype, max_rows=self.skinny_rows,
                                   arrivals=self.arrivals)
        y = scaled_mm_quantized(xq, xs, self.weight, self.weight_scale, dtype)
        return y if bias is None else y.add_(bias)


class ColumnParallelLinear(QuantizableLinear):
    """y = x W^T (+ b) with W's rows (output features) split across ranks.

    `output_sizes` lists the full sizes of the fused sub-projections in order; each rank holds
    its shard of every one of them, so `load(weight, shard_index)` fills one sub-projection.
    `quant`: FP8 (see the module docstring); `fp8_storage`: keep e4m3 weights (default: on CUDA).
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool,
                 tp: TensorParallel = SINGLE, dtype: torch.dtype | None = None,
                 quant: Fp8Scheme | None = None, fp8_storage: bool | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.in_full = in_features
        self.full_sizes = list(output_sizes)
        self.local_sizes = [tp.shard(s, "output features")[1] for s in output_sizes]
        self._init_params(sum(self.local_sizes), in_features, bias, dtype, quant, fp8_storage)

    def _row_span(self, shard_index: int) -> tuple[int, int, int, int]:
        local = self.local_sizes[shard_index]
        return sum(self.local_sizes[:shard_index]), local, self.tp.rank * local, self.full_sizes[shard_index]

    def load(self, name: str, loaded: torch.Tensor, shard_index: int = 0) -> None:
        if self.load_quantized(name, loaded, shard_index):
            return
        param = self.bias if loaded.dim() == 1 else self.weight
        if param is None:
            raise WeightShapeError(f"{name}: checkpoint has a bias the config does not ask for")
        full = self.full_sizes[shard_index]
        _check_shape(name, (full, *param.shape[1:]), tuple(loaded.shape))
        local = self.local_sizes[shard_index]
        offset = sum(self.local_sizes[:shard_index])
        param.data[offset:offset + local].copy_(loaded.narrow(0, self.tp.rank * local, local))

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out` (2-D x's rows by the local output features, contiguous): written and returned instead of a
        new tensor; cuBLAS writes it directly, the other paths are copied in (the same bits either way)."""
        # Decode-sized rows through the row-invariant path too: cuBLAS picks its kernel (and its rounding)
        # by the row count, so a verify step's rows would differ from plain decoding's.
        if self.fp8:
            y = self.fp8_forward(x, self.bias)
        elif skinny.fits(x, self.skinny_rows):
            y = skinny.skinny_linear(x, self.weight, self.bias, self.skinny_rows)
        elif (algo := gemm_algos.lookup(x, self.weight, biased=self.bias is not None)) is not None:
            # A shape the sustained-load sweep found faster, or one an SM cap leaves cuBLAS's own pick wrong on.
            y = gemm_algos.lt_linear(x, self.weight, algo)
            if self.bias is not None:
                y = y.add_(self.bias)
        elif out is None:
            return nn.functional.linear(x, self.weight, self.bias)
        elif self.bias is None:  # F.linear's own cuBLAS call for 2-D rows, into `out`
            return torch.mm(x, self.weight.t(), out=out)
        else:
            return torch.addmm(self.bias, x, self.weight.t(), out=out)
        return y if out is None else out.copy_(y)

    def forward_quantized(self, xq: torch.Tensor, xs: torch.Tensor, dtype: torch.dtype,
                          out: torch.Tensor | None = None) -> torch.Tensor:
        """forward of rows given in e4m3 with their [M, 1] scales (takes_quantized_rows said yes), out in
        `dtype` (into `out` where given)."""
        y = self.quantized_product(xq, xs, dtype, self.bias)
        return y if out is None else out.copy_(y)


class RowParallelLinear(QuantizableLinear):
    """y = x W^T (+ b) with W's columns (input features) split; partial sums all-reduced.
    `quant`, `fp8_storage`: as ColumnParallelLinear's (FP8 scales per output channel, replicated)."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 tp: TensorParallel = SINGLE, dtype: torch.dtype | None = None,
                 quant: Fp8Scheme | None = None, fp8_storage: bool | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.in_full = in_features
        _, in_local = tp.shard(in_features, "input features")
        self._init_params(out_features, in_local, bias, dtype, quant, fp8_storage)

    def _row_span(self, shard_index: int) -> tuple[int, int, int, int]:
        rows = self.weight.shape[0]
        return 0, rows, 0, rows

    def _local_columns(self, tensor: torch.Tensor) -> torch.Tensor:
        local = self.weight.shape[1]
        return tensor.narrow(1, self.tp.rank * local, local)

    def load(self, name: str, loaded: torch.Tensor, shard_index: int = 0) -> None:
        if self.load_quantized(name, loaded, shard_index):
            return
        if loaded.dim() == 1:
            if self.bias is None:
                raise WeightShapeError(f"{name}: checkpoint has a bias the config does not ask for")
            _check_shape(name, tuple(self.bias.shape), tuple(loaded.shape))
            self.bias.data.copy_(loaded)
            return
        _check_shape(name, (self.weight.shape[0], self.in_full), tuple(loaded.shape))
        local = self.weight.shape[1]
        self.weight.data.copy_(loaded.narrow(1, self.tp.rank * local, local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Long K (o_proj, down_proj): at decode sizes cuBLAS splits it and adds a reduction kernel.
        if self.fp8:
            y = self.fp8_forward(x, None)
        elif skinny.fits(x, self.skinny_rows):
            y = skinny.skinny_linear(x, self.weight, max_rows=self.skinny_rows)
        elif (algo := gemm_algos.lookup(x, self.weight)) is not None:
            y = gemm_algos.lt_linear(x, self.weight, algo)
        else:
            y = nn.functional.linear(x, self.weight)
        return self._reduced(y)

    def forward_quantized(self, xq: torch.Tensor, xs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """forward of rows given in e4m3 with their [M, 1] scales (takes_quantized_rows said yes), out in `dtype`."""
        return self._reduced(self.quantized_product(xq, xs, dtype, None))

    def _reduced(self, y: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(y)
        # The bias is added once, after the reduction, not once per rank.
        return y if self.bias is None else y + self.bias
