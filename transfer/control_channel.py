"""The ZeroMQ thread that carries control messages for one manager.

One PULL socket bound on ``transfer_control_port`` receives; one PUSH socket per peer
endpoint sends. ZeroMQ sockets are not thread-safe: a PUSH socket is used only under
``_sockets_lock`` (which also gives the memory barrier ZeroMQ asks for when a socket changes
threads). ``send`` on any thread writes the frames on the peer's socket itself when that socket
exists and nothing is queued (so nothing sent earlier can be overtaken): a worker's Success
reaches the peer without waking this thread first. Otherwise (no socket yet, or the lock busy)
it queues them and wakes this thread through a socketpair, once until the thread has woken.
The thread also calls ``on_tick`` every ``tick_s`` (heartbeats, timeouts), and closes the
socket to a peer nothing was sent to for ``idle_socket_s``.

A malformed or unauthenticated message is logged, counted in ``dropped`` and dropped; an
exception from a handler is logged; neither ends the thread.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable

import zmq

from splitserve.transfer.control_messages import ControlMessage, decode_message, encode_message
from splitserve.transfer.errors import ControlMessageError

log = logging.getLogger(__name__)

MAX_BATCH = 1000
CLOSE_LINGER_MS = 200


class ControlChannel:
    """Receives and sends control messages on a dedicated thread."""

    def __init__(self, host: str, port: int, key: bytes,
                 on_message: Callable[[ControlMessage], None], on_tick: Callable[[float], None],
                 tick_s: float, idle_socket_s: float = 60.0, name: str = "transfer-control",
                 message_types: dict[str, type] | None = None) -> None:
        self._key = key
        self._types = message_types  # None: the KV messages
        self._on_message = on_message
        self._on_tick = on_tick
        self._tick_s = tick_s
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, 64 << 20)
        if port:
            self._pull.bind(f"tcp://{host}:{port}")
        else:
            port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._push: dict[str, zmq.Socket] = {}
        self._last_used: dict[str, float] = {}
        self._idle_socket_s = idle_socket_s
        self._outbox: collections.deque[tuple[str, list[bytes] | None]] = collections.deque()
        self._sockets_lock = threading.Lock()  # held while a PUSH socket is made, used or closed
        self._wake_pending = False  # a wake-up byte is on its way: later queued sends need no other
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stopping = False
        self.dropped = 0
        self.received = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def send(self, endpoint: str, msg: ControlMessage, direct: bool = True) -> None:
        """Sends ``msg`` to ``endpoint`` now, or queues it (thread-safe, never blocks). Lost if the peer is gone.
        ``direct=False`` always queues it: ZeroMQ's send releases the GIL for each of a message's three frames,
        which costs a thread that competes for it with a busy one (a worker with the engine thread's sends)."""
        frames = encode_message(msg, self._key)
        if direct and self._sockets_lock.acquire(blocking=False):
            try:
                sock = None if self._outbox or self._stopping else self._push.get(endpoint)
                if sock is not None:
                    self._send_on(endpoint, sock, frames)
                    return
            finally:
                self._sockets_lock.release()
        self._outbox.append((endpoint, frames))
        self._wake()

    def send_raw(self, endpoint: str, frames: list[bytes]) -> None:
        """Queues raw frames (tests use it to send garbage)."""
        self._outbox.append((endpoint, frames))
        self._wake()

    def forget(self, endpoint: str) -> None:
        """Closes the socket to ``endpoint`` (queued behind earlier sends)."""
        self._outbox.append((endpoint, None))
        self._wake()

    @property
    def peer_sockets(self) -> int:
        return len(self._push)

    def close(self) -> None:
        """Stops the thread and closes every socket."""
        self._stopping = True
        self._wake()
        self._thread.join(timeout=10)
        if self._thread.is_alive():
            log.error("control thread did not stop within 10s")
            return
        with self._sockets_lock:
            for sock in self._push.values():
                sock.close(linger=CLOSE_LINGER_MS)  # the last messages (aborts) still go out
            self._push.clear()
        self._pull.close(linger=0)
        self._ctx.term()
        self._wake_r.close()
        self._wake_w.close()

    def _wake(self) -> None:
        if self._wake_pending:  # the thread has not woken from the last one yet: it flushes this too
            return
        self._wake_pending = True
        with contextlib.suppress(BlockingIOError, OSError):  # already awake (buffer full) or closing
            self._wake_w.send(b"x")

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._wake_r.fileno(), zmq.POLLIN)
        next_tick = time.monotonic()
        while not self._stopping:
            timeout_ms = max(0.0, (next_tick - time.monotonic()) * 1000)
            try:
                events = dict(poller.poll(timeout_ms))
            except zmq.ZMQError as exc:
                log.error("control poll failed: %s", exc)
                time.sleep(0.01)
                continue
            if self._wake_r.fileno() in events:
                with contextlib.suppress(BlockingIOError, OSError):
                    while self._wake_r.recv(4096):
                        pass
                # After the drain (a wake-up byte sent during it would be read with no flag left to send
                # another: queued sends would wait for a tick) and before the flush below (a send queued
                # after this wakes us again; one queued before it, which saw the flag set, is flushed).
                self._wake_pending = False
            if self._pull in events:
                self._receive_batch()
            self._flush_outbox()
            now = time.monotonic()
            if now >= next_tick and not self._stopping:
                try:
                    self._on_tick(now)
                except Exception:
                    log.exception("transfer control tick failed")
                next_tick = now + self._tick_s
                self._flush_outbox()
                for endpoint, used in list(self._last_used.items()):
                    if now - used > self._idle_socket_s:
                        self._close_idle_socket(endpoint, now)
        self._flush_outbox()

    def _close_idle_socket(self, endpoint: str, now: float) -> None:
        with self._sockets_lock:  # idle still? another thread may have just sent on it
            if now - self._last_used.get(endpoint, now) <= self._idle_socket_s:
                return
            self._last_used.pop(endpoint, None)
            sock = self._push.pop(endpoint, None)
            if sock is not None:
                sock.close(linger=0)

    def _receive_batch(self) -> None:
        for _ in range(MAX_BATCH):
            try:
                frames = self._pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                log.warning("control recv failed: %s", exc)
                return
            self.received += 1
            try:
                msg = decode_message(frames, self._key, self._types)
            except ControlMessageError as exc:
                self.dropped += 1
                log.warning("dropped control message: %s", exc)
                continue
            try:
                self._on_message(msg)
            except Exception:
                log.exception("handling %s failed", type(msg).__name__)

    def _flush_outbox(self) -> None:
        # Under the lock from each pop to its send: a direct send (see ``send``) that finds the outbox empty
        # cannot overtake a message popped but not yet sent.
        while self._outbox:
            with self._sockets_lock:
                endpoint, frames = self._outbox.popleft()
                if frames is None:
                    self._last_used.pop(endpoint, None)
                    sock = self._push.pop(endpoint, None)
                    if sock is not None:
                        sock.close(linger=0)
                    continue
                sock = self._push.get(endpoint)
                if sock is None:
                    sock = self._ctx.socket(zmq.PUSH)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.setsockopt(zmq.SNDHWM, 10000)
                    try:
                        sock.connect(endpoint)
                    except zmq.ZMQError as exc:
                        log.warning("cannot connect to control endpoint %r: %s", endpoint, exc)
                        sock.close(linger=0)
                        continue
                    self._push[endpoint] = sock
                self._send_on(endpoint, sock, frames)

    def _send_on(self, endpoint: str, sock: zmq.Socket, frames: list[bytes]) -> None:
        """Sends on ``endpoint``'s socket (``_sockets_lock`` held)."""
        self._last_used[endpoint] = time.monotonic()
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            log.warning("control queue to %s full; message dropped", endpoint)
        except zmq.ZMQError as exc:
            log.warning("control send to %s failed: %s", endpoint, exc)
