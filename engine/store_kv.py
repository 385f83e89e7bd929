"""The shared tier under the host tier: full KV pages in a Mooncake Store that every engine of a
deployment reaches, keyed by model, page layout and page hash (docs/kv_tiers.md).

- **Write-through, once.** A full page leaving this engine's device (evicted by the prefix cache: at
  the same moment as its write-back to the host tier, or instead of it without one) is copied into a
  registered host staging buffer and put into the store by a worker thread, unless this engine knows
  the store has it already (it wrote or read that key, bounded LRU). The engine thread only copies.
- **Load.** `KVCache.admit` asks for the prompt's following pages where the device and host matches
  end (`fetch`): the worker checks which exist (`batch_is_exist`) and reads the leading hits into the
  staging buffer (`batch_get_into`) while the engine thread waits at most `timeout_s`; the hits are
  then copied into fresh device pages (`load_into`) and hung in the prefix tree like host-tier hits.
- **Failures cost only hits.** Every store call runs on the worker thread (Mooncake releases the GIL).
  A call that fails at the transport level (RPC_FAIL, RPC_TIMEOUT, an exception) or a lookup that takes
  longer than `timeout_s` counts as a failure, is logged once per outage, and takes the store out of
  use for a backoff that doubles (0.5 s up to 30 s) while failures go on; meanwhile lookups answer
  "nothing" at once and write-throughs are dropped (counted). A worker still stuck in a call (a hung
  master: Mooncake's RPC gives up after 30 s) also keeps the store out of use. Setup (which Mooncake
  retries for about 90 s when the master is not there) runs on the worker too: the engine serves from
  the start and the store joins when it answers.

Events: the pages this engine put or found in the store are published as the "store" tier (engine/page_events.py)
under the store's name (address and key namespace), and reported removed when the engine learns they are gone (a
lookup finds a key missing: the master evicted it; the store failed and may come back empty) or forgets them (the
bounded set of known keys). Routers weigh such a page below one in device or host memory (router/prefix_index.py).

Memory: the staging buffer (`buffer_bytes`) is this engine's only host memory for the tier, besides
the segment it contributes to the store's pool (`segment_bytes`, Mooncake's global segment: the store's
memory is the sum of its clients' segments; the master holds metadata only and evicts at its watermark).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import queue
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from splitserve.engine.checkpoints.model_names import RANDOM_MODELS
from splitserve.engine.kv_pool import page_bytes_view, page_index
from splitserve.engine.page_events import STORE, PageEvents
from splitserve.transfer.mooncake.engine import GLOG_WARNING, LOG_LEVEL_ENV, _glog_minloglevel
from splitserve.transfer.mooncake.loopback_bind import bind_mooncake_to_loopback, loopback_for

logger = logging.getLogger(__name__)

# Mooncake's error codes (mooncake-store/include/types.h) that mean the store could not be reached,
# not that a key was missing or the pool full.
TRANSPORT_ERRORS = frozenset({-900, -901})  # RPC_FAIL, RPC_TIMEOUT
BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0
KNOWN_KEYS = 1 << 20  # page hashes this engine knows the store holds (skip their puts)
MISS_TTL_S = 0.5  # a lookup whose first page missed is not asked again for this long (a request retried)


def store_namespace(model: str, model_folder: str | Path, seed: int | None, page_size: int,
                    dtype: torch.dtype, page_shape: Sequence[int], kv_scales: str = "") -> str:
    """The key prefix of one model's pages: its name, a digest of its config (plus the seed of random
    weights and an FP8 cache's calibrated scales), the page size, the KV dtype and the page's layout. Two
    models never share a key."""
    folder = Path(model_folder)
    digest = hashlib.sha256()
    config = folder / "config.json" if folder.is_dir() else None
    if config is not None and config.exists():
        digest.update(json.dumps(json.loads(config.read_text()), sort_keys=True).encode())
    elif folder.exists():
        digest.update(f"{folder.name}:{folder.stat().st_size}".encode())
    else:
        digest.update(str(folder).encode())
    if seed is not None:
        digest.update(f"seed={seed}".encode())
    if kv_scales:
        digest.update(kv_scales.encode())
    dt = str(dtype).removeprefix("torch.")
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in model)[-48:]
    shape = "x".join(str(d) for d in page_shape)
    return f"splitserve/{name}-{digest.hexdigest()[:16]}/p{page_size}/{dt}/{shape}"


def local_address_towards(address: str) -> str:
    """The local IP the master's address is reached from (loopback for a loopback master): where the
    other clients reach this one's segment."""
    host = address.rsplit(":", 1)[0].strip("[]") or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


