"""``SpecConfig``: the draft mesh's settings (drafter and verifier sides), as flags and env vars.

The engine adds them with ``add_config_flags(parser, SpecConfig, "SPLITSERVE")``: ``drafter``
becomes ``--drafter`` and ``SPLITSERVE_DRAFTER``. The group's key is the transfer layer's
``transfer_control_key``; it signs the mesh's gRPC calls and ZeroMQ messages too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.draft_mesh.speculation_budget import CAP_STEPS, MARGIN


@dataclass(frozen=True)
class SpecConfig:
    """Settings of one verifier's or one drafter's end of the draft mesh."""

    # ---- verifier (decode, or unified with --drafter) -----------------------------------------
    drafter: list[str] = field(default_factory=list, metadata={
        "help": "draft mesh gRPC endpoints (host:port) of drafters to join (empty: those --peers-file lists, "
                "if any; else no speculation)"})
    peers_file: str = field(default="", metadata={
        "help": "the operator's peers.json: its drafter endpoints are joined when --drafter is empty"})
    num_draft_tokens: int = field(default=4, metadata={
        "help": "draft tokens verified per request and step (K); the forward covers K+1 positions"})
    verifier_rank: int | None = field(default=None, metadata={
        "help": "this verifier's rank in the group, unique per verifier (a request is draft:<rank>:<id> on a "
                "drafter); default: the pod's replica index (SPLITSERVE_REPLICA_INDEX or the pod name's "
                "ordinal), else 0"})
    draft_heartbeat_interval_s: float = field(default=0.25, metadata={
        "help": "seconds between heartbeats to each joined drafter"})
    draft_wait_ms: float = field(default=0.0, metadata={
        "help": "ms a verify step may wait for drafts still on their way (0: never wait; a drafter much "
                "faster than the target needs none, one about as fast needs some to be ahead at all)"})
    speculation_gate: bool = field(default=True, metadata={
        "help": "verify a step's drafts only while verify steps, as measured, emit tokens faster than plain "
                "decoding at that batch (off: verify whatever the drafters offer)"})
    speculation_budget: bool = field(default=True, metadata={
        "help": "the gate also bounds what speculating loses against plain decoding's measured rate, by "
                "measurement (draft_mesh/speculation_budget.py): plain first at each batch, speculating stops "
                "while its budget is spent. On by default: on an H200 (spec bench, 96-token runs, exact "
                "drafter) it kept every batch 1/8/32, K=2/4/8 cell at 1.02x of plain or better (batch 1 "
                "1.49/1.82/2.24x) where the gate alone lost 0.92-0.95x at batch 32 K=2. "
                "--no-speculation-budget: the gate's rates alone decide. Probes that get no drafts (a drafter still "
                "taking the requests in) count as no evidence, and a debt is forgiven after a bounded, growing wait, "
                "so a drafter's warm-up does not keep speculation off. What /health and the metrics show of "
                "the budget is accounted either way"})
    speculation_margin: float = field(default=MARGIN, metadata={
        "help": "with the speculation budget: of decoding time at each batch, what speculating may lose against "
                "plain decoding (probes and stints that do not pay, their first steps included)"})
    speculation_budget_steps: float = field(default=CAP_STEPS, metadata={
        "help": "with the speculation budget: most headroom saved, in plain steps of the batch (what a batch's "
                "first probe, or a stint that turns bad, may lose beyond --speculation-margin)"})
    row_invariant_rows: int | None = field(default=None, metadata={
        "help": "16-bit projections of up to this many rows take the row-invariant Triton kernel, in plain "
                "decode and verify steps alike (a verify row then has plain decoding's bits); steps with more "
                "rows go to cuBLAS, which rounds by row count. Default 32 (1.09x cuBLAS's time on an H200); "
                "past 32 rows they take the wide-tile kernel (--batch-invariant raises this to the largest "
                "verify step)"})
    batch_invariant: bool = field(default=False, metadata={
        "help": "batch-invariant mode: every decode and verify step up to the verifier's largest "
                "(--max-running-requests x (K + 1) rows) takes row-invariant projections (the skinny kernel up "
                "to 32 rows, the wide-tile kernel past them, the same bits) and attends with one split count "
                "at every batch (8: engine/layers/decode_splits.py), so a row's bits do not depend on which "
                "requests share its step nor on how many: greedy output with drafts is then plain decoding's "
                "bit for bit in bfloat16 at every batch, as long as no prompt chunk shares a step with decoding "
                "requests (such a step takes the extend path, whose rows round otherwise). GPU only; the CPU "
                "reference is exact already. It costs speed: every step takes the row-invariant projections and the "
                "one split count"})
    draft_rpc_timeout_s: float = field(default=0.5, metadata={
        "help": "seconds a Join/Heartbeat call may take before it counts as unanswered"})
    draft_silent_after_s: float = field(default=1.0, metadata={
        "help": "seconds without an answered heartbeat before a joined drafter counts as silent and its "
                "requests decode plainly (a drafter busy for a moment keeps its requests; one whose port "
                "refuses, or that no longer knows the lease, is dropped at once)"})
    # ---- drafter (--role drafter) --------------------------------------------------------------
    draft_mesh_port: int = field(default=50061, metadata={"help": "gRPC port of this drafter's DraftMesh service"})
    draft_data_port: int = field(default=0, metadata={
        "help": "ZeroMQ port this drafter receives DraftControl batches on (0: any free port)"})
    max_draft_ahead: int = field(default=17, metadata={
        "help": "most tokens a drafter drafts past a request's last commit before it waits for the next "
                "(the verifier asks for 2K+1 at most)"})
    drafter_overlap: bool = field(default=True, metadata={
        "help": "the drafter's overlap scheduler: its next step queued on the device before the last one's token is "
                "read back, so a drafter sharing its verifier's GPU holds work whenever it gets the device. On an "
                "H200 beside an 8B verifier, batch 1, K=2/4/8: 1.21/1.89/2.32x of plain decoding with it, "
                "0.91/1.06/1.02x without it (one run)"})
    drafter_prefix_cache: bool = field(default=True, metadata={
        "help": "the drafter's radix prefix cache: a synced request prefills only the part of its prompt (and "
                "committed output) the drafter has not cached, as the verifier's prefill does. A drafted "
                "token's KV is a function of the tokens before it, so cached drafts are right for any request "
                "with those tokens; a commit cuts only a request's own pages past its committed length "
                "(--no-drafter-prefix-cache: every sync prefilled whole)"})
    drafter_cudnn_attention: bool = field(default=True, metadata={
        "help": "the drafter process's one-prompt prefills may attend through cuDNN (torch SDPA's backend). "
                "cuDNN builds a plan per new sequence length (50-110 ms each on an H200), and a drafter "
                "prefills every synced request at a length of its own; the runner's cuDNN prompt buckets "
                "(engine/layers/prompt_attention.py, built at warm-up) cover the drafter's prefills, so none "
                "builds a plan while serving. --no-drafter-cudnn-attention takes the other SDPA backends (the "
                "whole process, no buckets)"})
    max_verifiers: int = field(default=64, metadata={"help": "leases a drafter grants at once (then: full)"})
    draft_lease_ttl_s: float = field(default=1.5, metadata={
        "help": "seconds a lease lives after its last heartbeat (then its requests are closed)"})

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise ValueError(f"--num-draft-tokens must be >= 1, got {self.num_draft_tokens}")
        if self.max_draft_ahead < 1:
            raise ValueError(f"--max-draft-ahead must be >= 1, got {self.max_draft_ahead}")
        if not 0.0 <= self.speculation_margin < 1.0 or self.speculation_budget_steps < 0:
            raise ValueError("--speculation-margin must be in [0, 1) and --speculation-budget-steps >= 0, got "
                             f"{self.speculation_margin} and {self.speculation_budget_steps}")
        if self.verifier_rank is not None and self.verifier_rank < 0:
            raise ValueError(f"--verifier-rank must be >= 0, got {self.verifier_rank}")
        if self.row_invariant_rows is not None and self.row_invariant_rows < 1:
            raise ValueError(f"--row-invariant-rows must be >= 1, got {self.row_invariant_rows}")
        if self.draft_wait_ms < 0:
            raise ValueError(f"--draft-wait-ms must be >= 0, got {self.draft_wait_ms}")
        for name in ("draft_heartbeat_interval_s", "draft_rpc_timeout_s", "draft_silent_after_s",
                     "draft_lease_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        for endpoint in self.drafter:
            host, _, port = endpoint.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--drafter {endpoint!r} is not host:port")


def default_verifier_rank(environ: Mapping[str, str]) -> int:
    """The pod's replica index as the operator hands it over (the label, else the StatefulSet pod
    name's "-<ordinal>" suffix), 0 outside Kubernetes."""
    index = environ.get("SPLITSERVE_REPLICA_INDEX", "")
    if index.isdigit():
        return int(index)
    ordinal = environ.get("SPLITSERVE_POD_NAME", "").rpartition("-")[2]
    return int(ordinal) if ordinal.isdigit() else 0


def drafters_from_peers(path: str) -> list[str]:
    """The drafter pods' draft-mesh endpoints (host:meshPort) listed in the operator's peers.json."""
    peers = json.loads(Path(path).read_text())
    endpoints = ((peers.get("roles") or {}).get("drafter") or {}).get("endpoints") or []
    return [f"{e['host']}:{e['meshPort']}" for e in endpoints if "meshPort" in e]
