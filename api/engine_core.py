"""The engine core process (`serve --engine-process`): the engine loop, its role and the
detokenizer of requests with stop strings (the API server makes the others' text from their token
ids: api/server_detokenizer.py), with no HTTP server competing for this process's GIL.

The API server process spawns it with its own `serve` flags and the folder of two IPC sockets
(core_protocol.py): requests (with their image items: pixels or rows as bytes) and aborts come in
batched, every output of one engine step goes out in one message. The main thread reads the
inbound socket and answers the server's calls (health, metrics, state from the engine's
snapshots, and the role's own `core_calls`: the encode role's jobs of /v1/encode); the engine
loop runs in its own thread as in-process. A role switch (engine/role_switch.py) runs here, in a
thread of its own while it drains, and answers its call when done. The core stops on SIGTERM and
when the API server process is gone.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq
from prometheus_client import generate_latest

from splitserve.api.core_protocol import (
    FROM_CORE,
    IPC_DIR_ENV,
    ROW_KEY,
    TO_CORE,
    InboxFigures,
    image_from_wire,
    ipc_address,
    output_to_wire,
    pack,
    params_from_wire,
    unpack,
)
from splitserve.api.detokenizer import TextElsewhere
from splitserve.api.engine_client import engine_health, engine_state_report
from splitserve.api.serve import engine_role, role_switch
from splitserve.api.serve_config import parse_configs
from splitserve.api.server_detokenizer import detokenized_by_server
from splitserve.engine.engine import Engine
from splitserve.engine.grammar.compiler import InvalidGrammar
from splitserve.engine.grammar.spec import GrammarSpec
from splitserve.engine.request import Request, TokenOutput
from splitserve.engine.role_switch import RoleSwitch, RoleSwitchRefused

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often the main thread looks at its parent and the stop flag when idle


class OutputSink:
    """Outputs on their way to the API server: kept until the engine's step ends, then sent as one
    message (any thread may send; the socket is used under a lock)."""

    def __init__(self, socket: zmq.Socket) -> None:
        self._socket = socket
        self._lock = threading.Lock()
        self._rows: list[list[Any]] = []
        self._last_figures: InboxFigures | None = None

    def put(self, key: int, out: TokenOutput) -> None:
        row = output_to_wire(out)
        row[ROW_KEY] = key  # the API server's handle of the request (request ids may repeat)
        with self._lock:
            self._rows.append(row)

    def flush(self, figures: InboxFigures) -> None:
        """Sends the outputs kept so far, or the admission figures alone when they changed."""
        with self._lock:
            if not self._rows and figures == self._last_figures:
                return
            rows, self._rows = self._rows, []
            self._last_figures = figures
            self._socket.send(pack(["out", rows, [figures.received, figures.in_inbox, figures.waiting]]))

    def send(self, message: list[Any]) -> None:
        with self._lock:
            self._socket.send(pack(message))


class CoreBridge:
    """Takes the API server's batches to the engine and answers its calls."""

    def __init__(self, engine: Engine, sink: OutputSink, switch: RoleSwitch | None = None) -> None:
        self.engine = engine
        self.sink = sink
        self.switch = switch  # prefill <-> decode at run time (the API server's POST /internal/role)
        self.received = 0
        self._compiles = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._role_calls = engine.role.core_calls()  # the core side of the role's endpoints (/v1/encode)
        engine.after_step = self.flush

    def figures(self) -> InboxFigures:
        return InboxFigures(self.received, self.engine.inbox_requests, self.engine.waiting_requests)

    def flush(self) -> None:
        self.sink.flush(self.figures())

    def handle(self, ops: list[list[Any]]) -> None:
        for op in ops:
            kind = op[0]
            if kind == "add":
                self._add(*op[1:])
            elif kind == "abort":
                self.engine.abort(op[1], op[2])
            elif kind == "rpc":
                self._call(op[1], op[2], op[3])
            else:
                logger.error("unknown operation %r from the API server", kind)
        self.flush()

    def _add(self, key: int, request_id: str, prompt_ids: list[int], params: dict[str, Any],
             bootstrap_addr: str | None, bootstrap_room: int | None, images: list[list[Any]]) -> None:
        def deliver(out: TokenOutput) -> None:
            self.sink.put(key, out)

        req = Request(request_id=request_id, prompt_ids=prompt_ids, params=params_from_wire(params),
                      on_output=deliver, bootstrap_addr=bootstrap_addr, bootstrap_room=bootstrap_room,
                      images=[image_from_wire(row) for row in images])
        if detokenized_by_server(req.params):
            req.detokenizer = TextElsewhere()  # its outputs carry no text: the API server makes it
        # The server checked the bounds on figures that only overstate the inbox (it counts what it
        # sent, the core what it took): refusing here too would answer a 503 without Retry-After.
        self.engine.submit(req, admitted=True)
        self.received += 1  # only once it is in the inbox: received - in_inbox never misses an add

    def _call(self, call_id: int, name: str, arg: Any) -> None:
        try:
            if name == "flush_cache":  # the prefix cache belongs to the loop thread
                self.engine.call_soon(lambda: self._reply(call_id, True, self.engine.kv.prefix_cache.flush()))
                return
            if name == "compile_grammar":  # off the loop thread; the loop then finds it in the cache
                self._compiles.submit(self._compile, call_id, GrammarSpec(**arg))
                return
            if name in self._role_calls:
                self._reply(call_id, True, self._role_calls[name](arg))
                return
            if name == "switch_role":  # drains for seconds: off this thread, which keeps taking the server's calls
                threading.Thread(target=self._switch_role, args=(call_id, arg), name="role-switch",
                                 daemon=True).start()
                return
            answers = {"health": self._health,
                       "metrics": lambda: generate_latest(self.engine.metrics.registry),
                       "state": lambda: engine_state_report(self.engine),
                       "page_events": lambda: self.engine.page_events.since(*arg)}
            self._reply(call_id, True, answers[name]())
        except Exception as exc:
            logger.exception("call %s from the API server failed", name)
            self._reply(call_id, False, {"error": f"{name} failed in the engine core: {exc!r}"})

    def _health(self) -> list[Any]:
        ok, body = engine_health(self.engine)
        if ok and self.switch is not None:
            body.update(self.switch.status())
        return [ok, body]

    def _switch_role(self, call_id: int, arg: dict[str, Any]) -> None:
        if self.switch is None:
            self._reply(call_id, False, {"error": "this engine core has no role switch", "status": 409,
                                         "code": "role_not_switchable"})
            return
        try:
            result = asyncio.run(self.switch.switch(arg["role"], arg["settle_s"], arg["timeout_s"]))
        except RoleSwitchRefused as exc:
            self._reply(call_id, False, {"error": str(exc), "status": exc.status, "code": exc.code})
            return
        except Exception as exc:
            logger.exception("the role switch failed")
            self._reply(call_id, False, {"error": f"the role switch failed in the engine core: {exc!r}",
                                         "status": 500, "code": "role_switch_failed"})
            return
        self._role_calls = self.engine.role.core_calls()
        self._reply(call_id, True, result.as_dict())

    def _compile(self, call_id: int, spec: GrammarSpec) -> None:
        try:
            self.engine.grammar.compile(spec)
        except InvalidGrammar as exc:
            self._reply(call_id, False, {"error": str(exc), "invalid_grammar": True})
        except Exception as exc:
            self._reply(call_id, False, {"error": f"compiling the grammar failed: {exc!r}"})
        else:
            self._reply(call_id, True, None)

    def _reply(self, call_id: int, ok: bool, value: Any) -> None:
        self.sink.send(["reply", call_id, ok, value])

    def close(self) -> None:
        self._compiles.shutdown(wait=False, cancel_futures=True)


