"""The bootstrap server: 503 until every rank registered, conflicts refused, optional key."""

from __future__ import annotations

import httpx
import pytest
import torch

from splitserve.transfer import BootstrapError, BootstrapServer, KVLayout, layout_for_pool, make_aux_tensor
from splitserve.transfer.bootstrap_client import fetch_layouts, publish_layout


def rank_layout(rank: int, tp_size: int = 2, page_size: int = 4) -> KVLayout:
    pool = torch.zeros((1, 2, 4, page_size, 1, 8), dtype=torch.float16)
    layout = layout_for_pool(pool, make_aux_tensor(2), tp_size=tp_size, tp_rank=rank, num_kv_heads=2)
    return KVLayout(**{**layout.__dict__, "session": f"127.0.0.1:{100 + rank}",
                       "control_endpoint": f"tcp://127.0.0.1:{200 + rank}", "instance_id": f"i{rank}"})


def test_lookup_answers_503_until_every_rank_registered(bootstrap):
    rank0, rank1 = rank_layout(0), rank_layout(1)
    assert httpx.get(f"http://{bootstrap.address}/layout").status_code == 503
    publish_layout(bootstrap.address, rank1)
    resp = httpx.get(f"http://{bootstrap.address}/layout")
    assert resp.status_code == 503 and resp.json()["registered"] == [1]
    assert fetch_layouts(bootstrap.address) is None
    assert httpx.get(f"http://{bootstrap.address}/health").json()["ready"] is False
    publish_layout(bootstrap.address, rank0)
    assert fetch_layouts(bootstrap.address) == [rank0, rank1]
    assert httpx.get(f"http://{bootstrap.address}/health").json() == \
        {"status": "ok", "ready": True, "tp_size": 2, "registered": [0, 1]}


def test_reregistering_a_rank_replaces_it_and_conflicts_are_refused(bootstrap):
    publish_layout(bootstrap.address, rank_layout(0))
    publish_layout(bootstrap.address, rank_layout(0))
    with pytest.raises(BootstrapError, match="409"):
        publish_layout(bootstrap.address, rank_layout(1, page_size=8))
    resp = httpx.put(f"http://{bootstrap.address}/layout", content=b"garbage")
    assert resp.status_code == 400


def test_key_protects_the_layout_routes():
    server = BootstrapServer("127.0.0.1", 0, key="k").start()
    try:
        with pytest.raises(BootstrapError, match="401"):
            publish_layout(server.address, rank_layout(0))
        publish_layout(server.address, rank_layout(0), key="k")
        assert httpx.get(f"http://{server.address}/layout").status_code == 401
        assert httpx.get(f"http://{server.address}/health").status_code == 200
    finally:
        server.stop()


def test_unreachable_server_is_a_bootstrap_error():
    with pytest.raises(BootstrapError, match="unreachable"):
        fetch_layouts("127.0.0.1:1", timeout_s=1)
    with pytest.raises(BootstrapError, match="within"):
        publish_layout("127.0.0.1:1", rank_layout(0), timeout_s=0.2)
