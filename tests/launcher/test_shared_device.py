"""Engines that share a GPU: `up` splits the memory fraction between them, and each engine counts only its own
memory against its fraction (so engines that start together on one device all find room for their KV)."""

from __future__ import annotations

import pytest

from splitserve.engine.config import EngineConfig
from splitserve.engine.runner.model_runner import device_kv_budget
from splitserve.launcher.up import (
    DEVICE_FRACTION,
    Deployment,
    UpConfig,
    engine_device,
    engine_tp_size,
    gpus_of,
    shared_device_fractions,
)

GIB = 2**30


def test_the_default_fraction_is_the_engines():
    assert EngineConfig().mem_fraction == DEVICE_FRACTION


def test_engines_of_one_gpu_split_the_default_and_an_engine_alone_keeps_its_own():
    assert shared_device_fractions([["cuda:0"], ["cuda:0"], ["cuda:1"]]) == [0.425, 0.425, None]
    assert shared_device_fractions([["cuda:0"], ["cuda:1"]]) == [None, None]
    assert shared_device_fractions([["cpu"], ["cpu"]]) == [None, None]
    # Two ranks each: the busiest GPU an engine uses sets its share.
    assert shared_device_fractions([["cuda:0", "cuda:1"], ["cuda:1", "cuda:2"]]) == [0.425, 0.425]
    # An encoder takes no fraction and leaves the others 0.85 less its 0.1 (per encoder on their GPU).
    assert shared_device_fractions([["cuda:0"], ["cuda:0"]], sized=[True, False]) == [0.75, None]
    assert shared_device_fractions([["cuda:0"], ["cuda:1"], ["cuda:1"]],
                                   sized=[True, True, False]) == [None, 0.75, None]


def test_engines_of_several_ranks_take_gpus_of_their_own_while_there_are_enough():
    assert [engine_device("cuda", i, 2, count=4) for i in range(3)] == ["cuda:0", "cuda:2", "cuda:0"]
    assert [engine_device("cuda", i, 1, count=2) for i in range(3)] == ["cuda:0", "cuda:1", "cuda:0"]
    assert engine_device("auto", 0, 2, count=0) == "cpu" and engine_device("cuda:3", 5, 2, count=8) == "cuda:3"
    assert gpus_of("cuda:2", 2) == ["cuda:2", "cuda:3"] and gpus_of("cpu", 2) == ["cpu"]
    assert engine_tp_size("--page-size 16 --tp-size 4") == 4 and engine_tp_size("--tp-size=2") == 2


@pytest.mark.parametrize("args,want", [
    ({"prefill": 1, "decode": 1}, [0.425, 0.425]),
    ({"prefill": 1, "decode": 1, "drafter": 1}, [0.283] * 3),
    ({"prefill": 1, "decode": 1, "encode": 1}, [0.375, 0.375, None]),  # an encoder sizes no KV cache
    ({"unified": 2, "engine_args": "--mem-fraction 0.3"}, []),  # the user's size wins
    ({"unified": 2, "engine_args": "--max-total-tokens=4096"}, []),
    ({"unified": 1, "engine_args": "--tp-size 2"}, [None]),  # its ranks on cuda:0 and cuda:1, alone there
])
def test_up_gives_each_engine_of_one_device_its_share(args, want, monkeypatch):
    monkeypatch.delenv("SPLITSERVE_MEM_FRACTION", raising=False)
    monkeypatch.delenv("SPLITSERVE_MAX_TOTAL_TOKENS", raising=False)
    monkeypatch.delenv("SPLITSERVE_TP_SIZE", raising=False)
    assert Deployment(UpConfig(model="tiny", device="cuda:0", **args))._shared_fractions() == want


