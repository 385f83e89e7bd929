"""A transfer-layer peer in its own process, driven by JSON lines on stdin (tests only).

Run: ``python -P transfer_peer.py '<json config>'``. It prints one ``{"ready": ...}`` line,
then for each command line ``{"id": .., "cmd": "send"|"recv"|"exit", ...}`` prints
``{"id": .., "rooms": {room: {"state", "history", "error"}}}`` once every room of the
command is final. The main loop plays the engine's scheduler: it polls rooms, sends chunks
on schedule and never blocks on the transfer layer.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

import torch

from splitserve.transfer import (
    AuxData,
    BootstrapServer,
    KVPoll,
    KVReceiver,
    KVSender,
    TransferConfig,
    aux_device,
    layout_for_pool,
    make_aux_tensor,
    new_kv_manager,
    pack_aux,
)

DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}


def fill_pool(shape: tuple[int, ...], seed: int, dtype: str = "float16") -> torch.Tensor:
    """The deterministic content of a prefill pool (the test regenerates it to check bytes)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-1000, 1000, shape, generator=gen).to(DTYPES[dtype])


def pool_shape(cfg: dict) -> tuple[int, ...]:
    return (cfg["layers"], 2, cfg["pages"], cfg["page_size"], cfg["heads"], cfg["head_dim"])


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    config = TransferConfig(**cfg.get("transfer", {}))
    shape = pool_shape(cfg)
    device = torch.device(cfg.get("device", "cpu"))
    if cfg["role"] == "prefill":
        pool = fill_pool(shape, cfg["seed"], cfg.get("dtype", "float16")).to(device)
    else:
        pool = torch.zeros(shape, dtype=DTYPES[cfg.get("dtype", "float16")], device=device)
    aux = make_aux_tensor(cfg.get("aux_slots", 64), device=aux_device(config, device))
    layout = layout_for_pool(pool, aux, tp_size=cfg.get("tp_size", 1), tp_rank=cfg.get("tp_rank", 0),
                             num_kv_heads=cfg.get("num_kv_heads"))
    server = None
    if cfg["role"] == "prefill" and cfg.get("serve_bootstrap", True):
        server = BootstrapServer("127.0.0.1", cfg.get("bootstrap_port", 0)).start()
    mgr = new_kv_manager(config, layout)
    bootstrap = cfg.get("bootstrap") or (server.address if server else "")
    if cfg["role"] == "prefill":
        mgr.publish_layout(bootstrap)
    emit({"ready": True, "pid": os.getpid(), "bootstrap": bootstrap, "control": mgr.endpoint})

    commands: dict[int, dict] = {}
    rooms: dict[int, dict] = {}
    buf = b""
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.005)
        if ready:
            data = os.read(sys.stdin.fileno(), 1 << 16)
            if not data:
                break
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                cmd = json.loads(line)
                if cmd["cmd"] == "exit":
                    mgr.close()
                    if server:
                        server.stop()
                    emit({"id": cmd.get("id"), "exited": True})
                    return
                commands[cmd["id"]] = cmd
                for spec in cmd["rooms"]:
                    rooms[spec["room"]] = start_room(mgr, bootstrap, cmd, spec, aux)
        now = time.monotonic()
        for entry in rooms.values():
            step_room(entry, now)
        for cid, cmd in list(commands.items()):
            mine = [rooms[s["room"]] for s in cmd["rooms"]]
            if all(e["done"] for e in mine):
                emit({"id": cid, "rooms": {str(e["room"]): e["report"] for e in mine}})
                for e in mine:
                    del rooms[e["room"]]
                del commands[cid]


def start_room(mgr, bootstrap: str, cmd: dict, spec: dict, aux: torch.Tensor) -> dict:
    room = spec["room"]
    entry = {"room": room, "done": False, "observed": [], "next_chunk": 0,
             "next_at": time.monotonic() + spec.get("first_delay", 0.0), "spec": spec}
    if cmd["cmd"] == "send":
        sender = KVSender(mgr, bootstrap, room)
        sender.init(len(spec["pages"]), spec["aux_index"])
        pack_aux(aux, spec["aux_index"], AuxData(*spec.get("aux", (room % 1000, -0.25, 0))))
        entry["obj"] = sender
    else:
        receiver = KVReceiver(mgr, cmd["bootstrap"], room)
        receiver.init()
        receiver.send_metadata(spec["pages"], spec["aux_index"], spec.get("prefix_len", 0))
        entry["obj"] = receiver
    return entry


def step_room(entry: dict, now: float) -> None:
    if entry["done"]:
        return
    obj = entry["obj"]
    spec = entry["spec"]
    if isinstance(obj, KVSender):
        chunks = spec.get("chunks", [len(spec["pages"])])
        if entry["next_chunk"] < len(chunks) and now >= entry["next_at"]:
            i = entry["next_chunk"]
            start = sum(chunks[:i])
            obj.send(spec["pages"][start:start + chunks[i]], i == len(chunks) - 1)
            entry["next_chunk"] += 1
            entry["next_at"] = now + spec.get("chunk_delay", 0.0)
    state = obj.poll()
    if not entry["observed"] or entry["observed"][-1] != int(state):
        entry["observed"].append(int(state))
    if state in (KVPoll.Success, KVPoll.Failed):
        error = obj.failure_exception()
        entry["report"] = {"state": int(state), "observed": entry["observed"],
                           "history": [int(s) for s in obj.state_history],
                           "error": type(error).__name__ if error else None, "message": str(error or "")}
        obj.clear()
        entry["done"] = True


if __name__ == "__main__":
    main()
