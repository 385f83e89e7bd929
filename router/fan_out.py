"""n > 1 and batched prompts through a router whose engines take one sequence per request.

A disaggregated pair carries one sequence per bootstrap room, so the router splits such a
request into one single-sequence request per choice (prompt-major, as an engine numbers them:
choice p * n + j is sample j of prompt p), sends them all at once, and merges the answers:
choices renumbered in order, usage summed (a prompt's tokens counted once, not once per sample),
streams interleaved as their chunks arrive. Sample j of a seeded request gets seed + j, as in
the engine, so the n samples differ and each is reproducible.

The fan-out only needs a way to send one sequence and get a Starlette response back, so it
works with whatever routing policy (pairing, retries, health) the router applies per sequence
(the router sends the samples of one prompt to one prefill, whose prefix cache then computes
the prompt once).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse, Response, StreamingResponse

from splitserve.api.openai_protocol import MAX_N, ApiError, samples_usage

MAX_SEQUENCES = 256  # choices of one fanned-out request (prompts x n)


@dataclass(frozen=True)
class Sequence:
    """One choice of the client's request: its own body, and where it sits in the answer."""

    index: int
    prompt_index: int
    sample: int
    body: dict[str, Any]


SendOne = Callable[[Sequence], Awaitable[Response]]


def split_sequences(body: dict[str, Any]) -> list[Sequence]:
    """The client's request as single-sequence requests, in choice order (one, if it is one already)."""
    n = body.get("n", 1)
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise ApiError(f"'n' must be an integer in [1, {MAX_N}], got {n!r}", "n")
    prompts: list[Any] = [None]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = list(prompt)  # strings or token-id lists; a flat list of ids is one prompt
    if len(prompts) * n > MAX_SEQUENCES:
        raise ApiError(f"{len(prompts)} prompts x n={n} is over {MAX_SEQUENCES} choices per request", "prompt")
    seed = body.get("seed")
    out = []
    for p, one_prompt in enumerate(prompts):
        for j in range(n):
            sub = {**body, "n": 1}
            if one_prompt is not None:
                sub["prompt"] = one_prompt
            if isinstance(seed, int) and not isinstance(seed, bool) and n > 1:
                sub["seed"] = seed + j
            out.append(Sequence(p * n + j, p, j, sub))
    return out


async def fan_out(body: dict[str, Any], sequences: list[Sequence], send_one: SendOne) -> Response:
    """Sends every sequence of `body` (split_sequences) through `send_one` and merges the answers."""
    tasks = [asyncio.ensure_future(send_one(s)) for s in sequences]
    try:
        responses = list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is None:
                await _close(t.result())
        raise
    failed = next((r for r in responses if r.status_code != 200), None)
    if failed is not None:
        for r in responses:
            if r is not failed:
                await _close(r)
        return failed
    if body.get("stream") is True:
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(_merged_stream(sequences, responses, include_usage), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})
    return JSONResponse(merge_bodies(sequences, [json.loads(await _read(r)) for r in responses]))


def merge_bodies(sequences: list[Sequence], bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """One answer from the single-sequence answers: choices in order, usage summed."""
    merged = {**bodies[0], "choices": []}
    for seq, b in zip(sequences, bodies, strict=True):
        for choice in b["choices"]:
            merged["choices"].append({**choice, "index": seq.index})
    merged["usage"] = summed_usage(sequences, [b.get("usage") for b in bodies])
    return merged


def summed_usage(sequences: list[Sequence], usages: list[dict[str, Any] | None]) -> dict[str, Any]:
    prompts: dict[int, tuple[int, list[int]]] = {}
    completion = 0
    for seq, u in zip(sequences, usages, strict=True):
        if u is None:
            continue
        completion += u.get("completion_tokens", 0)
        _, cached = prompts.setdefault(seq.prompt_index, (u.get("prompt_tokens", 0), []))
        cached.append((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    return samples_usage(prompts, completion)


async def _merged_stream(sequences: list[Sequence], responses: list[Response],
                         include_usage: bool) -> AsyncIterator[bytes]:
    """Interleaves the sequences' SSE events, renumbering choices; one usage chunk, one [DONE]."""
    events: asyncio.Queue[tuple[int, dict[str, Any] | None]] = asyncio.Queue()
    usages: list[dict[str, Any] | None] = [None] * len(sequences)

    async def pump(i: int, response: Response) -> None:
        try:
            async for event in _sse_events(response):
                await events.put((i, event))
        finally:
            await events.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(responses)]
    last: dict[str, Any] = {}
    try:
        open_streams = len(tasks)
        while open_streams:
            i, event = await events.get()
            if event is None:
                open_streams -= 1
                continue
            if event.get("usage") is not None:
                usages[i] = event["usage"]
            choices = event.get("choices")
            if choices is None and "error" in event:
                yield _sse(event)
                continue
            if not choices:
                continue  # a sequence's own usage chunk: summed below
            last = event
            yield _sse({**event, "choices": [{**c, "index": sequences[i].index} for c in choices],
                        **({"usage": None} if "usage" in event else {})})
        if include_usage:
            yield _sse({"id": last.get("id"), "object": last.get("object"), "created": last.get("created"),
                        "model": last.get("model"), "choices": [], "usage": summed_usage(sequences, usages)})
        yield b"data: [DONE]\n\n"
    finally:
        # The client may be gone: the server cancels this generator, and under anyio every later
        # await here is cancelled too. The closing runs as its own task, held until it is done.
        cleanup = asyncio.ensure_future(_end_sequences(tasks, responses))
        _CLEANUPS.add(cleanup)
        cleanup.add_done_callback(_CLEANUPS.discard)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(cleanup)


_CLEANUPS: set[asyncio.Future] = set()


async def _end_sequences(tasks: list[asyncio.Future], responses: list[Response]) -> None:
    """Stops the pumps and closes every sequence's stream (its engines abort the request)."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for r in responses:
        await _close(r)


async def _sse_events(response: Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of an SSE response body, whatever its chunking."""
    buffer = b""
    async for chunk in _body_chunks(response):
        buffer += chunk
        while b"\n\n" in buffer:
            raw, buffer = buffer.split(b"\n\n", 1)
            for line in raw.splitlines():
                if line.startswith(b"data:"):
                    data = line[5:].strip()
                    if data and data != b"[DONE]":
                        yield json.loads(data)


async def _body_chunks(response: Response) -> AsyncIterator[bytes]:
    if isinstance(response, StreamingResponse):
        async for chunk in response.body_iterator:
            yield chunk.encode() if isinstance(chunk, str) else bytes(chunk)
    else:
        yield bytes(response.body)


async def _read(response: Response) -> bytes:
    return b"".join([c async for c in _body_chunks(response)])


async def _close(response: Response) -> None:
    """Closes a streaming response nobody will read (its upstream closes, the engines abort)."""
    iterator = getattr(response, "body_iterator", None)
    if iterator is not None and hasattr(iterator, "aclose"):
        with contextlib.suppress(Exception):
            await iterator.aclose()


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
