"""The engine loop: take requests in, schedule, run, sample, stop, emit. One thread owns it all.

Callers (the HTTP server, on its asyncio loop) hand requests and aborts over a thread-safe
inbox and receive `TokenOutput`s through each request's callback, so the model, the KV
cache and the scheduler are only ever touched by the loop thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from splitserve.api.detokenizer import IncrementalDetokenizer, add_one_token_each
from splitserve.engine.checkpoints.model_config import ModelConfig
from splitserve.engine.checkpoints.model_names import resolve_model_path
from splitserve.engine.checkpoints.tokenizer import TextTokenizer
from splitserve.engine.config import EngineConfig
from splitserve.engine.grammar.compiler import GrammarCompiler
from splitserve.engine.grammar.slots import GrammarSlots
from splitserve.engine.host_kv import HostKVPool
from splitserve.engine.kv_cache import KVCache, KVUsage
from splitserve.engine.metrics import EngineMetrics, observe_times
from splitserve.engine.page_events import PageEvents
from splitserve.engine.phase_timing import FIRST_TOKEN, SCHEDULED, TAKEN, mark, take
from splitserve.engine.request import FinishReason, Request, RequestStatus, TokenOutput
from splitserve.engine.role import ComposedRole, Role, UnifiedRole
from splitserve.engine.runner.model_runner import (
    ROW_INVARIANT_ROWS,
    ModelRunner,
    PendingStep,
    StepOutput,
    VerifiedChunk,
)
from splitserve.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from splitserve.engine.store_kv import open_store
from splitserve.engine.tp.parallel_state import SINGLE, TensorParallel, check_tp_size
from splitserve.engine.tp.supervisor import TensorParallelSupervisor

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05
HOST_LOAD_POLL_S = 0.0002  # the idle loop's poll while a request waits for its pages from the host tier
# The loop's poll of the role's transfers while the device runs a step: short next to a decode step (10-25 ms), and a
# sleep, so the threads that take the transfers' messages get the interpreter meanwhile.
RUNNING_POLL_S = 0.0002
RETRY_AFTER_S = 1  # what an overloaded engine tells clients to wait


class EngineOverloaded(RuntimeError):
    """The engine's inbox or waiting queue is full: the request was not taken (the client may retry)."""

    retry_after_s = RETRY_AFTER_S


def start_tp_workers(cfg: EngineConfig, model_folder: Path, model_cfg: ModelConfig) -> TensorParallelSupervisor:
    """Checks the model splits over --tp-size, then starts the worker ranks and joins them."""
    check_tp_size(model_cfg, cfg.tp_size)
    supervisor = TensorParallelSupervisor(cfg, model_folder)
    try:
        supervisor.start()
    except BaseException:
        supervisor.stop(graceful=False)
        raise
    return supervisor


def overrides_hook(role: Role, hook: str) -> bool:
    """Whether `role` (or one of its behaviours) has its own `hook`, not Role's empty default."""
    if isinstance(role, ComposedRole):
        return any(overrides_hook(b, hook) for b in role.behaviours)
    return getattr(type(role), hook) is not getattr(Role, hook)


@dataclass
class LaunchedStep:
    """A step queued on the device: its chunks, each request's slot and tenure at launch, its pending tokens."""

    chunks: list[ScheduledChunk]
    holds: list[tuple[int, int]]
    pending: PendingStep
    index: int  # the engine's count of launches at this one (the KV allocator's step)


def step_done(step: LaunchedStep) -> bool:
    """Whether the device has finished `step`; True too where asking raised (a device error): waiting for its result
    then raises it where the step's requests are failed."""
    try:
        return step.pending.ready()
    except RuntimeError:
        return True


@dataclass(frozen=True)
class EngineState:
    """A consistent snapshot for /internal/state, metrics and leak checks in tests."""

    running: int
    waiting: int  # admitted, not yet running: queued, or held by the role until its transfer can start
    parked: int
    kv: KVUsage