def test_two_engines_starting_together_on_one_device_both_find_room():
    """An H200 (140 GiB), two engines of 15 GiB of weights at 0.425 each, measuring one after the other once both
    hold their weights: each gets its share. Counting every process's use instead, the second found -16 GiB."""
    total, weights, context = 140 * GIB, 15 * GIB, GIB // 2
    free = total - 2 * (weights + context)
    first = device_kv_budget(total, free, weights, 0.425)
    second = device_kv_budget(total, free - first, weights, 0.425)
    assert first == second == int(total * 0.425) - weights
    assert int(total * 0.425) - (total - (free - first)) < 0  # what the device's use left the second
    # Another process holding most of the device: what is free, less the headroom, bounds it.
    assert device_kv_budget(total, 20 * GIB, weights, 0.85) == 20 * GIB - int(total * 0.05)


def test_an_encoder_holds_two_kv_pages_whatever_its_flags():
    """An encode engine runs no text step: its KV pool is the scratch page and one, so the prefill and decode
    engines that share its GPU get the memory."""
    import torch

    from splitserve.engine.runner.model_runner import ENCODER_KV_PAGES, kv_pages_for_budget

    shape = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": torch.float32}
    for flags in ({}, {"max_total_tokens": 131072}, {"mem_fraction": 1.0}):
        encoder = EngineConfig(model="tiny", device="cpu", role="encode", **flags)
        assert kv_pages_for_budget(encoder, shape, torch.device("cpu"), 0) == ENCODER_KV_PAGES == 2
    prefill = EngineConfig(model="tiny", device="cpu", role="prefill", max_total_tokens=131072)
    assert kv_pages_for_budget(prefill, shape, torch.device("cpu"), 0) == 131072 // 16 + 1


H100 = 81559 * 2**20  # what nvidia-smi reports of an H100 80GB HBM3


@pytest.fixture(scope="module")
def llama_8b(tmp_path_factory) -> str:
    from splitserve.engine.checkpoints.model_shapes import write_shape_folder

    return str(write_shape_folder("llama-3.1-8b", tmp_path_factory.mktemp("shape")))


def test_the_weights_are_told_from_the_config(llama_8b):
    """Llama-3.1-8B's weights as the engine holds them (measured on an H100: 14.96 GiB in bfloat16, 8.46 GiB with
    --quantization fp8); None where there is no config to read."""
    from splitserve.launcher.memory_split import weight_bytes

    assert weight_bytes(llama_8b) == 16_059_990_016  # 14.957 GiB
    assert round(weight_bytes(llama_8b, "--page-size 16 --quantization fp8") / GIB, 2) == 8.46
    assert weight_bytes(llama_8b, "--quantization=fp8") == weight_bytes(llama_8b, "--quantization fp8")
    assert weight_bytes("tiny") is None and weight_bytes("/nonexistent") is None


def test_a_decode_gets_three_times_the_kv_of_the_prefill_beside_it(llama_8b):
    """The KV memory two engines of Llama-3.1-8B leave on an H100 is split 3:1 for the decode; the fractions still
    add up to the default, and each engine's KV is its fraction less its weights."""
    from splitserve.launcher.memory_split import role_weighted_fractions, weight_bytes

    w = weight_bytes(llama_8b)
    one_gpu = [["cuda:0"], ["cuda:0"]]
    prefill, decode = role_weighted_fractions(one_gpu, ["prefill", "decode"], [0.425, 0.425], DEVICE_FRACTION, 0.1,
                                              w, {"cuda:0": H100})
    assert prefill + decode == pytest.approx(DEVICE_FRACTION, abs=2e-3)
    assert decode * H100 - w == pytest.approx(3 * (prefill * H100 - w), rel=0.01)
    assert round((prefill * H100 - w) / GIB, 1) == 9.4 and round((decode * H100 - w) / GIB, 1) == 28.4
    # Two unified engines: the even split. An encoder beside them: its share comes off first.
    assert role_weighted_fractions(one_gpu, ["unified", "unified"], [0.425, 0.425], DEVICE_FRACTION, 0.1, w,
                                   {"cuda:0": H100}) == [0.425, 0.425]
    with_encoder = role_weighted_fractions([*one_gpu, ["cuda:0"]], ["prefill", "decode", "encode"],
                                           [0.375, 0.375, None], DEVICE_FRACTION, 0.1, w, {"cuda:0": H100})
    assert with_encoder[2] is None and sum(with_encoder[:2]) == pytest.approx(0.75, abs=2e-3)
    # Two ranks each, sharing cuda:1: each rank holds half the weights; the busiest GPU sets the fraction.
    tp = role_weighted_fractions([["cuda:0", "cuda:1"], ["cuda:1", "cuda:2"]], ["prefill", "decode"],
                                 [0.425, 0.425], DEVICE_FRACTION, 0.1, w, {f"cuda:{i}": H100 for i in range(3)})
    assert tp[1] * H100 - w / 2 == pytest.approx(3 * (tp[0] * H100 - w / 2), rel=0.01)


