"""16-bit projections under a real MPS SM cap (engine/layers/sm_cap_gemms.py): a client of a private MPS daemon
capped at 60% runs the decode shapes of an 8B model through the capped path and checks them against float32."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from splitserve.launcher.mps import CONTROL_BINARY, plan_mps

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or shutil.which(CONTROL_BINARY) is None,
                                                  reason=f"needs a CUDA device and {CONTROL_BINARY}")]

# (rows, N, K): projections and the LM head of an 8B model at decode batches; torch.mm's own pick was wrong for
# each under a 60% cap on an H100.
SHAPES = [(17, 6144, 4096), (24, 4096, 4096), (192, 128256, 4096), (192, 4096, 14336), (256, 28672, 4096)]

CLIENT = """
import json, sys, torch
from splitserve.engine.layers import cublaslt, gemm_algos, sm_cap_gemms
shapes = json.loads(sys.argv[1])
gemm_algos.install({}, sm_capped=sm_cap_gemms.sm_cap_percent() is not None)
cublaslt.prepare(torch.device("cuda"))
torch.manual_seed(0)
report = []
for rows, n, k in shapes:
    w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
    ref = x.float() @ w.float().t()
    algo = gemm_algos.lookup(x, w)
    assert algo is not None, f"no capped path: {torch.cuda.get_device_properties(0).multi_processor_count} SMs"
    capped = sm_cap_gemms.relative_error(gemm_algos.lt_linear(x, w, algo), ref)
    table = {}
    replaced = sm_cap_gemms.check_shapes([(rows, w)], table)
    checked = sm_cap_gemms.relative_error(gemm_algos.lt_linear(x, w, table[(rows, n, k, w.dtype)]), ref)
    report.append({"shape": [rows, n, k], "torch_mm": sm_cap_gemms.relative_error(torch.mm(x, w.t()), ref),
                   "capped": capped, "checked": checked, "replaced": replaced,
                   "cluster_shape": algo.config.get("cluster_shape")})
print(json.dumps({"sms": torch.cuda.get_device_properties(0).multi_processor_count, "report": report}))
"""


def test_the_capped_path_computes_every_decode_shape_right_where_cublas_own_pick_may_not(monkeypatch):
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    daemon = plan_mps("on", ["cuda:0"])
    assert daemon is not None
    proc = subprocess.Popen(daemon.command, env={**os.environ, **daemon.env}, start_new_session=True)
    try:
        assert daemon.wait_ready(proc) == "" and daemon.probe() == ""
        env = {**os.environ, **daemon.env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "60"}
        done = subprocess.run([sys.executable, "-P", "-c", CLIENT, json.dumps(SHAPES)], env=env, capture_output=True,
                              text=True, timeout=300)
    finally:
        daemon.quit(proc)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    full = torch.cuda.get_device_properties(0).multi_processor_count
    assert result["sms"] < full, f"the cap did not reach the client: {result['sms']} of {full} SMs"
    for row in result["report"]:
        assert row["checked"] <= 0.02, row  # what a capped engine's graphs run
        assert row["capped"] <= 0.02, row  # what it runs for a shape no graph has
        assert row["cluster_shape"] in (2, 3, 5), row
    print(json.dumps(result["report"], indent=1))  # torch.mm's own errors, for the record


@pytest.mark.parametrize("activation", ["dynamic-token", "static-tensor"])
def test_the_start_up_checks_pass_right_products_and_refuse_a_wrong_one(activation: str) -> None:
    # No cap here: cuBLAS is right, so the checks must pass every shape, 16-bit and FP8; then a layer whose
    # product is made wrong must be refused.
    from splitserve.engine.layers import cublaslt, gemm_algos, sm_cap_gemms
    from splitserve.engine.layers.linear import ColumnParallelLinear
    from splitserve.engine.quantization.fp8 import Fp8Scheme

    cublaslt.prepare(torch.device("cuda"))
    gemm_algos.install({})
    torch.manual_seed(0)
    weight = (torch.randn(6144, 4096, device="cuda") * 0.02).to(torch.bfloat16)
    table: dict = {}
    assert sm_cap_gemms.check_shapes([(24, weight), (192, weight)], table) == []
    assert set(table) == {(24, 6144, 4096, torch.bfloat16), (192, 6144, 4096, torch.bfloat16)}
    with torch.device("cuda"):
        layer = ColumnParallelLinear(4096, [6144], bias=False, dtype=torch.bfloat16,
                                     quant=Fp8Scheme(source="online", activation=activation), fp8_storage=True)
        layer.init_from(torch.randn(6144, 4096) * 0.02)
    assert layer.fp8
    sm_cap_gemms.check_fp8_layers([(24, layer), (192, layer)])
    right = layer.fp8_forward
    # A product with 64 output channels never written, as the wrong kernels under a cap left some.
    layer.fp8_forward = lambda x, bias: right(x, bias).index_fill_(1, torch.arange(64, device="cuda"), 0.0)
    with pytest.raises(sm_cap_gemms.CappedGemmError, match="FP8 product"):
        sm_cap_gemms.check_fp8_layers([(192, layer)])
