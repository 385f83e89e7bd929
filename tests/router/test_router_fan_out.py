"""The router's fan-out as pure functions: how a request splits and how the answers merge."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.responses import JSONResponse, StreamingResponse

from splitserve.api.openai_protocol import ApiError
from splitserve.router.fan_out import fan_out, merge_bodies, split_sequences


def test_split_is_prompt_major_with_seed_plus_j() -> None:
    seqs = split_sequences({"prompt": ["a", "b"], "n": 2, "seed": 7})
    assert [(s.index, s.prompt_index, s.sample, s.body["prompt"], s.body["seed"], s.body["n"]) for s in seqs] == [
        (0, 0, 0, "a", 7, 1), (1, 0, 1, "a", 8, 1), (2, 1, 0, "b", 7, 1), (3, 1, 1, "b", 8, 1)]
    assert [s.body["prompt"] for s in split_sequences({"prompt": [1, 2, 3]})] == [[1, 2, 3]]  # one id list
    assert [s.body["prompt"] for s in split_sequences({"prompt": [[1], [2]]})] == [[1], [2]]
    assert split_sequences({"prompt": ["only"]})[0].body["prompt"] == "only"
    assert len(split_sequences({"messages": [], "n": 3})) == 3
    for body in ({"n": 0}, {"n": 17}, {"n": True}, {"prompt": ["x"] * 100, "n": 16}):
        with pytest.raises(ApiError):
            split_sequences(body)


def test_merge_renumbers_choices_and_counts_a_prompt_once() -> None:
    # A prompt's cached tokens are the fewest its samples found: whichever sample reached the
    # prefill first computed it (a's second, b's first) and the other copied its pages.
    seqs = split_sequences({"prompt": ["a", "b"], "n": 2})
    cached = [3, 0, 1, 5]
    bodies = [{"id": f"c{i}", "choices": [{"index": 0, "text": f"t{i}"}],
               "usage": {"prompt_tokens": 3 + s.prompt_index, "completion_tokens": 2,
                         "prompt_tokens_details": {"cached_tokens": cached[i]}}} for i, s in enumerate(seqs)]
    merged = merge_bodies(seqs, bodies)
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(0, "t0"), (1, "t1"), (2, "t2"), (3, "t3")]
    assert merged["usage"]["prompt_tokens"] == 3 + 4 and merged["usage"]["completion_tokens"] == 8
    assert merged["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 + 1


def test_streams_interleave_with_one_usage_chunk_and_one_done() -> None:
    async def send_one(seq):
        body = seq.body

        async def events():
            for k in range(2):
                yield f'data: {{"id": "x", "choices": [{{"index": 0, "text": "{body["prompt"]}{k}"}}]}}\n\n'
            yield ('data: {"id": "x", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2}}\n\n'
                   "data: [DONE]\n\n")
        return StreamingResponse(events(), media_type="text/event-stream")

    async def run() -> list[str]:
        body = {"prompt": ["p", "q"], "n": 2, "stream": True, "stream_options": {"include_usage": True}}
        response = await fan_out(body, split_sequences(body), send_one)
        return [chunk if isinstance(chunk, str) else chunk.decode() async for chunk in response.body_iterator]

    lines = [e[6:] for chunk in asyncio.run(run()) for e in chunk.split("\n\n") if e]
    assert lines[-1] == "[DONE]" and lines.count("[DONE]") == 1
    events = [json.loads(x) for x in lines[:-1]]
    text = {}
    for e in events[:-1]:
        for c in e["choices"]:
            text[c["index"]] = text.get(c["index"], "") + c["text"]
    assert text == {0: "p0p1", 1: "p0p1", 2: "q0q1", 3: "q0q1"}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8
    assert events[-1]["usage"]["prompt_tokens"] == 4


def test_a_failed_sequence_fails_the_whole_request_with_its_error() -> None:
    async def send_one(seq):
        if seq.body["prompt"] == "bad":
            return JSONResponse({"error": {"message": "no", "param": "prompt"}}, status_code=400)

        async def events():
            yield 'data: {"choices": []}\n\n'
        return StreamingResponse(events())

    async def run():
        body = {"prompt": ["ok", "bad"], "stream": True}
        r = await fan_out(body, split_sequences(body), send_one)
        return r.status_code, json.loads(r.body)

    status, error = asyncio.run(run())
    assert status == 400 and error["error"]["param"] == "prompt"