@dataclass(eq=False)
class _Job:
    kind: str  # "put" or "get"
    keys: list[str]
    slots: list[int]
    event: Any = None  # a CUDA event the staged pages wait for (puts)
    hashes: list[int] = field(default_factory=list)
    hits: int = 0
    finished: bool = False
    abandoned: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class StoreKV:
    """Full KV pages of the device pool `device_buffer` ([layers, 2, pages, page_size, kv_heads, head_dim])
    in a Mooncake Store whose master is at `address`, under the key prefix `namespace`."""

    def __init__(self, device_buffer: torch.Tensor, address: str, namespace: str, *,
                 metadata: str = "P2PHANDSHAKE", protocol: str = "tcp", segment_bytes: int = 512 << 20,
                 buffer_bytes: int = 64 << 20, timeout_s: float = 0.1, local_host: str | None = None,
                 events: PageEvents | None = None) -> None:
        layers, two, _, page_size, heads, dim = device_buffer.shape
        device_buffer = page_bytes_view(device_buffer)  # an FP8 pool's pages move as bytes
        self.device_buffer: torch.Tensor | None = device_buffer
        self.page_size = page_size
        self.page_shape = (layers, two, page_size, heads, dim)
        self.cuda = device_buffer.device.type == "cuda"
        self.page_bytes = layers * two * page_size * heads * dim * device_buffer.element_size()
        capacity = buffer_bytes // self.page_bytes
        if capacity < 1:
            raise ValueError(f"--kv-store-buffer-mb holds no page ({self.page_bytes} bytes a page)")
        self.capacity = capacity
        self.buffer = torch.empty((capacity, *self.page_shape), dtype=device_buffer.dtype, pin_memory=self.cuda)
        self.address, self.namespace, self.metadata, self.protocol = address, namespace, metadata, protocol
        self.segment_bytes, self.timeout_s = segment_bytes, timeout_s
        self.local_host = local_host or local_address_towards(address)
        self._lock = threading.Lock()
        self._free = list(range(capacity - 1, -1, -1))  # staging rows (under _lock)
        # Hashes the store holds (True) or is being given (False: a put in flight), oldest first (under _lock).
        self._known: OrderedDict[int, bool] = OrderedDict()
        self.events = events
        if events is not None:
            events.store = f"{address}/{namespace}"
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._misses: OrderedDict[int, float] = OrderedDict()  # first page hash -> when it missed (engine thread)
        self.lookups = 0  # lookups asked of the store
        self._seq = itertools.count()
        self._store: Any = None
        self._stopping = False
        self.ready = False  # set up and answering
        self._down_until = 0.0
        self._backoff = BACKOFF_START_S
        self._failing = False
        self._busy_since: float | None = None
        if self.cuda:
            self._write_stream = torch.cuda.Stream(device_buffer.device)
        # Counters for /metrics (the engine publishes their growth).
        self.hit_tokens = 0
        self.written_pages = 0
        self.read_pages = 0
        self.failures = 0
        self.dropped_pages = 0
        self.load_seconds: list[float] = []
        self._published = (0, 0, 0, 0, 0)
        self._thread = threading.Thread(target=self._work, name="kv-store", daemon=True)
        self._thread.start()

    # ---- state -------------------------------------------------------------------------------

    def key(self, page_hash: int) -> str:
        return f"{self.namespace}/{page_hash & 0xFFFFFFFFFFFFFFFF:016x}"

    def available(self) -> bool:
        """Whether a call may be tried now: set up, not backing off, the worker not stuck in a call."""
        if not self.ready:
            return False
        now = time.monotonic()
        if now < self._down_until:
            return False
        busy = self._busy_since
        return busy is None or now - busy < self.timeout_s

    def _failed(self, what: str) -> None:
        with self._lock:
            self.failures += 1
            self._down_until = time.monotonic() + self._backoff
            first = not self._failing
            self._failing = True
            if first:
                self._forget_all()  # it may come back empty: routers stop counting its pages
            backoff = self._backoff
            self._backoff = min(BACKOFF_MAX_S, self._backoff * 2)
        if first:
            logger.warning("KV store at %s failed (%s): serving without it, retrying in %.1f s and backing off "
                           "(further failures are counted in splitserve_kv_store_failures, not logged)",
                           self.address, what, backoff)

    def _succeeded(self) -> None:
        if not self._failing:
            return
        with self._lock:
            self._failing = False
            self._backoff = BACKOFF_START_S
            self._forget_all()  # it may have come back empty
        logger.warning("KV store at %s answers again", self.address)

    def _remember(self, hashes: Sequence[int], held: bool) -> None:
        """Notes keys the store holds (`held`) or is being given (under _lock); the oldest beyond the bound go."""
        for h in hashes:
            if held and self.events is not None and not self._known.get(h, False):
                self.events.stored(h, STORE)
            self._known[h] = held or self._known.get(h, False)
            self._known.move_to_end(h)
        while len(self._known) > KNOWN_KEYS:
            h, was_held = self._known.popitem(last=False)
            if was_held and self.events is not None:
                self.events.removed(h, STORE)

    def _forget(self, hashes: Sequence[int]) -> None:
        """Keys the store does not hold (under _lock)."""
        for h in hashes:
            if self._known.pop(h, False) and self.events is not None:
                self.events.removed(h, STORE)

    def _forget_all(self) -> None:
        self._forget(list(self._known))

    def _take(self, n: int) -> list[int]:
        with self._lock:
            n = min(n, len(self._free))
            taken = self._free[len(self._free) - n:][::-1]
            del self._free[len(self._free) - n:]
        return taken

    def _give(self, slots: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(slots)

    def _ptrs(self, slots: Sequence[int]) -> list[int]:
        base = self.buffer.data_ptr()
        return [base + s * self.page_bytes for s in slots]

    # ---- the worker --------------------------------------------------------------------------

    def _setup(self) -> bool:
        loopback = loopback_for(self.local_host) is not None
        if loopback:
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", self.local_host)  # the address it advertises
        from mooncake.store import MooncakeDistributedStore  # only with --kv-store

        if loopback:  # a loopback master: the client's own ports stay on loopback too (they take writes)
            bind_mooncake_to_loopback(self.local_host)
        level = _glog_minloglevel()
        if level is not None and not any(name in os.environ for name in LOG_LEVEL_ENV):
            level.value = max(level.value, GLOG_WARNING)  # Mooncake's INFO lines (a dozen a client) off
        store = MooncakeDistributedStore()
        rc = store.setup(self.local_host, self.metadata, self.segment_bytes, 16 << 20, self.protocol, "",
                         self.address)
        if rc != 0:
            self._failed(f"setup returned {rc}")
            return False
        rc = store.register_buffer(self.buffer.data_ptr(), self.buffer.numel() * self.buffer.element_size())
        if rc != 0:
            store.close()
            self._failed(f"register_buffer returned {rc}")
            return False
        self._store = store
        self.ready = True
        self._succeeded()
        logger.info("KV store at %s (metadata %s, %s, this engine's segment %d MiB): keys %s/...", self.address,
                    self.metadata, self.protocol, self.segment_bytes >> 20, self.namespace)
        return True

    def _work(self) -> None:
        while not self._stopping and self._store is None:
            try:
                if self._setup():
                    break
            except Exception as exc:
                self._failed(f"setup: {exc}")
            time.sleep(max(0.0, self._down_until - time.monotonic()))
        while not self._stopping:
            _, _, job = self._jobs.get()
            if job is None:
                break
            self._busy_since = time.monotonic()
            try:
                self._run(job)
            except Exception as exc:
                self._failed(f"{job.kind}: {exc}")
            finally:
                self._busy_since = None
                with self._lock:
                    job.finished = True
                    give = job.kind == "put" or job.abandoned
                if give:
                    self._give(job.slots)
                job.done.set()

    def _run(self, job: _Job) -> None:
        store = self._store
        if job.kind == "put":
            if job.event is not None:
                job.event.synchronize()
            results = store.batch_put_from(job.keys, self._ptrs(job.slots), [self.page_bytes] * len(job.keys))
            failed = [h for h, r in zip(job.hashes, results, strict=True) if r != 0]
            self.written_pages += len(job.keys) - len(failed)
            with self._lock:
                self._forget(failed)
                self._remember([h for h in job.hashes if h in self._known], held=True)
            if any(r in TRANSPORT_ERRORS for r in results):
                self._failed(f"batch_put_from returned {sorted(set(results))}")
            else:
                self._succeeded()
            return
        exists = store.batch_is_exist(job.keys)
        if exists and exists[0] < 0:
            self._failed(f"batch_is_exist returned {exists[0]}")
            return
        n = next((i for i, e in enumerate(exists) if e != 1), len(exists))
        with self._lock:  # keys it held that the master has evicted since
            self._forget([h for h, e in zip(job.hashes, exists, strict=False) if e == 0])
        if n:
            results = store.batch_get_into(job.keys[:n], self._ptrs(job.slots[:n]), [self.page_bytes] * n)
            n = next((i for i, r in enumerate(results) if r != self.page_bytes), n)
            if any(r in TRANSPORT_ERRORS for r in results):
                self._failed(f"batch_get_into returned {sorted(set(results))}")
                return
        self._succeeded()
        job.hits = n

    # ---- the engine thread -------------------------------------------------------------------

    def offer(self, evicted: Sequence[tuple[int, int]]) -> tuple[torch.cuda.Event, ...]:
        """Write-through of pages leaving the device, (page hash, device page) pairs: those the store is not
        known to hold are staged and put by the worker (dropped, counted, while it is out of use). Returns
        the event recorded after the staging copy that reads the device pages (CUDA; none on the CPU, where
        the copy is done on return, or where nothing was staged)."""
        buf = self.device_buffer
        if buf is None or not evicted:
            return ()
        with self._lock:
            new = [(h, p) for h, p in evicted if h not in self._known]
        if not new:
            return ()
        if not self.available():
            self.dropped_pages += len(new)
            return ()
        slots = self._take(len(new))
        if len(slots) < len(new):
            self.dropped_pages += len(new) - len(slots)
            new = new[:len(slots)]
        if not new:
            return ()
        hashes = [h for h, _ in new]
        with self._lock:
            self._remember(hashes, held=False)
        event = None
        if not self.cuda:
            idx = torch.tensor([p for _, p in new], dtype=torch.int64)
            self.buffer.index_copy_(0, torch.tensor(slots, dtype=torch.int64), buf.index_select(2, idx).movedim(2, 0))
        else:
            main = torch.cuda.current_stream(buf.device)
            self._write_stream.wait_stream(main)
            with torch.cuda.stream(self._write_stream):
                idx = page_index([p for _, p in new], buf.device)
                staged = buf.index_select(2, idx).movedim(2, 0).contiguous()
                for row, slot in enumerate(slots):
                    self.buffer[slot].copy_(staged[row], non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            main.wait_event(event)  # the evicted pages are not rewritten before they are read
        job = _Job("put", [self.key(h) for h in hashes], slots, event=event, hashes=hashes)
        self._jobs.put((1, next(self._seq), job))
        return () if event is None else (event,)

    def fetch(self, hashes: Sequence[int]) -> tuple[list[int], float] | None:
        """The staging rows holding the leading pages of `hashes` found in the store (read there by the
        worker), and when the lookup started; None if none (or the store is out of use, or slow)."""
        if not hashes or not self.available():
            return None
        now = time.monotonic()
        while self._misses and next(iter(self._misses.values())) < now - MISS_TTL_S:
            self._misses.popitem(last=False)
        if hashes[0] in self._misses:
            return None
        slots = self._take(len(hashes))
        if not slots:
            return None
        started = time.monotonic()
        job = _Job("get", [self.key(h) for h in hashes[:len(slots)]], slots, hashes=list(hashes[:len(slots)]))
        self._jobs.put((0, next(self._seq), job))
        job.done.wait(self.timeout_s)
        with self._lock:
            if not job.finished:
                job.abandoned = True  # the worker gives the rows back when the call returns
        if job.abandoned:
            self._failed(f"a lookup took longer than {self.timeout_s * 1000:.0f} ms")
            return None
        self.lookups += 1
        if not job.hits:
            self._give(slots)
            self._misses[hashes[0]] = time.monotonic()
            return None
        self._give(slots[job.hits:])
        with self._lock:
            self._remember(job.hashes[:job.hits], held=True)
        return slots[:job.hits], started

    def load_into(self, slots: Sequence[int], pages: Sequence[int], started: float) -> None:
        """Copies staging `slots` (from `fetch`) into device `pages`, one each, and gives the rows back. On
        CUDA the copy is queued on the compute stream (from a pinned gather of the rows: ordered before any
        later step, and the rows are free again on return)."""
        buf = self.device_buffer
        assert buf is not None and len(slots) == len(pages)
        rows = torch.empty((len(slots), *self.buffer.shape[1:]), dtype=self.buffer.dtype, pin_memory=self.cuda)
        torch.index_select(self.buffer, 0, torch.tensor(list(slots), dtype=torch.int64), out=rows)
        if self.cuda:  # from pinned memory: a pageable copy would wait for the step queued ahead of it
            rows = rows.to(buf.device, non_blocking=True)
            idx = page_index(list(pages), buf.device)
        else:
            idx = torch.tensor(list(pages), dtype=torch.int64)
        buf.index_copy_(2, idx, rows.movedim(0, 2))
        self._give(slots)
        self.read_pages += len(pages)
        self.hit_tokens += len(pages) * self.page_size
        self.load_seconds.append(time.monotonic() - started)

    def rows_free(self) -> int:
        """Staging rows not held by a write-through, a lookup or a load (all of them when idle)."""
        with self._lock:
            return len(self._free)

    def known_keys(self) -> int:
        """Keys this engine knows the store holds or is being given (bounded by KNOWN_KEYS)."""
        with self._lock:
            return len(self._known)

    def jobs_pending(self) -> bool:
        """Whether the worker has calls queued or running."""
        return not self._jobs.empty() or self._busy_since is not None

    def give_back(self, slots: Sequence[int]) -> None:
        """Staging rows from `fetch` not loaded after all."""
        self._give(slots)

    def publish(self, metrics: Any) -> None:
        """Adds the growth of the counters since the last call to the engine's metrics."""
        now = (self.hit_tokens, self.written_pages, self.read_pages, self.failures, self.dropped_pages)
        hits, written, read, failures, dropped = (a - b for a, b in zip(now, self._published, strict=True))
        self._published = now
        metrics.kv_store_hit_tokens.inc(hits)
        metrics.kv_store_written_bytes.inc(written * self.page_bytes)
        metrics.kv_store_read_bytes.inc(read * self.page_bytes)
        metrics.kv_store_failures.inc(failures)
        metrics.kv_store_dropped_pages.inc(dropped)
        for seconds in self.load_seconds:
            metrics.kv_store_load_seconds.observe(seconds)
        self.load_seconds.clear()
        metrics.kv_store_up.set(1 if self.ready and not self._failing else 0)
        metrics.kv_store_busy.set(1 if self.jobs_pending() else 0)

    def close(self) -> None:
        """Stops the worker (not waiting long for one stuck in a call) and closes the client."""
        self._stopping = True
        self._jobs.put((-1, next(self._seq), None))
        self._thread.join(timeout=2)
        if self.cuda and self.device_buffer is not None:
            torch.cuda.synchronize(self.device_buffer.device)
        self.device_buffer = None
        if self._store is not None and not self._thread.is_alive():
            try:
                self._store.close()
            except Exception:
                logger.debug("closing the KV store client failed", exc_info=True)
            self._store = None


def open_store(cfg: Any, device_buffer: torch.Tensor, model_folder: str | Path,
               events: PageEvents | None = None, kv_scales: str = "") -> StoreKV | None:
    """The engine's store tier from its config (--kv-store ADDRESS), or None."""
    if not cfg.kv_store or cfg.disable_prefix_cache:
        return None
    random_weights = cfg.model in RANDOM_MODELS or cfg.load_format == "dummy"
    layers, two, _, page_size, heads, dim = device_buffer.shape
    namespace = store_namespace(cfg.model_name, model_folder, cfg.seed if random_weights else None, page_size,
                                device_buffer.dtype, (layers, two, page_size, heads, dim), kv_scales)
    return StoreKV(device_buffer, cfg.kv_store, namespace, metadata=cfg.kv_store_metadata,
                   protocol=cfg.kv_store_protocol, segment_bytes=cfg.kv_store_segment_mb << 20,
                   buffer_bytes=cfg.kv_store_buffer_mb << 20, timeout_s=cfg.kv_store_timeout_ms / 1000,
                   events=events)


def master_binary() -> str:
    """`mooncake_master`: the one in the installed mooncake package's folder, else the one on PATH."""
    import shutil

    try:
        import mooncake

        packaged = Path(mooncake.__file__).parent / "mooncake_master"
        if packaged.exists():
            return str(packaged)
    except ImportError:
        pass
    found = shutil.which("mooncake_master")
    if found is None:
        raise FileNotFoundError("mooncake_master not found: install mooncake-transfer-engine(-non-cuda)")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def master_command(port: int, host: str = "127.0.0.1", metrics_port: int | None = None,
                   extra: Sequence[str] = ()) -> list[str]:
    """A Mooncake Store master on `host:port` (loopback by default), its admin/metrics port beside it."""
    return [master_binary(), f"--rpc_address={host}", f"--rpc_port={port}",
            f"--metrics_host={host}", f"--metrics_port={metrics_port or free_port(host)}",
            "--enable_http_metadata_server=false", *extra]


def wait_for_port(host: str, port: int, timeout: float, proc: Any = None) -> None:
    """Until `host:port` accepts a TCP connection; raises if `proc` exits first or the time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with code {proc.returncode} while starting")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"mooncake_master not listening on {host}:{port} after {timeout:.0f} s") from None
            time.sleep(0.1)


def start_master(port: int | None = None, host: str = "127.0.0.1", timeout: float = 30.0,
                 log: Any = None) -> tuple[Any, str]:
    """Starts a local master (tests, benchmarks); returns the process and its address."""
    import subprocess

    port = port or free_port(host)
    proc = subprocess.Popen(master_command(port, host), stdout=log or subprocess.DEVNULL,
                            stderr=subprocess.STDOUT if log else subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_port(host, port, timeout, proc)
    except Exception:
        proc.kill()
        proc.wait()
        raise
    return proc, f"{host}:{port}"
