"""Seeded multi-turn prompts for the KV tier tests: each turn's prompt is its conversation so far plus a few new
tokens, so later turns reuse what earlier ones computed."""

from __future__ import annotations

import torch


def multi_turn_prompts(seed: int, conversations: int = 6, prefix: int = 60, turns: int = 3) -> list[list[list[int]]]:
    """Per turn, every conversation's prompt."""
    gen = torch.Generator().manual_seed(seed)
    convs = [torch.randint(1, 250, (prefix,), generator=gen).tolist() for _ in range(conversations)]
    rounds = []
    for _ in range(turns):
        convs = [[*c, *torch.randint(1, 250, (5,), generator=gen).tolist()] for c in convs]
        rounds.append([list(c) for c in convs])
    return rounds
