"""cuBLASLt's algorithm list for one projection shape, and a GEMM that runs a chosen algorithm.

torch asks cuBLAS(Lt) for its first heuristic pick per shape and exposes no other (TunableOp on CUDA
registers only that "Default"). Here the same library torch loaded is called through ctypes: the
heuristic's top candidates for y[M, N] = x[M, K] @ W[N, K]^T (bf16/fp16 in, float32 accumulate and
scale, 16-bit out, the layout F.linear hands cuBLAS), and `cublasLtMatmul` with one of them on
torch's current stream (so CUDA graphs capture it). Only the algorithm differs from F.linear: the
products and their float32 sums, in an order the algorithm fixes (split-K or not).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CUDA_R_32F, _CUDA_R_16F, _CUDA_R_16BF = 0, 2, 14
_COMPUTE_32F = 68
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_PREF_MAX_WORKSPACE_BYTES = 1
_OP_N, _OP_T = 0, 1
_CONFIG_ATTRS = {"id": 0, "tile": 1, "split_k": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6,
                 "inner_shape": 7, "cluster_shape": 8}
WORKSPACE_BYTES = 32 << 20
_DTYPES = {torch.bfloat16: _CUDA_R_16BF, torch.float16: _CUDA_R_16F}


class CublasLtError(RuntimeError):
    """A cuBLASLt call returned a status other than success."""


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", _Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _loaded_library_path() -> str:
    """The libcublasLt torch's CUDA runtime already mapped (the same build torch's own GEMMs use)."""
    torch.cuda.init()
    torch.cuda.current_blas_handle()  # maps cuBLAS and cuBLASLt if nothing has yet
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1]
        if "libcublasLt.so" in path:
            return path
    return "libcublasLt.so.13"  # not mapped yet: the wheel's soname (cu130 builds)


@functools.cache
def library() -> ctypes.CDLL:
    lib = ctypes.CDLL(_loaded_library_path())
    lib.cublasLtGetVersion.restype = ctypes.c_size_t
    return lib


def version() -> int:
    """cuBLASLt's version (an algorithm's bytes are only meaningful to the version that gave them)."""
    return int(library().cublasLtGetVersion())


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"{what} failed with cuBLAS status {status}")


@functools.cache
def _handle() -> ctypes.c_void_p:
    handle = ctypes.c_void_p()
    _check(library().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle


@functools.cache
def _workspace(device_index: int) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device_index}")


def prepare(device: torch.device) -> None:
    """The handle and the device's workspace made now (before any CUDA graph capture)."""
    _handle()
    _workspace(device.index if device.index is not None else torch.cuda.current_device())


def _set(fn, obj: ctypes.c_void_p, attr: int, value: ctypes._SimpleCData, what: str) -> None:
    _check(fn(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), what)


@dataclass
class _Descriptors:
    """One shape's matmul and layout descriptors (created once, kept for the process)."""

    matmul: ctypes.c_void_p
    a: ctypes.c_void_p  # the weight, [N, K] row-major = K x N column-major, transposed by the op
    b: ctypes.c_void_p  # the rows, [M, K] row-major = K x M column-major
    c: ctypes.c_void_p  # the output, [M, N] row-major = N x M column-major


@functools.cache
def _descriptors(rows: int, n: int, k: int, dtype: torch.dtype) -> _Descriptors:
    lib = library()
    matmul = ctypes.c_void_p()
    _check(lib.cublasLtMatmulDescCreate(ctypes.byref(matmul), _COMPUTE_32F, _CUDA_R_32F), "cublasLtMatmulDescCreate")
    _set(lib.cublasLtMatmulDescSetAttribute, matmul, _DESC_TRANSA, ctypes.c_int32(_OP_T), "TRANSA")
    _set(lib.cublasLtMatmulDescSetAttribute, matmul, _DESC_TRANSB, ctypes.c_int32(_OP_N), "TRANSB")
    layouts = []
    for r, c, ld in ((k, n, k), (k, rows, k), (n, rows, n)):
        layout = ctypes.c_void_p()
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), _DTYPES[dtype], ctypes.c_uint64(r),
                                              ctypes.c_uint64(c), ctypes.c_int64(ld)), "cublasLtMatrixLayoutCreate")
        layouts.append(layout)
    return _Descriptors(matmul, *layouts)


@dataclass(frozen=True)
class Algo:
    """One cuBLASLt algorithm for one shape: its opaque bytes and what its config says about it."""

    data: tuple[int, ...]
    workspace_bytes: int
    waves: float
    config: dict[str, int]

    def struct(self) -> _Algo:
        return _Algo((ctypes.c_uint64 * 8)(*self.data))


