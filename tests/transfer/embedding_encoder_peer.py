"""An embedding encoder (sender) in its own process, for tests that freeze it with SIGSTOP.

Run: ``python -P embedding_encoder_peer.py '<json config>'`` with ``rooms``, ``rows``, ``hidden``,
``seed``, ``pause_s`` (each item is written in two halves with that pause between) and
``transfer`` (TransferConfig fields). It opens every room with the rows of ``item_rows(seed,
room)``, prints ``{"ready": true, "endpoint": ...}``, then one ``{"concluded": room, "ok": ..,
"reason": ..}`` line per room as it ends, until stdin closes.
"""

from __future__ import annotations

import json
import os
import select
import sys

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

import torch
from prometheus_client import CollectorRegistry

from splitserve.transfer import TransferConfig
from splitserve.transfer.embedding.sender import EmbeddingChunk, EmbeddingSender
from splitserve.transfer.embedding.slots import EmbeddingSlots


def item_rows(seed: int, room: int, rows: int, hidden: int) -> torch.Tensor:
    """The rows the encoder sends for ``room`` (the test regenerates them to check bytes)."""
    return torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed * 1000 + room))


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rows, hidden, rooms = cfg["rows"], cfg["hidden"], cfg["rooms"]
    slots = EmbeddingSlots(len(rooms), rows, hidden, torch.float32)
    sender = EmbeddingSender(TransferConfig(**cfg["transfer"]), slots, CollectorRegistry(),
                             pause_halfway_s=cfg["pause_s"])
    for slot, room in enumerate(rooms):
        slots.buffer[slot] = item_rows(cfg["seed"], room, rows, hidden)
        assert sender.begin(room)
        assert sender.send(EmbeddingChunk(room, slot, rows, hidden, "float32", rows * hidden * 4))
    print(json.dumps({"ready": True, "endpoint": sender.endpoint}), flush=True)
    try:
        while not select.select([sys.stdin], [], [], 0.05)[0]:
            for done in sender.concluded():
                print(json.dumps({"concluded": done.room, "ok": done.ok, "reason": done.reason}), flush=True)
    finally:
        sender.close()


if __name__ == "__main__":
    main()
