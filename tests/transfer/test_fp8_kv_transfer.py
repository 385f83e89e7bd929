"""FP8 KV pages over Mooncake TCP on loopback: e4m3 pages land bit for bit at half a 16-bit page's bytes, and a
prefill and a decode whose KV dtypes differ refuse to pair, on both sides at once, with both dtypes named."""

from __future__ import annotations

import time

import torch
from prometheus_client import CollectorRegistry

from splitserve.transfer import KVAbortedError, KVPoll, KVReceiver, KVSender

from .conftest import poll_until_final, transfer_once

FP8 = torch.float8_e4m3fn


def test_fp8_pages_land_bit_for_bit_at_half_the_bytes_of_16_bit_pages(bootstrap, make_rank):
    registry = CollectorRegistry()
    prefill = make_rank(seed=21, registry=registry, dtype=FP8)
    decode = make_rank(registry=registry, dtype=FP8)
    assert prefill.pool.dtype == FP8 and prefill.pool.view(torch.uint8).any()
    prefill.mgr.publish_layout(bootstrap.address)
    transfer_once(prefill, decode.mgr, bootstrap.address, 41, [7, 9, 11], [1, 2, 3])
    src = prefill.pool[:, :, [7, 9, 11]].view(torch.uint8)
    assert torch.equal(decode.pool[:, :, [1, 2, 3]].view(torch.uint8), src)
    layers, _, _, page_size, heads, head_dim = prefill.pool.shape
    fp8_page = page_size * heads * head_dim  # one byte an element
    assert prefill.mgr.layout.buffers[0].page_bytes == fp8_page
    kv_bytes = 3 * fp8_page * 2 * layers  # 3 pages of K and V in every layer
    assert registry.get_sample_value("splitserve_transfer_bytes_total", {"side": "receiver"}) == kv_bytes
    sixteen_bit = make_rank(dtype=torch.bfloat16).mgr.layout.buffers[0].page_bytes
    assert sixteen_bit == 2 * fp8_page


def test_different_kv_dtypes_refuse_to_pair_on_both_sides_at_once(bootstrap, make_rank):
    """An FP8 prefill and a bfloat16 decode: the decode fails the room as it reads the prefill's layout and tells
    the prefill, which fails it too, long before its bootstrap timeout; nothing stays registered."""
    prefill = make_rank(seed=22, dtype=FP8)
    decode = make_rank(dtype=torch.bfloat16)
    prefill.mgr.publish_layout(bootstrap.address)
    sender = KVSender(prefill.mgr, bootstrap.address, 42)
    sender.init(2, 0)
    started = time.monotonic()
    receiver = KVReceiver(decode.mgr, bootstrap.address, 42)
    receiver.init()
    receiver.send_metadata([1, 2], 0)
    poll_until_final([sender, receiver], timeout_s=5)
    assert time.monotonic() - started < 2  # the bootstrap timeout is 10 s
    assert receiver.poll() == KVPoll.Failed and sender.poll() == KVPoll.Failed
    message = str(receiver.failure_exception())
    assert "dtype expected 'bfloat16', got 'float8_e4m3fn'" in message, message
    error = sender.failure_exception()
    assert isinstance(error, KVAbortedError) and "float8_e4m3fn" in str(error), error
    assert not decode.pool.view(torch.uint8).any()  # nothing written
    sender.clear()
    receiver.clear()
    for side in (prefill, decode):
        assert side.mgr.stats()["rooms"] == 0
