"""The cuBLASLt algorithm chosen per projection shape, from a results file that a sustained-load sweep
wrote (benchmarks/gemm_sustained.py --table-out); the dense linear layers consult it.

The file is keyed by the device's name, the dtype and cuBLASLt's version (an algorithm's bytes mean
nothing to another version), then by (rows, N, K) of each GEMM. A missing file, another device or
version, or a shape it does not list: F.linear, as without it. One table per process, installed by
`install` before the decode graphs are captured: every engine built installs its own (an empty one
without --gemm-algos), so two engines at once in one process share the last one's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

FORMAT = 1
_active: dict[tuple[int, int, int, torch.dtype], object] = {}
_sm_capped = False  # this process's SMs are capped (engine/layers/sm_cap_gemms.py)


def entry(rows: int, n: int, k: int, algo, ratio: float) -> dict:
    """One table row: the shape, the algorithm's bytes and config, and its time over F.linear's."""
    return {"rows": rows, "n": n, "k": k, "algo": list(algo.data), "workspace_bytes": algo.workspace_bytes,
            "config": algo.config, "over_linear": ratio}


def write_table(path: Path, dtype: torch.dtype, entries: list[dict]) -> None:
    from splitserve.engine.layers import cublaslt

    path.write_text(json.dumps({"format": FORMAT, "device": torch.cuda.get_device_name(), "dtype": str(dtype),
                                "cublaslt_version": cublaslt.version(), "entries": entries}, indent=1))


def parse_table(data: dict, here: dict) -> dict[tuple[int, int, int, torch.dtype], object]:
    """The entries of a table file's `data` if its format, device and cuBLASLt version are `here`'s, else {};
    ValueError if `data` is not such a table (no object, or an entry or the dtype unreadable)."""
    from splitserve.engine.layers.cublaslt import Algo

    if not isinstance(data, dict):
        raise ValueError(f"a GEMM algorithm table is a JSON object, not {type(data).__name__}")
    theirs = {key: data.get(key) for key in here}
    if theirs != here:
        logger.warning("GEMM algorithm table is for %s, this process has %s: not used", theirs, here)
        return {}
    dtype = getattr(torch, str(data.get("dtype")).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"GEMM algorithm table: dtype {data.get('dtype')!r} is not a torch dtype")
    try:
        return {(int(e["rows"]), int(e["n"]), int(e["k"]), dtype):
                Algo(tuple(int(b) for b in e["algo"]), int(e["workspace_bytes"]), 0.0, dict(e.get("config", {})))
                for e in data["entries"]}
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"GEMM algorithm table: an entry is not (rows, n, k, algo, workspace_bytes): {exc!r}") from exc


def load(path: str | Path, device: torch.device) -> dict[tuple[int, int, int, torch.dtype], object]:
    """The table of `path` for this CUDA device, or {} (logged) if the file is absent or was written for
    another device, format or cuBLASLt version; ValueError naming the file if it is not such a table."""
    file = Path(path)
    if not file.is_file():
        logger.warning("GEMM algorithm table %s not found: F.linear for every projection", file)
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"GEMM algorithm table {file}: not readable as JSON ({exc})") from exc
    from splitserve.engine.layers import cublaslt

    here = {"format": FORMAT, "device": torch.cuda.get_device_name(device), "cublaslt_version": cublaslt.version()}
    try:
        table = parse_table(data, here)
    except ValueError as exc:
        raise ValueError(f"{file}: {exc}") from exc
    refused = [key for key, algo in table.items() if not cublaslt.algo_fits(*key, algo)]
    if refused:
        logger.warning("GEMM algorithm table %s: cuBLASLt refuses its entries for %s: F.linear there", file, refused)
    table = {key: algo for key, algo in table.items() if key not in refused}
    if table:
        cublaslt.prepare(device)  # handle and workspace now, not inside a graph capture
    logger.info("GEMM algorithm table %s: %d shapes (%s)", file, len(table),
                ", ".join(f"{r}x{n}x{k}" for r, n, k, _ in table))
    return table


def install(table: dict[tuple[int, int, int, torch.dtype], object], sm_capped: bool = False) -> None:
    """Makes `table` the one the linear layers consult (an empty one: F.linear everywhere). `sm_capped`: this
    process runs under an MPS SM cap, where shapes the table lacks take engine/layers/sm_cap_gemms.py's pick."""
    global _sm_capped
    if sm_capped:  # the sweep's algorithms may launch clusters that a cap makes wrong: only small ones stay
        from splitserve.engine.layers.sm_cap_gemms import small_clusters

        table = {key: algo for key, algo in table.items() if small_clusters(algo.config)}
    _active.clear()
    _active.update(table)
    _sm_capped = sm_capped


def active_table() -> dict[tuple[int, int, int, torch.dtype], object]:
    """The table the linear layers consult (live: an SM-capped engine's start-up check writes into it)."""
    return _active


def lt_linear(x: torch.Tensor, weight: torch.Tensor, algo) -> torch.Tensor:
    """x @ weight.T through `algo` (engine/layers/cublaslt.py)."""
    from splitserve.engine.layers import cublaslt

    return cublaslt.lt_linear(x, weight, algo)


def lookup(x: torch.Tensor, weight: torch.Tensor, biased: bool = False):
    """The chosen algorithm for x @ weight.T, or None (F.linear): only 2-D contiguous CUDA inputs. The table's
    entries are for layers without a bias (`biased`: the caller adds one after); under an SM cap every 16-bit
    shape has one (the table's, else sm_cap_gemms.algo_for's), and the caller adds its bias after."""
    if (not (_active or _sm_capped) or not x.is_cuda or x.dim() != 2 or not x.shape[0] or not x.is_contiguous()
            or not weight.is_contiguous()):
        return None
    key = (x.shape[0], weight.shape[0], weight.shape[1], x.dtype)
    if not _sm_capped:
        return None if biased else _active.get(key)
    from splitserve.engine.layers.sm_cap_gemms import SIXTEEN_BIT, algo_for

    if x.dtype not in SIXTEEN_BIT or weight.dtype != x.dtype:
        return None
    return _active.get(key) or algo_for(*key)
