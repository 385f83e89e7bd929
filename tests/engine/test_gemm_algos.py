"""The table of cuBLASLt algorithms per projection shape (engine/layers/gemm_algos.py) and the GEMM that
runs one (engine/layers/cublaslt.py): which tables are used, and on a GPU every heuristic candidate
against a float64 reference, inside a CUDA graph, and through the linear layers."""

from __future__ import annotations

import json

import pytest
import torch

from splitserve.engine.layers import gemm_algos
from splitserve.engine.layers.linear import ColumnParallelLinear, RowParallelLinear

HERE = {"format": gemm_algos.FORMAT, "device": "NVIDIA H200", "cublaslt_version": 130100}
ENTRY = {"rows": 256, "n": 6144, "k": 4096, "algo": [1, 2, 3, 4, 5, 6, 7, 8], "workspace_bytes": 0,
         "config": {"tile": 20}, "over_linear": 0.9}


def gpu(test):
    """A GPU test: marked `gpu` (as the other GPU tests, for -m gpu) and skipped where there is no CUDA device."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


@pytest.fixture(autouse=True)
def no_table_after():
    yield
    gemm_algos.install({})


def test_a_table_for_this_device_and_version_gives_its_shapes() -> None:
    table = gemm_algos.parse_table({**HERE, "dtype": "torch.bfloat16", "entries": [ENTRY]}, HERE)
    (key, algo), = table.items()
    assert key == (256, 6144, 4096, torch.bfloat16)
    assert algo.data == (1, 2, 3, 4, 5, 6, 7, 8) and algo.config == {"tile": 20}


@pytest.mark.parametrize("field,other", [("device", "NVIDIA H100"), ("cublaslt_version", 130000), ("format", 0)])
def test_a_table_for_another_device_version_or_format_is_not_used(field: str, other) -> None:
    data = {**HERE, field: other, "dtype": "torch.bfloat16", "entries": [ENTRY]}
    assert gemm_algos.parse_table(data, HERE) == {}


@pytest.mark.parametrize("data", [
    [ENTRY],  # not an object
    {**HERE, "dtype": "torch.bfloat17", "entries": [ENTRY]},
    {**HERE, "dtype": "torch.bfloat16", "entries": [{**ENTRY, "algo": None}]},
    {**HERE, "dtype": "torch.bfloat16", "entries": [{"rows": 256, "n": 6144}]},
    {**HERE, "dtype": "torch.bfloat16"},
])
def test_a_table_for_this_device_that_is_malformed_is_refused_with_a_clear_error(data) -> None:
    with pytest.raises(ValueError, match="GEMM algorithm table"):
        gemm_algos.parse_table(data, HERE)


def test_a_table_file_that_is_not_json_is_refused_naming_the_file(tmp_path) -> None:
    bad = tmp_path / "algos.json"
    bad.write_text('{"format": 1, "entries": [')  # cut short
    with pytest.raises(ValueError, match=f"{bad}: not readable as JSON"):
        gemm_algos.load(bad, torch.device("cpu"))  # refused before any CUDA call


def test_without_a_table_or_off_cuda_no_algorithm_is_looked_up() -> None:
    x, w = torch.randn(256, 4096, dtype=torch.bfloat16), torch.randn(6144, 4096, dtype=torch.bfloat16)
    assert gemm_algos.lookup(x, w) is None
    gemm_algos.install(gemm_algos.parse_table({**HERE, "dtype": "bfloat16", "entries": [ENTRY]}, HERE))
    assert gemm_algos.lookup(x, w) is None  # CPU rows: F.linear
    layer = ColumnParallelLinear(4096, [4096, 1024, 1024], bias=False, dtype=torch.bfloat16)
    layer.weight.data.copy_(w)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, w))


def test_an_engine_built_without_a_table_clears_the_one_an_earlier_engine_installed(tmp_path) -> None:
    from engine_checkpoints import write

    from splitserve.engine.checkpoints.model_config import ModelConfig
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.runner.model_runner import ModelRunner

    gemm_algos.install(gemm_algos.parse_table({**HERE, "dtype": "bfloat16", "entries": [ENTRY]}, HERE))
    assert gemm_algos._active  # as an engine built with --gemm-algos leaves it
    folder = write("llama-gqa-llama3rope", tmp_path / "ckpt")
    ModelRunner(EngineConfig(model=str(folder), device="cpu", max_total_tokens=64, page_size=4), folder,
                ModelConfig.from_folder(folder))
    assert gemm_algos._active == {}


@gpu
def test_a_missing_table_file_means_no_table(tmp_path) -> None:
    assert gemm_algos.load(tmp_path / "absent.json", torch.device("cuda")) == {}


@gpu
@pytest.mark.parametrize("rows,n,k", [(2048, 768, 512), (256, 6144, 4096), (256, 4096, 14336), (40, 512, 1024)])
def test_every_heuristic_algorithm_computes_the_product(rows: int, n: int, k: int) -> None:
    from splitserve.engine.layers import cublaslt

    torch.manual_seed(rows + n)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    ref = x.double() @ w.double().t()
    torch_err = ((torch.nn.functional.linear(x, w).double() - ref).norm() / ref.norm()).item()
    algos = cublaslt.heuristic_algos(rows, n, k, torch.bfloat16, 8)
    assert algos, "cuBLASLt offered no algorithm"
    for algo in algos:
        out = torch.full((rows, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        cublaslt.lt_linear(x, w, algo, out=out)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert torch.isfinite(out).all(), algo.config
        assert err < max(2 * torch_err, 5e-3), (algo.config, err, torch_err)


@gpu
def test_an_algorithm_inside_a_cuda_graph_gives_the_eager_bits() -> None:
    from splitserve.engine.layers import cublaslt

    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16) / 32
    algo = cublaslt.heuristic_algos(256, 2048, 1024, torch.bfloat16, 8)[-1]
    eager = cublaslt.lt_linear(x, w, algo)
    cublaslt.prepare(x.device)
    graph, out = torch.cuda.CUDAGraph(), torch.empty_like(eager)
    with torch.cuda.graph(graph):
        cublaslt.lt_linear(x, w, algo, out=out)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, cublaslt.lt_linear(x, w, algo))
    assert not torch.equal(out, eager)  # the replay read the new rows


@gpu
def test_the_linear_layers_take_the_tables_algorithm_for_its_shapes_only(tmp_path) -> None:
    from splitserve.engine.layers import cublaslt

    dev = torch.device("cuda")
    col = ColumnParallelLinear(1024, [1536, 512], bias=False, dtype=torch.bfloat16).to(dev)
    row = RowParallelLinear(1536, 1024, bias=False, dtype=torch.bfloat16).to(dev)
    for layer in (col, row):
        layer.weight.data.normal_(0, 0.03)
    algo_col = cublaslt.heuristic_algos(64, 2048, 1024, torch.bfloat16, 8)[-1]
    algo_row = cublaslt.heuristic_algos(64, 1024, 1536, torch.bfloat16, 8)[-1]
    entries = [gemm_algos.entry(64, 2048, 1024, algo_col, 0.9), gemm_algos.entry(64, 1024, 1536, algo_row, 0.9)]
    path = tmp_path / "algos.json"
    gemm_algos.write_table(path, torch.bfloat16, entries)
    assert json.loads(path.read_text())["device"] == torch.cuda.get_device_name()
    gemm_algos.install(gemm_algos.load(path, dev))
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(64, 1536, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(col(x), cublaslt.lt_linear(x, col.weight, algo_col))
    assert torch.equal(row(h), cublaslt.lt_linear(h, row.weight, algo_row))
    other = torch.randn(65, 1024, device="cuda", dtype=torch.bfloat16)  # a row count the table does not list
    assert torch.equal(col(other), torch.nn.functional.linear(other, col.weight))
