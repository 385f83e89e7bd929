"""What the embedding sender and receiver share: the manager design of the KV transfer, reused.

One Mooncake engine with one registered slot pool (registered once, at start), one ZeroMQ control
channel speaking the embedding messages in the KV wire format (signed with the group's key), the
KV heartbeats (`PeerLiveness`), and one worker thread for Mooncake writes (they may block), so
the engine loop never waits on the network. Every state change happens under ``self.lock``,
which is never held across I/O.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from splitserve.transfer.config import TransferConfig
from splitserve.transfer.control_channel import ControlChannel
from splitserve.transfer.control_messages import ControlMessage, Ping, Pong
from splitserve.transfer.embedding.messages import EMBEDDING_MESSAGE_TYPES
from splitserve.transfer.embedding.metrics import EmbeddingMetrics, embedding_metrics
from splitserve.transfer.embedding.slots import EmbeddingSlots
from splitserve.transfer.mooncake.engine import MooncakeEngine
from splitserve.transfer.peer_liveness import PeerLiveness

log = logging.getLogger(__name__)

DTYPE_NAMES = {"float32", "bfloat16", "float16"}


class EmbeddingEndpoint:
    """Mooncake + control channel + heartbeats + a writer thread around one slot pool."""

    def __init__(self, config: TransferConfig, slots: EmbeddingSlots, name: str,
                 metrics_registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.slots = slots
        self.instance_id = secrets.token_hex(8)
        self.lock = threading.RLock()
        self.metrics: EmbeddingMetrics = embedding_metrics(metrics_registry)
        self.engine = MooncakeEngine(config.transfer_host, config.transfer_protocol, config.transfer_devices)
        try:
            self.engine.register(slots.ptr, slots.nbytes)
            self.liveness = PeerLiveness(config.transfer_heartbeat_interval_s, config.transfer_heartbeat_misses)
            self._ping_seq = 0
            self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
            self.channel = ControlChannel(config.transfer_host, config.embedding_control_port,
                                          config.transfer_control_key.encode(), self._on_message, self._on_tick,
                                          min(0.05, config.transfer_heartbeat_interval_s / 4),
                                          idle_socket_s=2 * config.heartbeat_timeout_s, name=f"{name}-control",
                                          message_types=EMBEDDING_MESSAGE_TYPES)
        except Exception:
            self.engine.close()
            raise
        self._worker = threading.Thread(target=self._run_jobs, name=f"{name}-writer", daemon=True)
        self._worker.start()
        self._closed = False
        log.info("%s: session %s, control %s, %d slots of %d bytes", name, self.engine.session_id,
                 self.channel.endpoint, slots.buffer.shape[0], slots.slot_bytes)

    @property
    def endpoint(self) -> str:
        """The control endpoint peers address (``tcp://host:port``)."""
        return self.channel.endpoint

    def send_control(self, endpoint: str, msg: ControlMessage) -> None:
        self.channel.send(endpoint, msg)

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        """Stops the threads and unregisters the slot pool; the caller keeps `slots` alive until then."""
        with self.lock:
            if self._closed:
                return
            self._closed = True
            self.on_close_locked()
        self._jobs.put(None)
        self._worker.join(timeout=5)
        self.channel.close()
        self.engine.close()

    # ---- hooks of the two sides (called with the lock held) ------------------------------------

    def on_message_locked(self, msg: ControlMessage, now: float) -> None:
        raise NotImplementedError

    def on_tick_locked(self, now: float) -> None:
        """Deadlines, retries."""

    def on_heard_locked(self, endpoint: str, instance: str) -> None:
        """Any message from ``endpoint`` (Ping and Pong included), sent by process ``instance``."""

    def on_peer_dead_locked(self, endpoint: str) -> None:
        """Every item bound to ``endpoint`` fails."""

    def on_close_locked(self) -> None:
        """Fail what is open."""

    # ---- threads ---------------------------------------------------------------------------

    def _on_message(self, msg: ControlMessage) -> None:
        now = time.monotonic()
        with self.lock:
            restarted = self.liveness.heard(msg.reply_to, msg.instance, now)
            if restarted is not None:
                self.on_peer_dead_locked(msg.reply_to)
            self.on_heard_locked(msg.reply_to, msg.instance)
            if isinstance(msg, Ping):
                self.channel.send(msg.reply_to, Pong(self.endpoint, self.instance_id, msg.seq))
            elif not isinstance(msg, Pong):
                self.on_message_locked(msg, now)

    def _on_tick(self, now: float) -> None:
        with self.lock:
            for endpoint in self.liveness.pings_due(now):
                self._ping_seq += 1
                self.channel.send(endpoint, Ping(self.endpoint, self.instance_id, self._ping_seq))
            for endpoint in self.liveness.expire(now):
                log.warning("embedding peer %s silent for %.1fs", endpoint, self.liveness.timeout_s)
                self.on_peer_dead_locked(endpoint)
                self.channel.forget(endpoint)
            self.on_tick_locked(now)

    def _run_jobs(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                job()
            except Exception:
                log.exception("embedding write job failed")
