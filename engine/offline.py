"""Run prompts through an engine from plain Python, without HTTP (tests, checks, scripts)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from splitserve.engine.engine import Engine, EngineOverloaded
from splitserve.engine.request import Request, TokenOutput
from splitserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from splitserve.engine.multimodal.image_items import ImageItem


class GenerationFailed(RuntimeError):
    """A request ended with an error instead of its tokens."""


def generate_tokens(engine: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                    timeout: float = 300.0, stagger_s: float = 0.0,
                    observe: Callable[[TokenOutput], None] | None = None,
                    images: list[list[ImageItem]] | None = None) -> list[list[int]]:
    """Output token ids of every prompt, submitted together (or `stagger_s` apart) to a started engine.

    The engine's inbox and waiting queue are bounded: a prompt that finds them full is submitted again
    once the loop has taken some in, so any number of prompts can be passed at once.
    `observe`, if given, sees every output as it arrives, on the engine's thread (for timings).
    `params`: one for every prompt, or a list with each prompt's own.
    `images`: each prompt's image items (placed: offsets set, pixels or rows given), for a multimodal model.
    """
    each = params if isinstance(params, list) else [params] * len(prompts)
    if len(each) != len(prompts):
        raise ValueError(f"{len(each)} sampling params for {len(prompts)} prompts")
    outs: dict[str, list[int]] = {}
    errors: list[str] = []
    finished: set[str] = set()
    done = threading.Event()
    deadline = time.monotonic() + timeout

    def collect(out: TokenOutput) -> None:
        if observe is not None:
            observe(out)
        outs.setdefault(out.request_id, []).extend(out.token_ids)
        if out.finish_reason is not None:
            if out.error:
                errors.append(f"{out.request_id}: {out.error}")
            finished.add(out.request_id)
            if len(finished) == len(prompts):
                done.set()

    for i, prompt in enumerate(prompts):
        req = Request(f"offline-{id(outs)}-{i}", list(prompt), each[i], collect)
        if images is not None:
            req.images = images[i]
        submit_when_taken(engine, req, deadline)
        if stagger_s:
            done.wait(stagger_s)
    if not done.wait(max(0.0, deadline - time.monotonic())):
        raise TimeoutError(f"{len(prompts) - len(finished)} of {len(prompts)} requests unfinished after {timeout} s")
    if errors:
        raise GenerationFailed("; ".join(errors[:3]))
    return [outs[f"offline-{id(outs)}-{i}"] for i in range(len(prompts))]


def submit_when_taken(engine: Engine, req: Request, deadline: float, poll_s: float = 0.005) -> None:
    """Submits `req`, waiting while the engine refuses it as overloaded (it takes nothing then)."""
    while True:
        try:
            engine.submit(req)
            return
        except EngineOverloaded as exc:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{req.request_id} was never taken: {exc}") from exc
            time.sleep(poll_s)  # the loop drains its inbox every turn