def _config(algo: _Algo) -> dict[str, int]:
    lib, out = library(), {}
    for name, attr in _CONFIG_ATTRS.items():
        for kind in (ctypes.c_uint32, ctypes.c_uint16):  # the attributes are 32- or 16-bit
            value, written = kind(0), ctypes.c_size_t(0)
            if lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value),
                                                         ctypes.c_size_t(ctypes.sizeof(value)),
                                                         ctypes.byref(written)) == 0:
                out[name] = int(value.value)
                break
    return out


def heuristic_algos(rows: int, n: int, k: int, dtype: torch.dtype, count: int = 8) -> list[Algo]:
    """Up to `count` algorithms cuBLASLt's heuristic offers for x[rows, k] @ W[n, k]^T, best-ranked
    first (the first is what torch's cuBLASLt path would run), within WORKSPACE_BYTES of workspace."""
    lib, d = library(), _descriptors(rows, n, k, dtype)
    pref = ctypes.c_void_p()
    _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
    try:
        _set(lib.cublasLtMatmulPreferenceSetAttribute, pref, _PREF_MAX_WORKSPACE_BYTES,
             ctypes.c_uint64(WORKSPACE_BYTES), "MAX_WORKSPACE_BYTES")
        results, returned = (_Heuristic * count)(), ctypes.c_int(0)
        _check(lib.cublasLtMatmulAlgoGetHeuristic(_handle(), d.matmul, d.a, d.b, d.c, d.c, pref, count, results,
                                                  ctypes.byref(returned)), "cublasLtMatmulAlgoGetHeuristic")
    finally:
        lib.cublasLtMatmulPreferenceDestroy(pref)
    return [Algo(tuple(r.algo.data), int(r.workspace_size), float(r.waves), _config(r.algo))
            for r in results[:returned.value] if r.state == 0]


def with_config(rows: int, n: int, k: int, dtype: torch.dtype, algo: Algo, name: str, value: int) -> Algo | None:
    """`algo` with one config attribute (a key of its `config`, e.g. "cluster_shape") set to `value`, if cuBLASLt
    accepts the result for this shape within WORKSPACE_BYTES; else None."""
    lib, struct = library(), algo.struct()
    for kind in (ctypes.c_uint16, ctypes.c_uint32):  # the attributes are 16- or 32-bit
        size = ctypes.c_size_t(ctypes.sizeof(kind))
        if lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(struct), _CONFIG_ATTRS[name],
                                                    ctypes.byref(kind(value)), size) == 0:
            break
    else:
        return None
    d, result = _descriptors(rows, n, k, dtype), _Heuristic()
    if lib.cublasLtMatmulAlgoCheck(_handle(), d.matmul, d.a, d.b, d.c, d.c, ctypes.byref(struct),
                                   ctypes.byref(result)) != 0 or result.workspace_size > WORKSPACE_BYTES:
        return None
    changed = Algo(tuple(struct.data), int(result.workspace_size), float(result.waves), _config(struct))
    return changed if changed.config.get(name) == value else None


def algo_fits(rows: int, n: int, k: int, dtype: torch.dtype, algo: Algo) -> bool:
    """Whether cuBLASLt accepts `algo` for this shape within WORKSPACE_BYTES (a table's entry read back
    is checked before it is used: a stale or damaged one is refused here, not in a step)."""
    d, result = _descriptors(rows, n, k, dtype), _Heuristic()
    status = library().cublasLtMatmulAlgoCheck(_handle(), d.matmul, d.a, d.b, d.c, d.c, ctypes.byref(algo.struct()),
                                               ctypes.byref(result))
    return status == 0 and result.workspace_size <= WORKSPACE_BYTES


def lt_linear(x: torch.Tensor, weight: torch.Tensor, algo: Algo, out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T through cuBLASLt with `algo` (one of heuristic_algos(x's rows, *weight.shape, dtype)),
    on torch's current stream; x [M, K] and weight [N, K] contiguous, 16-bit."""
    rows, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    d = _descriptors(rows, n, k, x.dtype)
    alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
    workspace = _workspace(x.device.index if x.device.index is not None else torch.cuda.current_device())
    _check(library().cublasLtMatmul(
        _handle(), d.matmul, ctypes.byref(alpha), ctypes.c_void_p(weight.data_ptr()), d.a,
        ctypes.c_void_p(x.data_ptr()), d.b, ctypes.byref(beta), ctypes.c_void_p(out.data_ptr()), d.c,
        ctypes.c_void_p(out.data_ptr()), d.c, ctypes.byref(algo.struct()), ctypes.c_void_p(workspace.data_ptr()),
        ctypes.c_size_t(WORKSPACE_BYTES), ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream)),
        "cublasLtMatmul")
    return out
