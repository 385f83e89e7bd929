"""Prefill and decode as two processes on one GPU, KV over CUDA IPC, behind the router: identical to
the unified engine on the same GPU, and every page back where it started.

Runs only where CUDA is (an H200, say); CI has no GPU and skips it.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from engine_checkpoints import write
from servers import LocalDeployment, assert_kv_back_to_start

from .test_disaggregation import TRANSFER_ARGS, generate_all, prompts_of_mixed_lengths

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# The unified reference chunks its prompts like the prefill engine (LocalDeployment gives prefill 8):
# the same kernels on the same chunks, so the only difference left is where the KV travels.
ENGINE_ARGS = ["--page-size", "4", "--max-total-tokens", "8192", "--max-running-requests", "16", "--device", "cuda",
               "--chunked-prefill-size", "8"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    checkpoint = write("llama-gqa-llama3rope", tmp_path_factory.mktemp("ckpt"))
    d = LocalDeployment(tmp_path_factory.mktemp("pd-ipc"), checkpoint, ENGINE_ARGS,
                        [*TRANSFER_ARGS, "--transfer-protocol", "cuda_ipc"])
    try:
        unified, prefill, decode = d.engine("unified"), d.engine("prefill"), d.engine("decode")
        d.wait([unified, prefill, decode])
        router = d.router([prefill], [decode])
        d.wait([router], timeout=60)
        yield {"deployment": d, "unified": unified, "prefill": prefill, "decode": decode, "router": router}
    finally:
        d.stop()


def transfer_bytes(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("splitserve_transfer_bytes_total{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_one_gpu_pd_over_cuda_ipc_equals_unified_one_by_one_and_concurrently(cluster) -> None:
    prompts = prompts_of_mixed_lengths(3)
    want = [asyncio.run(generate_all(cluster["unified"], [p], 16))[0] for p in prompts]
    got = [asyncio.run(generate_all(cluster["router"], [p], 16))[0] for p in prompts]
    assert got == want
    assert asyncio.run(generate_all(cluster["router"], prompts, 16)) == want
    assert transfer_bytes(cluster["prefill"]) > 0  # the KV did travel between the processes
    for url in (cluster["unified"], cluster["prefill"], cluster["decode"]):
        assert_kv_back_to_start(url)
