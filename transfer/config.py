"""``TransferConfig``: the transfer layer's settings, as one dataclass the engine embeds as flags.

The engine adds these to its parser with
``add_config_flags(parser, TransferConfig, "SPLITSERVE")`` and builds the config with
``config_from_args(TransferConfig, args, "SPLITSERVE")``: ``transfer_protocol`` becomes
``--transfer-protocol`` and ``SPLITSERVE_TRANSFER_PROTOCOL``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TransferConfig:
    """Settings of one KV manager and its bootstrap server."""

    transfer_protocol: str = field(default="tcp", metadata={
        "help": "KV transport: Mooncake rdma (production; fails loudly without an RDMA device) or tcp, or "
                "cuda_ipc (prefill and decode processes on one host's GPUs: device copies into the decode's "
                "pool, mapped through CUDA IPC; fails loudly without CUDA)",
        "choices": ("rdma", "tcp", "cuda_ipc"),
    })
    transfer_devices: str = field(default="", metadata={
        "help": "RDMA devices for Mooncake, comma-separated (empty: all found); rdma only"})
    transfer_host: str = field(default="127.0.0.1", metadata={
        "help": "address this engine's transfer endpoints bind to and advertise to peers "
                "(the pod IP in Kubernetes)"})
    transfer_control_port: int = field(default=0, metadata={
        "help": "ZeroMQ port for transfer control messages (0: any free port)"})
    embedding_control_port: int = field(default=0, metadata={
        "help": "ZeroMQ port for the image embedding transfer's control messages, on encode and multimodal "
                "prefill engines (0: any free port)"})
    bootstrap_port: int = field(default=8998, metadata={
        "help": "port of the prefill's bootstrap server (prefill rank 0 serves it)"})
    prefill_waits_for_decode: bool = field(default=True, metadata={
        "help": "a prefill computes a prompt only once its decode has reserved pages for the KV (SGLang's order: "
                "a decode short of pages holds prompts back at the prefill, computed by no one); "
                "--no-prefill-waits-for-decode runs the prompt at once and its KV waits in the room for the "
                "decode's metadata, so the decode's admission overlaps the prompt's compute (vLLM's order)"})
    transfer_copy_stream: bool = field(default=True, metadata={
        "help": "cuda_ipc: KV copies run on a device stream of their own, so a prefill's copies start as soon as "
                "the step that computed their KV has finished, beside its next step, and the prefill keeps its "
                "overlap scheduling (it ships only KV whose step it has seen finish). --no-transfer-copy-stream "
                "queues them on the engine's stream, behind the steps queued before them (then see "
                "--prefill-copies-first)"})
    prefill_copies_first: bool = field(default=True, metadata={
        "help": "cuda_ipc with --no-transfer-copy-stream: the prefill launches its next step only once the copies "
                "of the KV it has shipped are queued on the device (they share the stream with its steps: queued "
                "after the next step, they would wait for its compute); its steps then run without overlap "
                "scheduling. --no-prefill-copies-first overlaps its steps and lets the copies queue where they land"})
    transfer_bootstrap_timeout_s: float = field(default=60.0, metadata={
        "help": "seconds a room may stay Bootstrapping (layout lookup / waiting for the decode's "
                "metadata)"})
    transfer_waiting_timeout_s: float = field(default=300.0, metadata={
        "help": "seconds a room may stay WaitingForInput (prefill queued / computing the prompt)"})
    transfer_timeout_s: float = field(default=60.0, metadata={
        "help": "seconds a Transferring room may go without progress (a chunk landing)"})
    transfer_write_window_s: float = field(default=360.0, metadata={
        "help": "seconds from a room's metadata to its write-by deadline: the prefill starts no write "
                "after it and the decode fails the room then"})
    transfer_fence_grace_s: float = field(default=60.0, metadata={
        "help": "seconds past the write-by deadline a write already started may still land: a failed "
                "room's decode pages are held that long at most when its prefill neither acknowledges "
                "the abort nor is seen gone"})
    transfer_fence_max_fraction: float = field(default=0.25, metadata={
        "help": "fraction of this engine's receive buffers that may be fenced (held for failed transfers "
                "a write may still reach): a decode's KV pages, a multimodal prefill's embedding slots; past "
                "it a new request from a prefill (an image item for an encoder) that holds fenced ones "
                "fails at once (others go on)"})
    transfer_heartbeat_interval_s: float = field(default=1.0, metadata={
        "help": "seconds between heartbeats to each peer with open rooms"})
    transfer_heartbeat_misses: int = field(default=5, metadata={
        "help": "a peer silent for this many heartbeat intervals is dead and its rooms fail"})
    transfer_threads: int = field(default=2, metadata={
        "help": "Mooncake write threads per peer (started on demand, ended when idle; a peer whose "
                "calls block holds only its own)"})
    transfer_writer_engines: int = field(default=8, metadata={
        "help": "Mooncake engines a sender writes through, one per decode peer up to this many (then "
                "shared): a peer frozen in its first handshake stalls only its own engine's writes "
                "(0: every write through the one shared engine)"})
    transfer_max_batch_segments: int = field(default=1024, metadata={
        "help": "segments per Mooncake batch (its TCP lane rejects batches of a few thousand)"})
    transfer_control_key: str = field(default="", metadata={
        "help": "shared secret: control messages are HMAC-signed and the bootstrap server "
                "requires it (empty: no authentication)"})

    def __post_init__(self) -> None:
        if self.transfer_protocol not in ("rdma", "tcp", "cuda_ipc"):
            raise ValueError(f"transfer_protocol must be rdma, tcp or cuda_ipc, got {self.transfer_protocol!r}")
        for name in ("transfer_bootstrap_timeout_s", "transfer_waiting_timeout_s", "transfer_timeout_s",
                     "transfer_heartbeat_interval_s", "transfer_write_window_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.transfer_fence_grace_s < 0 or not 0 < self.transfer_fence_max_fraction <= 1:
            raise ValueError("transfer_fence_grace_s must be >= 0 and transfer_fence_max_fraction in (0, 1]")
        if self.transfer_heartbeat_misses < 1:
            raise ValueError(f"transfer_heartbeat_misses must be >= 1, got {self.transfer_heartbeat_misses}")
        if self.transfer_threads < 1:
            raise ValueError(f"transfer_threads must be >= 1, got {self.transfer_threads}")
        if self.transfer_writer_engines < 0:
            raise ValueError(f"transfer_writer_engines must be >= 0, got {self.transfer_writer_engines}")
        if self.transfer_max_batch_segments < 1:
            raise ValueError("transfer_max_batch_segments must be >= 1")

    @property
    def heartbeat_timeout_s(self) -> float:
        """How long a peer may be silent before it is declared dead."""
        return self.transfer_heartbeat_interval_s * self.transfer_heartbeat_misses

    def replace(self, **changes: object) -> TransferConfig:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)