@pytest.mark.parametrize("case", ["weights unknown", "size unknown", "drafter", "weights fill the GPU"])
def test_the_even_split_stands_where_the_role_split_cannot_be_told(case, llama_8b):
    from splitserve.launcher.memory_split import role_weighted_fractions, weight_bytes

    engines, roles, even = [["cuda:0"], ["cuda:0"]], ["prefill", "decode"], [0.425, 0.425]
    weights, totals = weight_bytes(llama_8b), {"cuda:0": H100}
    if case == "weights unknown":
        weights = None
    elif case == "size unknown":
        totals = {"cuda:0": None}
    elif case == "drafter":  # another model's weights on the GPU
        engines, roles, even = [*engines, ["cuda:0"]], [*roles, "drafter"], [0.283] * 3
    else:
        totals = {"cuda:0": 20 * GIB}
    assert role_weighted_fractions(engines, roles, even, DEVICE_FRACTION, 0.1, weights, totals) is even


def test_up_splits_a_shared_gpu_by_role_for_a_model_folder(llama_8b, monkeypatch):
    """`up --prefill 1 --decode 1` of a model folder on one GPU: the decode's fraction is the larger (the device's
    size stands in for nvidia-smi's answer: this machine has no GPU)."""
    from splitserve.launcher import up
    from splitserve.launcher.memory_split import weight_bytes as weight_bytes_of

    for name in ("SPLITSERVE_MEM_FRACTION", "SPLITSERVE_MAX_TOTAL_TOKENS", "SPLITSERVE_TP_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(up, "device_total_bytes", lambda device: H100)
    assert Deployment(UpConfig(model=llama_8b, device="cuda:0", prefill=1, decode=1))._shared_fractions() == [
        0.306, 0.544]
    assert Deployment(UpConfig(model=llama_8b, device="cuda:0", unified=2))._shared_fractions() == [0.425, 0.425]
    # --decode-kv-weight 2: the decode's KV twice the prefill's; the fractions still add up to the default.
    prefill, decode = Deployment(UpConfig(model=llama_8b, device="cuda:0", prefill=1, decode=1,
                                          decode_kv_weight=2))._shared_fractions()
    w = weight_bytes_of(llama_8b)
    assert [prefill, decode] == [0.346, 0.504]
    assert decode * H100 - w == pytest.approx(2 * (prefill * H100 - w), rel=0.01)
    assert prefill + decode == pytest.approx(DEVICE_FRACTION, abs=2e-3)
    with pytest.raises(ValueError, match="--decode-kv-weight must be > 0"):
        UpConfig(model=llama_8b, decode_kv_weight=0)


def test_nvidia_smi_is_asked_for_the_gpu_an_engine_sees():
    """cuda:N counts in CUDA_VISIBLE_DEVICES; a MIG slice is not asked (nvidia-smi would give its parent's size)."""
    from splitserve.launcher.memory_split import nvidia_smi_id

    assert nvidia_smi_id("cuda:1", None) == "1" and nvidia_smi_id("cuda", None) == "0"
    assert nvidia_smi_id("cuda:1", "4,6") == "6" and nvidia_smi_id("cuda:0", "GPU-abc, GPU-def") == "GPU-abc"
    assert nvidia_smi_id("cuda:2", "4,6") is None and nvidia_smi_id("cpu", None) is None
    assert nvidia_smi_id("cuda:0", "MIG-1c2d") is None
