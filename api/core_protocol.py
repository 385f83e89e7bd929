"""The messages between the API server process and the engine core process (pure functions).

Both directions carry batches, msgpack-encoded (no pickle: a message is data, never code):
API -> core, one message per event-loop turn: a list of operations
  ["add", key, request_id, prompt_ids, params, bootstrap_addr, bootstrap_room, images]  (key: the
                                          server's handle of this submission; outputs carry it, not the
                                          id; images: `image_to_wire` rows, their tensors as raw bytes)
  ["abort", request_id, reason]
  ["rpc", call_id, name, arg]          (also the role's `core_calls`: "encode", `encode_call_to_wire`;
                                        "encode_close", [call key, rooms]: a failed call's rooms closed,
                                        sent without waiting, its reply dropped)
core -> API, one message per engine step (and per batch of operations the core answered):
  ["out", [output, ...], inbox]  every output of the step (its text "" for a request the API server
                                 detokenizes: server_detokenizer.py); `inbox`: the core's admission figures
  ["reply", call_id, ok, value]  an rpc's answer (`value` is the error text when not ok)
  ["ready", info] / ["failed", reason]  once, when the core has started or could not
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack

from splitserve.api.encode_endpoint import EncodeCall, EncodeJob
from splitserve.engine.grammar.spec import GrammarSpec
from splitserve.engine.multimodal.image_items import ImageItem
from splitserve.engine.request import FinishReason, TokenOutput
from splitserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

# Where the core's sockets live: the API server sets it in the core's environment.
IPC_DIR_ENV = "SPLITSERVE_CORE_IPC_DIR"
TO_CORE = "to-core"
FROM_CORE = "from-core"


class CoreGone(RuntimeError):
    """The engine core process is not running any more."""


def ipc_address(folder: str, name: str) -> str:
    return f"ipc://{folder}/{name}"


def pack(message: list[Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> list[Any]:
    # Integer map keys: a logit_bias maps token ids to biases.
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


@dataclass(frozen=True)
class InboxFigures:
    """What the API server needs to refuse requests as the in-process engine would: adds the core
    has received, how many of them still sit in the engine's inbox, requests waiting to run."""

    received: int
    in_inbox: int
    waiting: int


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    return dataclasses.asdict(params)  # the grammar spec becomes a plain dict too


def params_from_wire(fields: dict[str, Any]) -> SamplingParams:
    grammar = fields.pop("grammar", None)
    return SamplingParams(**fields, grammar=GrammarSpec(**grammar) if grammar is not None else None)


# An output row's fields that are read or set in place (engine_core.py sets the key, the API server's
# detokenizers read the tokens and the finish reason and set the text: server_detokenizer.py).
ROW_KEY, ROW_TOKENS, ROW_TEXT, ROW_FINISH = 0, 1, 2, 5


def output_to_wire(out: TokenOutput) -> list[Any]:
    return [out.request_id, out.token_ids, out.text, out.logprobs, out.top_logprobs,
            out.finish_reason.value if out.finish_reason is not None else None, out.error,
            out.prompt_tokens, out.completion_tokens, out.cached_tokens, out.phase_marks]


def output_from_wire(row: list[Any]) -> TokenOutput:
    rid, token_ids, text, logprobs, top, finish, error, prompt_tokens, completion_tokens, cached, marks = row
    return TokenOutput(rid, token_ids, text, logprobs=logprobs,
                       top_logprobs=[[(t, v) for t, v in step] for step in top] if top is not None else None,
                       finish_reason=FinishReason(finish) if finish is not None else None, error=error,
                       prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, cached_tokens=cached,
                       phase_marks=marks)


def tensor_to_wire(t: torch.Tensor) -> list[Any]:
    """[dtype, shape, bytes]: the tensor's raw bytes (bfloat16 too, which numpy cannot hold)."""
    import torch
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return [str(t.dtype).removeprefix("torch."), list(t.shape), flat.view(torch.uint8).numpy().tobytes()]


def tensor_from_wire(row: list[Any]) -> torch.Tensor:
    import torch
    dtype_name, shape, data = row
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype on the wire: {dtype_name!r}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def image_to_wire(item: ImageItem) -> list[Any]:
    """An image item as data: its description, and its pixels or rows when it has them."""
    return [item.digest, item.offset, item.num_tokens, item.encoder_addr, item.room,
            tensor_to_wire(item.pixels) if item.pixels is not None else None,
            tensor_to_wire(item.embedding) if item.embedding is not None else None,
            list(item.grid) if item.grid is not None else None]


def image_from_wire(row: list[Any]) -> ImageItem:
    digest, offset, num_tokens, encoder_addr, room, pixels, embedding, grid = row
    return ImageItem(digest, offset, num_tokens, encoder_addr=encoder_addr, room=room,
                     pixels=tensor_from_wire(pixels) if pixels is not None else None,
                     embedding=tensor_from_wire(embedding) if embedding is not None else None,
                     grid=tuple(grid) if grid is not None else None)


def encode_call_to_wire(call: EncodeCall) -> list[Any]:
    return [call.key, [[j.room, j.digest, tensor_to_wire(j.pixels), list(j.grid) if j.grid else None]
                       for j in call.jobs]]


def encode_call_from_wire(row: list[Any]) -> EncodeCall:
    key, jobs = row
    return EncodeCall(key, [EncodeJob(room, digest, tensor_from_wire(pixels), tuple(grid) if grid else None)
                            for room, digest, pixels, grid in jobs])