class Engine:
    """Owns the runner, the KV cache and the scheduler, and runs the loop on its own thread."""

    def __init__(self, cfg: EngineConfig, tp: TensorParallel = SINGLE, role: Role | None = None,
                 metrics: EngineMetrics | None = None) -> None:
        self.cfg = cfg
        self.model_folder = resolve_model_path(cfg.model, cfg.seed)  # a folder or a GGUF file
        self.model_cfg = ModelConfig.from_checkpoint(self.model_folder)
        self.tokenizer = TextTokenizer(self.model_folder)
        # --tp-size N: this process is rank 0 and starts ranks 1..N-1 as worker processes.
        self.tp_supervisor = start_tp_workers(cfg, self.model_folder, self.model_cfg) if cfg.tp_size > 1 else None
        if self.tp_supervisor is not None:
            tp = self.tp_supervisor.tp
        self.runner = ModelRunner(cfg, self.model_folder, self.model_cfg, tp)
        self.context_length = self.runner.context_length
        # The full pages the prefix cache holds, as events routers poll (`/internal/kv_events`).
        self.page_events = PageEvents(cfg.page_size)
        # --host-kv-tokens: pages the prefix cache evicts go to host memory and come back from there.
        self.host_kv = (HostKVPool(self.runner.kv_pool.buffer, cfg.host_kv_tokens // cfg.page_size,
                                   events=self.page_events)
                        if cfg.host_kv_tokens > 0 and not cfg.disable_prefix_cache else None)
        # --kv-store: a Mooncake Store shared by the deployment's engines, under the host tier.
        self.kv_store = open_store(cfg, self.runner.kv_pool.buffer, self.model_folder, self.page_events,
                                   self.runner.kv_scales_digest)
        self.kv = KVCache(self.runner.kv_shape.num_pages, cfg.page_size, cfg.max_running_requests,
                          self.context_length, self.runner.device, prefix_caching=not cfg.disable_prefix_cache,
                          copy_page=self.runner.copy_kv_page, page_events=self.page_events, host=self.host_kv,
                          store=self.kv_store)
        self._host_kv_published = (0, 0, 0)  # hit tokens, pages written, pages loaded: as last published
        if self.tp_supervisor is not None:
            self.tp_supervisor.attach(self.runner, self.kv.page_table, self.kv.padding_slot)
        self.runner.capture_decode_graphs(self.kv.page_table, self.kv.padding_slot)
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.max_running_requests, cfg.chunked_prefill_size, self.context_length,
                            decode_first=cfg.decode_first), self.kv
        )
        self.metrics = metrics or EngineMetrics(cfg.model_name)
        self.role: Role = role or UnifiedRole()
        # Whether the role does anything with computed chunks and tokens (the unified role does not: no
        # call per row).
        self._role_sees_chunks = overrides_hook(self.role, "on_chunk_done")
        self._role_sees_tokens = overrides_hook(self.role, "on_token")
        self._role_sees_launches = overrides_hook(self.role, "before_launch")
        self._role_polls_transfers = overrides_hook(self.role, "poll_transfers")
        self.requests: dict[str, Request] = {}
        self.refusing: str | None = None  # why new requests are refused (a role switch drains the engine)
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._closing = threading.Lock()
        self._inbox_closed = False
        self._inbox_adds = 0  # requests in the inbox (aborts and calls are never refused, never counted)
        self._taken_since_snapshot = 0  # requests the loop took in after its last snapshot
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warmed = threading.Event()
        self._warm_up_error: BaseException | None = None
        self._state = self._snapshot()
        self.steps = 0
        self._launches = 0  # launch attempts: the KV allocator's step count (a failed launch may have queued work)
        self._inflight: LaunchedStep | None = None
        # The overlap scheduler: on CUDA, step N+1 is queued before step N's tokens are read back.
        self.overlap = self.runner.device.type == "cuda" and cfg.tp_size == 1 and not cfg.disable_overlap
        self.failure: str | None = None  # set when the engine cannot run steps any more
        # Called on the loop thread after every iteration, after the role's poll when that emitted
        # outputs (so at most twice an iteration), and once the loop has ended: an output sink that
        # batches (the engine core process) sends what it holds at once.
        self.after_step: Callable[[], None] | None = None
        # Outputs emitted since after_step last ran. Counted on the loop thread; a caller's thread emits
        # only refusals once the inbox is closed, when the loop no longer reads the count.
        self._emitted_since_flush = 0
        eos = set(self.model_cfg.eos_token_ids)
        tok_eos = self.tokenizer.token_id(self.tokenizer.eos_token)
        if tok_eos is not None:
            eos.add(tok_eos)
        self.eos_token_ids = frozenset(eos)
        # Structured outputs: the server compiles a request's grammar, the full sampler applies it.
        self.grammar = GrammarCompiler(self.tokenizer.tokenizer, self.model_cfg.vocab_size, self.eos_token_ids)
        self.runner.full.grammar = GrammarSlots(self.grammar)
        self._grammar_warm_up: threading.Thread | None = None
        if self.role.serves_structured_outputs():  # a drafter's requests are verifiers' syncs: no grammar
            self._grammar_warm_up = self.grammar.warm_up_in_background()

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt this engine can run: one output token must fit in the context and the KV cache."""
        return min(self.context_length, self.kv.allocator.capacity * self.kv.page_size) - 1

    # ---- called from any thread -------------------------------------------------------------

    def prepare_speculation(self, max_draft_tokens: int, row_invariant_rows: int | None = None,
                            batch_invariant: bool = False) -> None:
        """Readies verify steps for drafts of up to `max_draft_tokens` (a behaviour that offers drafts calls
        it before the loop starts): 16-bit projections of up to `row_invariant_rows` rows (default
        ROW_INVARIANT_ROWS; 16: cuBLAS past one tile), plain decode steps' too, take the row-invariant
        path (a verify row then has plain decoding's bits); `batch_invariant` raises those rows to the
        largest verify step (max_running_requests x (K + 1)) and has those steps attend with one split
        count at every batch (a row's bits then depend neither on which requests share its step nor on
        how many: engine/layers/decode_splits.py); and the verify step's CUDA graphs are captured
        (without them verify steps run eagerly)."""
        rows = ROW_INVARIANT_ROWS if row_invariant_rows is None else row_invariant_rows
        if batch_invariant:
            rows = max(rows, self.cfg.max_running_requests * (max_draft_tokens + 1))
        self.runner.set_invariance(rows, batch_invariant, self.kv.page_table, self.kv.padding_slot)
        self.runner.capture_verify_graphs(self.kv.page_table, self.kv.padding_slot, max_draft_tokens)

    def use_row_invariant_rows(self, rows: int | None = None) -> None:
        """16-bit projections of up to `rows` rows (default ROW_INVARIANT_ROWS) take the row-invariant
        path: a row's bits then do not depend on the batch (before the loop starts: decode graphs
        are captured again)."""
        self.runner.set_row_invariant_rows(ROW_INVARIANT_ROWS if rows is None else rows, self.kv.page_table,
                                           self.kv.padding_slot)

    def start(self) -> None:
        self.role.attach(self)
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()
        self._warmed.wait()  # /health says ready only once every step kind has run on the loop's thread
        if self._warm_up_error is not None:
            self._thread.join(timeout=30)
            raise RuntimeError(f"the engine's warm-up failed: {self._warm_up_error!r}") from self._warm_up_error
        if self._grammar_warm_up is not None:
            # ... and once the grammar compiler's imports (xgrammar, transformers: seconds holding the GIL) are
            # done: a server that said ready before them served its first requests beside them (tiny model, 2-core
            # CPU: 0.40-0.45 s against 0.11 s warm).
            self._grammar_warm_up.join()
        # Everything built so far (model, graphs, tokenizer, imports: hundreds of thousands of objects)
        # lives as long as the engine: out of the cyclic collector's reach, a full collection under
        # load takes milliseconds instead of the ~0.1-0.3 s that stalled a step (and the first request).
        gc.collect()
        gc.freeze()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.role.close()
        if self.tp_supervisor is not None:
            # A loop thread still stuck in a collective must not race a stop message.
            self.tp_supervisor.stop(graceful=self._thread is None or not self._thread.is_alive())
        if self._thread is None or not self._thread.is_alive():
            gc.unfreeze()  # the runner's cycles (its graphs) must be collectable again
            if self.host_kv is not None:
                self.host_kv.close()
            if self.kv_store is not None:
                self.kv_store.close()
            self.runner.close()  # the device memory goes back: another engine may start in this process

    def submit(self, req: Request, admitted: bool = False) -> None:
        """Hands `req` to the loop; raises EngineOverloaded (taking nothing) when the inbox or the
        waiting queue is full. The waiting count is the loop's last snapshot plus what it took in
        since, so at most `max_waiting_requests + max_inbox` requests ever wait. `admitted`: the caller has checked
        the bounds already (the engine core's API server, which answers the 503 itself)."""
        with self._closing:  # the loop closes the inbox under this lock when it dies: no request is lost
            if not self._inbox_closed:
                if not admitted and self.refusing is not None:
                    raise EngineOverloaded(self.refusing)
                if not admitted and self._inbox_adds >= self.cfg.max_inbox:
                    raise EngineOverloaded(f"the engine's inbox is full ({self.cfg.max_inbox} requests)")
                if not admitted and self.waiting_requests >= self.cfg.max_waiting_requests:
                    raise EngineOverloaded(f"{self.waiting_requests} requests are waiting already "
                                           f"(--max-waiting-requests {self.cfg.max_waiting_requests})")
                self._inbox_adds += 1
                self._inbox.put(("add", req))
                self._wake.set()
                return
        self._emit(req, TokenOutput(req.request_id, [], "", finish_reason=FinishReason.ERROR,
                                    error=self.failure or "the engine is not running"))

    def refuse(self, reason: str | None) -> None:
        """From now on `submit` refuses new requests with `reason` (EngineOverloaded: clients retry
        elsewhere); None takes them again. Requests already handed over are not affected."""
        with self._closing:
            self.refusing = reason

    def use_role(self, role: Role) -> None:
        """Attaches `role` and makes it the loop's (a role switch, on the loop thread while no
        request is held: engine/role_switch.py)."""
        previous, self.cfg = self.cfg, dataclasses.replace(self.cfg, role=role.name)  # what the role reads
        try:
            role.attach(self)
        except BaseException:
            self.cfg = previous
            raise
        self._role_sees_chunks = overrides_hook(role, "on_chunk_done")
        self._role_sees_tokens = overrides_hook(role, "on_token")
        self._role_sees_launches = overrides_hook(role, "before_launch")
        self._role_polls_transfers = overrides_hook(role, "poll_transfers")
        self.role = role

    def abort(self, request_id: str, reason: str = "aborted by the client") -> None:
        self._inbox.put(("abort", (request_id, reason)))
        self._wake.set()

    def wake(self) -> None:
        """Ends the loop's idle wait now (a transfer room changed state: no need to wait for the next poll)."""
        self._wake.set()

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Runs `fn` on the loop thread before the next step (for roles' control messages)."""
        self._inbox.put(("call", fn))
        self._wake.set()

    def state(self) -> EngineState:
        return self._state

    @property
    def inbox_requests(self) -> int:
        """Requests handed to the loop and not yet taken in."""
        return self._inbox_adds

    @property
    def waiting_requests(self) -> int:
        """The last snapshot's waiting requests plus those taken in since (counted as waiting until the
        next snapshot: a snapshot a step old let a burst past --max-waiting-requests)."""
        return self._state.waiting + self._taken_since_snapshot

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failed is None

    @property
    def failed(self) -> str | None:
        """Why the engine cannot run steps any more, as soon as it is known: its own failure, or a broken
        tensor-parallel group its loop has not acted on yet. A collective outside a step (a transfer poll
        agreement) fails its rooms' requests at once and the engine only on the loop's next turn, and a client
        that got those errors could ask /health in between and be told the engine serves."""
        if self.failure is None and self.tp_supervisor is not None:
            return self.tp_supervisor.failure
        return self.failure

    # ---- the loop thread --------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            # On this thread, not the one that built the engine: cuBLAS and cuDNN handles (and cuDNN's
            # attention plans) are per thread, and making them cost the first request ~50 ms.
            self.runner.warm_up(self.kv.page_table)
        except BaseException as exc:
            logger.exception("engine warm-up failed")
            self._warm_up_error = exc
            return
        finally:
            self._warmed.set()
        logger.info("engine loop started (role %s)", self.role.name)
        try:
            self._run_loop()
        except Exception as exc:  # a bug in the loop itself: no request may hang on it
            logger.exception("engine loop crashed")
            self._inflight = None
            self._device_settled()
            self.failure = f"engine loop crashed: {exc!r}"
            self._close_inbox()
            with contextlib.suppress(Exception):
                self._fail_engine(self.failure)
            self._after_step()
            return  # logged above; /health now reports the failure
        self._close_inbox()
        self._after_step()
        logger.info("engine loop stopped")

    def _after_step(self) -> None:
        self._emitted_since_flush = 0
        if self.after_step is not None:
            try:
                self.after_step()
            except Exception:  # a broken sink must not take the loop down
                logger.exception("the engine's after-step hook failed")

    def _close_inbox(self) -> None:
        """No more requests will be taken: those still in the inbox are answered with an error."""
        with self._closing:
            self._inbox_closed = True
        for kind, item in self._take_inbox():
            if kind == "add":
                req: Request = item  # type: ignore[assignment]
                self._emit(req, TokenOutput(req.request_id, [], "", finish_reason=FinishReason.ERROR,
                                            error=self.failure or "the engine stopped"))

    def _run_loop(self) -> None:
        while not self._stop.is_set():
            if self.tp_supervisor is not None and self.failure is None:
                lost = self.tp_supervisor.check()
                if lost is not None:
                    self._fail_engine(lost)
            self._drain_inbox()
            self.role.poll()
            if self._emitted_since_flush:
                # A decode's first token (its KV just arrived) or a refusal goes out now, not after the
                # step this iteration launches and the one in flight before it have run.
                self._after_step()
            if self.host_kv is not None:
                self.kv.reap_loads()
            plan = self.scheduler.schedule()
            if plan.preempted:
                self.metrics.preemptions.inc(len(plan.preempted))
                for req in plan.preempted:
                    with self.request_fault(req, "the role's handling of its preemption"):
                        self.role.on_preempted(req)
            for req in plan.cache_full:
                self.finish(req, FinishReason.LENGTH)
            if plan and self._role_sees_launches:
                self.role.before_launch()
            launched = self._launch(plan.chunks) if plan else None
            # Overlap: the step just launched runs on the GPU while the previous one's tokens are
            # processed here (stops, detokenization, outputs).
            if self._inflight is not None:
                self._poll_while_running(self._inflight)
                self._complete(self._inflight)
                self._inflight = None
            if launched is not None:
                if self._may_overlap(launched):
                    self._inflight = launched
                else:
                    self._complete(launched)
            state = self._snapshot()
            with self._closing:
                self._state = state
                self._taken_since_snapshot = 0
            self._publish_gauges()
            self._after_step()
            if not plan:
                # Idle: sleep until a request arrives, but keep polling the role's transfers.
                # (A request waiting for a host-tier load runs as soon as it lands.)
                idle = HOST_LOAD_POLL_S if self.kv.loading else self.role.idle_poll_interval() or IDLE_WAIT_S
                self._wake.wait(timeout=idle)
                self._wake.clear()
        if self._inflight is not None:
            self._complete(self._inflight)
            self._inflight = None
        for req in list(self.requests.values()):
            self.finish(req, FinishReason.ABORT, "server shutting down")

    def _poll_while_running(self, step: LaunchedStep) -> None:
        """While the device runs a step whose tokens the loop waits for, the role's transfers are polled (only
        while it has some: `idle_poll_interval`), and what that emits goes out at once: a decode takes a request
        whose KV landed and sends its first token (the prefill's) now, not after the step. The next step is queued
        behind this one already (overlap), so the device loses nothing by the host's noticing the end late."""
        if not self._role_polls_transfers:
            return
        while self.role.idle_poll_interval() is not None and not step_done(step):
            self.role.poll_transfers()
            if self._emitted_since_flush:
                self._after_step()
            time.sleep(RUNNING_POLL_S)

    def _take_inbox(self) -> Iterator[tuple[str, object]]:
        """What callers handed over since the last look, without waiting."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _drain_inbox(self) -> None:
        for kind, item in self._take_inbox():
            if kind == "add":
                with self._closing:
                    self._inbox_adds -= 1
                    self._taken_since_snapshot += 1
                self._admit(item)  # type: ignore[arg-type]
            elif kind == "abort":
                rid, reason = item  # type: ignore[misc]
                req = self.requests.get(rid)
                if req is not None:
                    self.finish(req, FinishReason.ABORT, reason)
            elif kind == "call":
                item()  # type: ignore[operator]

    def _admit(self, req: Request) -> None:
        if self.failure is not None:
            self._emit(req, TokenOutput(req.request_id, [], "", finish_reason=FinishReason.ERROR, error=self.failure))
            return
        error = None
        if req.request_id in self.requests:
            error = f"duplicate request id {req.request_id!r}"
        elif not self.cfg.runs_text:
            error = (f"request {req.request_id}: this engine holds the image side alone (role {self.role.name}: "
                     "/v1/encode); text generation goes to a unified, prefill or decode engine")
        elif not req.prompt_ids or len(req.prompt_ids) > self.max_prompt_tokens:
            # Never queue what can never run: it would wait for pages forever.
            error = (f"request {req.request_id}: a prompt of {len(req.prompt_ids)} tokens does not fit; this engine "
                     f"takes 1 to {self.max_prompt_tokens} (context {self.context_length}, KV cache "
                     f"{self.kv.allocator.capacity * self.kv.page_size} tokens)")
        if error is not None:
            self._emit(req, TokenOutput(req.request_id, [], "", finish_reason=FinishReason.ERROR, error=error))
            return
        self.requests[req.request_id] = req
        mark(req, TAKEN)
        req.argmax_only = req.params.wants_argmax_only  # its params are final now; read every step
        self.metrics.prompt_tokens.inc(len(req.prompt_ids))
        with self.request_fault(req, "admitting the request"):
            if req.detokenizer is None:  # (the engine core gives one whose text its API server makes)
                req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.params.stop)
            if not self.role.on_arrival(req) and not req.finished:
                self.scheduler.add(req)

    def _may_overlap(self, step: LaunchedStep) -> bool:
        """Overlap only where it is exact: CUDA, one rank, and greedy requests (a penalty or a seed
        needs the previous token committed on the host before the next step samples), and no verify
        chunk (the next step is planned from how many drafts were accepted)."""
        return (self.overlap and bool(step.chunks) and self.role.allows_overlap()
                and all(c.request.argmax_only and not c.draft for c in step.chunks))

    def _launch(self, chunks: list[ScheduledChunk]) -> LaunchedStep | None:
        launched_at = time.time()  # the prompt chunks' `scheduled` stamp (on the CPU, launch runs the step)
        self._launches += 1
        self.kv.allocator.step_launched(self._launches)
        try:
            pending = self.runner.launch(chunks, self.kv.page_table)
        except Exception as exc:  # a bug or an OOM: fail this step's requests, keep serving others
            self._device_settled()  # what it queued before it raised writes nothing once this returns
            self._step_failed(chunks, exc)
            return None
        self.steps += 1
        for c in chunks:
            req = c.request
            if c.start < len(req.prompt_ids):  # a prompt chunk
                self.metrics.prompt_tokens_computed.inc(min(c.start + c.length, len(req.prompt_ids)) - c.start)
                req.publishing = True
                mark(req, SCHEDULED, launched_at)
            req.kv_len += c.length
        # A request's slot and tenure are its identity in the step: one preempted meanwhile gets its token
        # discarded, also when it was admitted again into the same slot (slots are reused last-in first-out).
        return LaunchedStep(chunks, [(c.request.slot, c.request.tenure) for c in chunks], pending, self._launches)

    def _device_settled(self) -> None:
        """Waits for every step queued on the device (whatever the wait raises: a failed device writes nothing
        more), so the pages freed meanwhile settle (PageAllocator)."""
        if self.runner.device.type == "cuda":
            import torch

            with contextlib.suppress(Exception):
                torch.cuda.synchronize(self.runner.device)
        self.kv.allocator.step_completed(self._launches)

    def _complete(self, step: LaunchedStep) -> None:
        # A request preempted meanwhile is not this step's any more (its slot or tenure changed).
        own = [c for c, hold in zip(step.chunks, step.holds, strict=True) if (c.request.slot, c.request.tenure) == hold]
        try:
            out = step.pending.result()
        except Exception as exc:
            self.kv.allocator.step_completed(step.index)
            self._step_failed(own, exc)
            return
        self.kv.allocator.step_completed(step.index)  # the pages freed while it ran are settled
        # Requests hash by identity (no id(): under an audit hook each call runs Python code).
        live = {c.request for c in own if c.request.status is RequestStatus.RUNNING}
        # Only now is the step's KV written on the device (a transfer may read it, and requests
        # with the same prompt may take its full pages from the prefix cache).
        for c in step.chunks:
            req = c.request
            if req in live:
                req.publishing = False
                if c.start < len(req.prompt_ids):
                    self.kv.publish_prompt(req, c.start + c.length)
                if self._role_sees_chunks:
                    with self.request_fault(req, "the role's handling of a computed chunk"):
                        self.role.on_chunk_done(req, c.start + c.length)
        self._process_samples(out, live)

    def _step_failed(self, chunks, exc: Exception) -> None:
        logger.exception("step failed for %d requests", len(chunks))
        error = f"engine step failed: {exc}"
        if self.tp_supervisor is not None:
            # Some ranks may be inside the step's collectives and others not: the group is
            # out of step for good. Name the dead worker if that is what broke it.
            error = (self.tp_supervisor.lost_worker(wait_s=1.0)
                     or f"a step failed on tensor-parallel rank 0 ({exc}); the ranks are out of step")
            self._fail_engine(error)
        for c in chunks:
            self.finish(c.request, FinishReason.ERROR, error)

    def _process_samples(self, out: StepOutput, live: set[Request]) -> None:
        rows = [(i, c.request, t) for i, (c, t) in enumerate(zip(out.sampled_chunks, out.tokens, strict=True))
                if c.request in live]
        self.runner.commit([out.sampled_chunks[i] for i, _, _ in rows], [t for _, _, t in rows])
        now = time.monotonic()
        self._append_sampled(rows, out, now)
        verified = [v for v in out.verified if v.chunk.request in live and not v.chunk.request.finished]
        self.runner.commit_verified(verified)
        for v in verified:
            with self.request_fault(v.chunk.request, "processing verified draft tokens"):
                self._append_verified(v, now)

    def _append_sampled(self, rows: list[tuple[int, Request, int]], out: StepOutput, now: float) -> None:
        """`append_token` for each (row, request, token) of a step, in three passes over the batch so
        the per-row work is a few list and set operations: the tokens and their timings, then the
        step's text in one tokenizer call (a token that ends a request is not text), then the stop
        checks and outputs. Same outputs, in the same order, as one `append_token` per row."""
        logprobs = out.logprobs
        top_logprobs = out.top_logprobs
        gaps: dict[float, int] = {}  # inter-token gaps of this step, counted (one histogram update each)
        texts: list[tuple[IncrementalDetokenizer, int]] = []
        stopped: set[Request] = set()
        taken: list[tuple[int, Request, int]] = []
        for row in rows:
            _, req, token = row
            if req.finished:
                continue  # finished (or preempted) while this step ran: its token is not wanted
            if req.first_token_time is None:
                self._first_token(req, now, [logprobs[row[0]]] if logprobs is not None and req.params.logprobs
                                  is not None else None)
            else:
                gap = now - (req.last_token_time or now)
                gaps[gap] = gaps.get(gap, 0) + 1
            req.last_token_time = now
            req.output_ids.append(token)
            if token in (req.stop_ids if req.stop_ids is not None else self._stop_ids(req)):
                stopped.add(req)
            elif req.detokenizer.makes_text and req.detokenizer.stopped_on is None:
                texts.append((req.detokenizer, token))
            taken.append(row)
        self.metrics.generation_tokens.inc(len(taken))
        for gap, count in gaps.items():
            observe_times(self.metrics.itl, gap, count)
        add_one_token_each([d for d, _ in texts], [t for _, t in texts])
        for i, req, token in taken:
            if req.finished:
                continue  # ended by a role hook of an earlier row
            lp = [logprobs[i]] if logprobs is not None and req.params.logprobs is not None else None
            top = top_logprobs[i] if top_logprobs is not None and lp is not None else None
            try:
                self._token_appended(req, token, lp, top, FinishReason.STOP if req in stopped else None)
            except Exception as exc:
                self._request_failed(req, "processing a sampled token", exc)

    def _append_verified(self, v: VerifiedChunk, now: float) -> None:
        """Appends a verify chunk's tokens one by one, with every stop check plain decoding makes;
        gives back the pages of the draft positions that were rejected (or cut by a stop)."""
        req = v.chunk.request
        self.metrics.spec_draft_tokens.inc(len(v.chunk.draft))
        self.metrics.spec_accepted_tokens.inc(v.accepted)
        self.metrics.spec_acceptance_length.observe(v.accepted)
        # KV holds the input token's position; each accepted draft token's KV was computed too.
        req.kv_len = v.chunk.start + 1
        for i, token in enumerate(v.tokens):
            if i:
                req.kv_len += 1
            lp = [v.logprobs[i]] if v.logprobs is not None and req.params.logprobs is not None else None
            top = [v.top_logprobs[i]] if v.top_logprobs is not None and lp is not None else None
            self.append_token(req, token, now, lp, top)
            if req.status is not RequestStatus.RUNNING:
                return  # finished (its pages went back with it) or taken over
        self.kv.shrink(req, req.total_len)

    def _stop_ids(self, req: Request) -> frozenset[int]:
        """The tokens that end `req` (its stop tokens, and EOS unless it ignores EOS), kept on it."""
        params = req.params
        req.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        return req.stop_ids

    def _first_token(self, req: Request, now: float, logprobs: list[float] | None) -> None:
        req.first_token_time = now
        mark(req, FIRST_TOKEN)
        req.first_token_logprob = logprobs[0] if logprobs else 0.0
        self.metrics.ttft.observe(now - req.arrival_time)

    def append_token(self, req: Request, token: int, now: float, logprobs: list[float] | None = None,
                     top: list[list[tuple[int, float]]] | None = None) -> None:
        """Adds one output token, checks the stop conditions and emits the delta."""
        if req.first_token_time is None:
            self._first_token(req, now, logprobs)
        else:
            self.metrics.itl.observe(now - (req.last_token_time or now))
        req.last_token_time = now
        req.output_ids.append(token)
        self.metrics.generation_tokens.inc()
        stop_ids = req.stop_ids if req.stop_ids is not None else self._stop_ids(req)
        if token in stop_ids:
            self._token_appended(req, token, logprobs, top, FinishReason.STOP)
            return
        req.detokenizer.add([token])
        self._token_appended(req, token, logprobs, top, None)

    def _token_appended(self, req: Request, token: int, logprobs: list[float] | None,
                        top: list[list[tuple[int, float]]] | None, finish: FinishReason | None) -> None:
        """The rest of `append_token` once the token is in `req.output_ids` and its text in the
        detokenizer (`finish`: STOP when it is a stop token): the stop string and length checks, the
        role's hook, the output."""
        if finish is None:
            if req.detokenizer.stopped_on is not None:
                finish = FinishReason.STOP
            elif (len(req.output_ids) >= req.params.max_new_tokens
                  or len(req.prompt_ids) + len(req.output_ids) >= self.context_length):
                finish = FinishReason.LENGTH
        if self._role_sees_tokens and self.role.on_token(req, finish):
            return  # the role took the request over (e.g. prefill hands it to decode)
        text = req.detokenizer.take_delta(final=finish is not None)
        # By position (once per row): request id, token ids, text, logprobs, top logprobs, finish, error (none),
        # prompt tokens, completion tokens, cached tokens, phase stamps (the first output's).
        self._emit(req, TokenOutput(req.request_id, [token], text, logprobs, top, finish, None,
                                    len(req.prompt_ids), len(req.output_ids), req.cached_len,
                                    take(req, self.metrics) if req.phase_marks is not None else None))
        if finish is not None:
            self._retire(req, finish)

    def _fail_engine(self, reason: str) -> None:
        """The engine cannot run steps any more (a tensor-parallel rank is gone): every request,
        running or arriving later, ends with `reason`, and /health reports it."""
        logger.error("engine failed: %s", reason)
        self.failure = reason
        for req in list(self.requests.values()):
            self.finish(req, FinishReason.ERROR, reason)

    def park(self, req: Request) -> None:
        """Takes a request out of the batch while a role waits on something for it (a transfer)."""
        self.scheduler.remove(req)
        req.status = RequestStatus.PARKED

    def finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        """Ends a request with no new token (abort, error, or a role done with it): emits the text
        still held back, frees what it holds (its KV to the prefix cache unless it failed)."""
        if req.finished:
            return
        text = req.detokenizer.take_delta(final=True) if req.detokenizer is not None else ""
        completed = reason in (FinishReason.STOP, FinishReason.LENGTH)  # (a prefill's handoff done, too)
        self._emit(req, TokenOutput(req.request_id, [], text, finish_reason=reason, error=error,
                                    prompt_tokens=len(req.prompt_ids), completion_tokens=len(req.output_ids),
                                    cached_tokens=req.cached_len,
                                    phase_marks=take(req, self.metrics if completed else None)))
        self._retire(req, reason, cache_prefix=reason is not FinishReason.ERROR)

    @contextlib.contextmanager
    def request_fault(self, req: Request, what: str) -> Iterator[None]:
        """Contains a fault of one request: an exception inside ends `req` with an error and
        nothing else; the loop and every other request carry on. Used where the loop calls
        per-request code (role hooks, detokenizer, sender/receiver calls)."""
        try:
            yield
        except Exception as exc:
            self._request_failed(req, what, exc)

    def _request_failed(self, req: Request, what: str, exc: Exception) -> None:
        """`request_fault`'s handling, for loops that catch per row themselves (no context manager
        per row): ends `req` with the error, logged."""
        logger.error("request %s: %s failed", req.request_id, what, exc_info=exc)
        if not req.finished:
            self.finish(req, FinishReason.ERROR, f"{what} failed: {exc}")

    def _retire(self, req: Request, reason: FinishReason, cache_prefix: bool = True) -> None:
        self.scheduler.remove(req)
        try:
            self.role.on_finish(req)
        except Exception:  # the role must not keep the request's pages and slot: they go back regardless
            logger.exception("request %s: the role's on_finish failed", req.request_id)
        self.kv.release(req, cache_prefix=cache_prefix)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.request_id, None)
        self.metrics.e2e.observe(time.monotonic() - req.arrival_time)
        self.metrics.finished(reason.value)

    def _emit(self, req: Request, output: TokenOutput) -> None:
        self._emitted_since_flush += 1
        try:
            req.on_output(output)
        except Exception:  # a broken consumer must not take the loop down
            logger.exception("output callback of request %s failed", req.request_id)

    def _snapshot(self) -> EngineState:
        statuses = [r.status for r in self.requests.values()]
        return EngineState(running=len(self.scheduler.running), waiting=statuses.count(RequestStatus.WAITING),
                           parked=statuses.count(RequestStatus.PARKED), kv=self.kv.usage())

    def _publish_gauges(self) -> None:
        s = self._state
        self.metrics.running.set(s.running)
        self.metrics.waiting.set(s.waiting)
        self.metrics.kv_used.set(s.kv.used_by_requests)
        self.metrics.kv_free.set(s.kv.available)
        pc = self.kv.prefix_cache
        if pc.queried_tokens:
            self.metrics.prefix_hit_rate.set(pc.hit_tokens / pc.queried_tokens)
        if self.host_kv is not None:
            self._publish_host_kv()
        if self.kv_store is not None:
            self.kv_store.publish(self.metrics)

    def _publish_host_kv(self) -> None:
        host, m = self.host_kv, self.metrics
        assert host is not None
        hits, written, loaded = self._host_kv_published
        m.host_kv_hit_tokens.inc(host.hit_tokens - hits)
        m.host_kv_written_bytes.inc((host.written_pages - written) * host.page_bytes)
        m.host_kv_loaded_bytes.inc((host.loaded_pages - loaded) * host.page_bytes)
        self._host_kv_published = (host.hit_tokens, host.written_pages, host.loaded_pages)
        for seconds in host.load_seconds:
            m.host_kv_load_seconds.observe(seconds)
        host.load_seconds.clear()
        m.host_kv_pages.set(host.held)
        m.host_kv_capacity_pages.set(host.capacity)
