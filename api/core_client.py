"""The API server's side of an engine core process (`serve --engine-process`).

`CoreClient` offers what `EngineClient` offers (generate, abort, health, metrics, state), so the
HTTP server does not know where the engine runs. Requests submitted in one event-loop turn go
out in one message; a step's outputs come back in one, which a reader thread hands to the loop
in one callback. The tokenizer and the chat template run here, and the detokenizer of every request
without stop strings (api/server_detokenizer.py: the core sends their token ids); the core
detokenizes the others, which must stop at a stop string.

If the core process dies, every request in flight ends with an error that says so, /health turns
503, and new requests fail the same way: the server never waits on a core that is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
from starlette.routing import Route

from splitserve.api.core_ops import CoreOps
from splitserve.api.core_protocol import (
    FROM_CORE,
    IPC_DIR_ENV,
    ROW_KEY,
    TO_CORE,
    CoreGone,
    InboxFigures,
    encode_call_to_wire,
    image_to_wire,
    ipc_address,
    output_from_wire,
    params_to_wire,
    unpack,
)
from splitserve.api.encode_endpoint import EncodeCall, encode_route
from splitserve.api.openai_protocol import ApiError
from splitserve.api.server_detokenizer import ServerDetokenizers, detokenized_by_server
from splitserve.engine.checkpoints.model_config import ModelConfig
from splitserve.engine.checkpoints.tokenizer import TextTokenizer
from splitserve.engine.engine import EngineOverloaded
from splitserve.engine.grammar.compiler import InvalidGrammar
from splitserve.engine.grammar.spec import GrammarSpec
from splitserve.engine.multimodal.image_items import ImageItem
from splitserve.engine.multimodal.prompt_images import image_processor_for
from splitserve.engine.request import FinishReason, TokenOutput
from splitserve.engine.role_switch import RoleSwitchRefused, SwitchResult
from splitserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from splitserve.api.serve_config import ServeConfigs

logger = logging.getLogger(__name__)

READ_POLL_MS = 100  # how often the reader thread checks that the core process still runs
CALL_TIMEOUT_S = 30.0
HEALTH_TIMEOUT_S = 5.0  # a core that does not answer /health in this long is reported unhealthy
STOP_TIMEOUT_S = 30.0


class CoreStartFailed(RuntimeError):
    """The engine core process could not start (its reason is the message)."""


class CoreRoleSwitch:
    """The core process's role switch (engine/role_switch.py, run there) as POST /internal/role sees it. While it
    runs, the server refuses new requests itself (503: the router retries them elsewhere): those it sent before
    the switch's call reach the core first (one ordered socket) and are drained there."""

    def __init__(self, client: CoreClient) -> None:
        self.client = client

    def status(self) -> dict[str, Any]:
        return {}  # the core's /health answer carries its own

    async def switch(self, role: Any, settle_s: float, timeout_s: float) -> SwitchResult:
        c = self.client
        if c._switching is not None:
            raise RoleSwitchRefused(f"a switch is in progress ({c._switching})", 409, "switch_in_progress")
        c._switching = f"the engine is switching its role to {role}; retry on another"
        try:
            result = await c._call("switch_role", {"role": role, "settle_s": settle_s, "timeout_s": timeout_s},
                                   timeout=timeout_s + CALL_TIMEOUT_S, raw_errors=True)
        except CoreCallFailed as exc:
            raise RoleSwitchRefused(exc.body["error"], int(exc.body.get("status", 500)),
                                    exc.body.get("code", "role_switch_failed")) from None
        finally:
            c._switching = None
        c.role_name = result["to_role"]
        return SwitchResult(**result)