def ready_info(engine: Engine) -> dict[str, Any]:
    """What the API server needs to know of the engine to serve it."""
    return {"model_folder": str(engine.model_folder), "model_name": engine.cfg.model_name,
            "context_length": engine.context_length, "max_prompt_tokens": engine.max_prompt_tokens,
            "role_name": engine.role.name, "core_calls": sorted(engine.role.core_calls()),
            "tool_call_parser": engine.cfg.tool_call_parser, "pid": os.getpid()}


def serve_core(argv: list[str], folder: str) -> int:
    configs = parse_configs(argv)
    logging.getLogger().setLevel(configs.engine.log_level.upper())
    sys.setswitchinterval(configs.engine.gil_switch_interval_ms / 1e3)  # the loop thread and this one
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda _sig, _frame: stop.set())
    parent = os.getppid()
    context = zmq.Context()
    inbound = context.socket(zmq.PULL)
    inbound.connect(ipc_address(folder, TO_CORE))
    outbound = context.socket(zmq.PUSH)
    outbound.setsockopt(zmq.LINGER, 5000)  # the last outputs reach the server before the core exits
    outbound.connect(ipc_address(folder, FROM_CORE))
    sink = OutputSink(outbound)
    try:
        cfg, role = engine_role(configs)
        engine = Engine(cfg, role=role)
        engine.start()
    except Exception as exc:
        logger.exception("the engine core cannot start")
        sink.send(["failed", f"{type(exc).__name__}: {exc}"])
        context.destroy(linger=5000)
        return 1
    bridge = CoreBridge(engine, sink, role_switch(engine, configs))
    sink.send(["ready", ready_info(engine)])
    logger.info("engine core %d serving its API server %d", os.getpid(), parent)
    try:
        while not stop.is_set():
            if inbound.poll(POLL_MS):
                bridge.handle(unpack(inbound.recv()))
            elif os.getppid() != parent:
                logger.error("the API server process is gone: stopping the engine core")
                break
    finally:
        engine.stop()
        bridge.flush()
        bridge.close()
        context.destroy(linger=5000)
        shutil.rmtree(folder, ignore_errors=True)  # a server killed -9 could not remove it
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    sys.exit(serve_core(sys.argv[1:], os.environ[IPC_DIR_ENV]))