class CoreCallFailed(RuntimeError):
    """A call the core answered with an error body (for callers that read it)."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(body.get("error", "the call failed in the engine core"))
        self.body = body


class CoreClient:
    """The engine as the HTTP server sees it, running in a core process of its own."""

    def __init__(self, proc: subprocess.Popen, context: zmq.Context, to_core: zmq.Socket, from_core: zmq.Socket,
                 folder: str, info: dict[str, Any], configs: ServeConfigs) -> None:
        self.proc = proc
        self._context = context
        self._to_core = to_core
        self._from_core = from_core
        self._folder = folder
        self.model_folder = Path(info["model_folder"])
        self.model_cfg = ModelConfig.from_checkpoint(self.model_folder)
        self.tokenizer = TextTokenizer(self.model_folder)
        self._detokenizers = ServerDetokenizers(self.tokenizer)  # used by the reader thread
        self.model_name: str = info["model_name"]
        self.context_length: int = info["context_length"]
        self.max_prompt_tokens: int = info["max_prompt_tokens"]
        self.tool_call_parser: str = info["tool_call_parser"]
        self.role_name: str = info["role_name"]  # a role switch changes it
        self._switching: str | None = None  # while a role switch runs: why new requests are refused
        self.role_switch = CoreRoleSwitch(self)
        self.core_calls: list[str] = info["core_calls"]  # the core side of the role's endpoints
        self._control_key = configs.transfer.transfer_control_key
        self._image_cfg = configs.images
        self._encode_timeout = configs.epd.encode_call_timeout_s
        self.max_inbox = configs.engine.max_inbox
        self.max_waiting = configs.engine.max_waiting_requests
        self.failure: str | None = None
        self._figures = InboxFigures(0, 0, 0)
        self._sent_adds = 0
        self._keys = itertools.count()
        self._streams: dict[int, asyncio.Queue[TokenOutput]] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._raw_error_calls: set[int] = set()  # calls whose error body goes to the caller whole
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()
        # Gone once it failed or stop() began: a send still waiting to be retried must not touch the closed socket.
        self._ops = CoreOps(to_core, lambda: self.failure is not None or self._stopping.is_set())
        self._reader = threading.Thread(target=self._read, name="core-reader", daemon=True)
        self._reader.start()

    # ---- starting and stopping ---------------------------------------------------------------

    @classmethod
    def spawn(cls, argv: list[str], configs: ServeConfigs) -> CoreClient:
        """Starts the core process with `serve`'s own flags and waits until its engine runs."""
        folder = tempfile.mkdtemp(prefix="splitserve-core-")
        context = zmq.Context()
        to_core = context.socket(zmq.PUSH)
        to_core.setsockopt(zmq.LINGER, 0)
        to_core.bind(ipc_address(folder, TO_CORE))
        from_core = context.socket(zmq.PULL)
        from_core.setsockopt(zmq.LINGER, 0)
        from_core.bind(ipc_address(folder, FROM_CORE))
        python = [sys.executable, *(["-P"] if sys.flags.safe_path else [])]
        proc = subprocess.Popen([*python, "-m", "splitserve.api.engine_core", *argv],
                                env={**os.environ, IPC_DIR_ENV: folder})
        try:
            info = _wait_ready(from_core, proc)
            return cls(proc, context, to_core, from_core, folder, info, configs)
        except BaseException:  # not started, or SIGTERM/Ctrl-C meanwhile: no core may outlive us
            _end_process(proc, STOP_TIMEOUT_S)
            context.destroy(linger=0)
            shutil.rmtree(folder, ignore_errors=True)
            raise

    def stop(self) -> None:
        """Stops the core (its engine finishes what runs with an abort) and waits for it."""
        self._stopping.set()
        _end_process(self.proc, STOP_TIMEOUT_S)
        self._reader.join(timeout=5)
        self._context.destroy(linger=0)
        shutil.rmtree(self._folder, ignore_errors=True)

    # ---- the EngineClient interface ----------------------------------------------------------

    def routes(self) -> list[Route]:
        """The role's endpoints: their HTTP side here, their engine side a call to the core."""
        if "encode" not in self.core_calls:
            return []
        vision = self.model_cfg.vision
        assert vision is not None, "the encode role runs multimodal models only"
        processor = image_processor_for(vision, self.model_folder)
        return [encode_route(self._control_key, self._image_cfg, processor, vision, self._encode,
                             self._close_encode)]

    async def _encode(self, call: EncodeCall) -> tuple[int, dict[str, Any]]:
        """/v1/encode's jobs, preprocessed here, taken by the core's encode role."""
        try:
            status, body = await self._call("encode", encode_call_to_wire(call), timeout=self._encode_timeout)
        except (TimeoutError, RuntimeError) as exc:  # CoreGone too
            message = str(exc) or f"the engine core process ({self.proc.pid}) does not answer"
            return 503, ApiError(message, status=503, kind="server_error").body()
        return status, body

    def _close_encode(self, call: EncodeCall) -> None:
        """The call failed here (timed out, its client left, not a 200): the core closes the rooms it
        opened for it, if any. Sent after the call itself, so the core has seen the call first; not
        waited for (no future: its reply is dropped)."""
        if self.failure is None:
            self._send(["rpc", next(self._keys), "encode_close", [call.key, call.rooms]])

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 bootstrap_addr: str | None = None, bootstrap_room: int | None = None,
                 images: list[ImageItem] | None = None) -> AsyncIterator[TokenOutput]:
        """As EngineClient.generate: raises EngineOverloaded (taking nothing) when the core's inbox or
        waiting queue is full, by the figures of its last message."""
        self._bind_loop()
        outputs: asyncio.Queue[TokenOutput] = asyncio.Queue()
        if self.failure is not None:
            outputs.put_nowait(_error(request_id, self.failure))
            return self._outputs(-1, request_id, outputs)
        if self._switching is not None:
            raise EngineOverloaded(self._switching)
        f = self._figures
        if (self._sent_adds - f.received) + f.in_inbox >= self.max_inbox:
            raise EngineOverloaded(f"the engine's inbox is full ({self.max_inbox} requests)")
        if f.waiting >= self.max_waiting:
            raise EngineOverloaded(f"{f.waiting} requests are waiting already "
                                   f"(--max-waiting-requests {self.max_waiting})")
        key = next(self._keys)
        self._streams[key] = outputs
        if detokenized_by_server(params):
            self._detokenizers.open(key)  # before the add goes out: its outputs find it
        self._sent_adds += 1
        self._send(["add", key, request_id, prompt_ids, params_to_wire(params), bootstrap_addr, bootstrap_room,
                    [image_to_wire(item) for item in images or []]])
        return self._outputs(key, request_id, outputs)

    def abort(self, request_id: str, reason: str) -> None:
        if self.failure is None:
            self._send(["abort", request_id, reason])

    async def health(self) -> tuple[bool, dict[str, Any]]:
        if self.failure is not None:
            return False, {"status": self.failure}
        try:
            ok, body = await self._call("health", timeout=HEALTH_TIMEOUT_S)
        except CoreGone as exc:
            return False, {"status": str(exc)}
        except TimeoutError:
            return False, {"status": f"the engine core process ({self.proc.pid}) does not answer"}
        return ok, body

    async def metrics(self) -> bytes:
        return await self._call("metrics")

    async def internal_state(self) -> dict[str, Any]:
        return {**await self._call("state"), "engine_core_pid": self.proc.pid, "engine_core_ipc_dir": self._folder}

    async def flush_cache(self) -> int:
        return await self._call("flush_cache")

    async def page_events(self, epoch: str | None, seq: int) -> dict[str, Any]:
        return await self._call("page_events", [epoch, seq])

    async def compile_grammar(self, spec: GrammarSpec) -> None:
        await self._call("compile_grammar", dataclasses.asdict(spec))

    # ---- the event loop's side ---------------------------------------------------------------

    def _bind_loop(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()

    def _send(self, op: list[Any]) -> None:
        """Queues `op` for the core (core_ops.CoreOps: one message a loop turn, never blocking the loop)."""
        self._ops.send(op)

    async def _call(self, name: str, arg: Any = None, timeout: float = CALL_TIMEOUT_S,
                    raw_errors: bool = False) -> Any:
        """The core's answer to a call; its error as RuntimeError (CoreCallFailed with `raw_errors`)."""
        if self.failure is not None:
            raise CoreGone(self.failure)
        self._bind_loop()
        call_id = next(self._keys)
        done = asyncio.get_running_loop().create_future()
        if raw_errors:
            self._raw_error_calls.add(call_id)
        self._calls[call_id] = done
        self._send(["rpc", call_id, name, arg])
        try:
            return await asyncio.wait_for(done, timeout)
        finally:
            self._calls.pop(call_id, None)
            self._raw_error_calls.discard(call_id)

    async def _outputs(self, key: int, request_id: str, outputs: asyncio.Queue[TokenOutput]
                       ) -> AsyncIterator[TokenOutput]:
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finish_reason is not None
                yield out
        finally:
            self._streams.pop(key, None)
            if not finished:
                self._detokenizers.close(key)
                self.abort(request_id, "client disconnected")

    def _dispatch(self, message: list[Any]) -> None:
        kind = message[0]
        if kind == "out":
            for row in message[1]:
                queue = self._streams.get(row[ROW_KEY])
                if queue is not None:
                    out = output_from_wire(row)
                    queue.put_nowait(out)
                    if out.finish_reason is not None:
                        del self._streams[row[ROW_KEY]]
        elif kind == "reply":
            _, call_id, ok, value = message
            done = self._calls.get(call_id)
            if done is not None and not done.done():
                if ok:
                    done.set_result(value)
                elif value.get("invalid_grammar"):
                    done.set_exception(InvalidGrammar(value["error"]))
                elif call_id in self._raw_error_calls:
                    done.set_exception(CoreCallFailed(value))
                else:
                    done.set_exception(RuntimeError(value["error"]))

    def _fail_in_flight(self) -> None:
        """On the loop: every request and call still waiting on the core ends with its failure."""
        failure = self.failure or "the engine core process is gone"
        streams, self._streams = self._streams, {}
        self._detokenizers.clear()
        for queue in streams.values():
            queue.put_nowait(_error("", failure))
        for done in self._calls.values():
            if not done.done():
                done.set_exception(CoreGone(failure))

    # ---- the reader thread -------------------------------------------------------------------

    def _read(self) -> None:
        while not self._stopping.is_set():
            try:
                if self._from_core.poll(READ_POLL_MS):
                    self._take(unpack(self._from_core.recv()))
                    continue
            except zmq.ZMQError:
                if self._stopping.is_set():
                    return
                raise
            except Exception as exc:  # a message this thread cannot take: no output would reach any stream again
                self._reader_failed(exc)
                return
            code = self.proc.poll()
            if code is not None and not self._stopping.is_set():
                self._core_died(code)
                return

    def _take(self, message: list[Any]) -> None:
        if message[0] == "out":
            self._figures = InboxFigures(*message[2])
            if not message[1]:
                return  # the figures alone
            self._detokenizers.fill(message[1])  # here, not on the event loop
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed (shutting down)
                loop.call_soon_threadsafe(self._dispatch, message)

    def _reader_failed(self, exc: Exception) -> None:
        """The reader cannot go on (a message it cannot decode or take): the requests in flight fail
        with the reason, /health turns 503, and the core, which nothing reads any more, is stopped."""
        self._fail(f"the API server could not read the engine core process's output ({exc!r})")
        logger.exception("%s: failing the requests in flight and stopping the core (%d)", self.failure, self.proc.pid)
        self.proc.terminate()

    def _core_died(self, code: int) -> None:
        how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        self._fail(f"the engine core process ({self.proc.pid}) {how}")
        logger.error("%s: failing the requests in flight; /health reports it", self.failure)

    def _fail(self, failure: str) -> None:
        """From the reader thread: `failure` is what /health and every request from now on report,
        and the requests in flight end with it (on the loop)."""
        self.failure = failure
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._fail_in_flight)


def _error(request_id: str, message: str) -> TokenOutput:
    return TokenOutput(request_id, [], "", finish_reason=FinishReason.ERROR, error=message)


def _wait_ready(from_core: zmq.Socket, proc: subprocess.Popen) -> dict[str, Any]:
    """The core's ready message; raises CoreStartFailed if it fails or exits first."""
    while True:
        if from_core.poll(READ_POLL_MS):
            message = unpack(from_core.recv())
            if message[0] == "ready":
                return message[1]
            if message[0] == "failed":
                raise CoreStartFailed(message[1])
        code = proc.poll()
        if code is not None:
            raise CoreStartFailed(f"the engine core process exited with code {code} before it was ready")


def _end_process(proc: subprocess.Popen, timeout: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is None:
            logger.error("the engine core did not stop within %.0f s: killing it", timeout)
            proc.kill()
    proc.wait()
