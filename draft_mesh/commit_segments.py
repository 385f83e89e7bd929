"""How a drafter applies a verifier's commit to what it drafted (pure; the drafter role acts on it).

The verifier is the source of truth. Its commits for one request are contiguous segments: each
starts where the previous ended (`pre_verify_committed_len`). A segment that starts elsewhere
(a gap or an overlap), or that holds no token or an id outside the vocabulary, is a protocol
violation: the drafter quarantines that one request.
"""

from __future__ import annotations

from dataclasses import dataclass


class ProtocolViolation(ValueError):
    """A message the drafter cannot apply to a request; that request is quarantined."""


@dataclass(frozen=True)
class CommitOutcome:
    """Keep `sequence[:keep]`, then append `append`; `committed_len` tokens are now committed."""

    keep: int
    append: list[int]
    committed_len: int

    @property
    def truncated(self) -> bool:
        """Some drafted tokens disagreed with the commit and are dropped."""
        return bool(self.append)


def check_tokens(tokens: list[int], vocab_size: int, what: str) -> None:
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ProtocolViolation(f"{what} holds token ids outside [0, {vocab_size}): {bad[:4]}")


def apply_commit(sequence: list[int], committed_len: int, start: int, tokens: list[int],
                 vocab_size: int) -> CommitOutcome:
    """`sequence`: the request's tokens on the drafter (committed, then drafted); the commit says
    the verifier's tokens from `start` on are `tokens`."""
    if start > committed_len:
        raise ProtocolViolation(f"gap: commit starts at {start} but {committed_len} tokens are committed")
    if start < committed_len:
        raise ProtocolViolation(f"overlap: commit starts at {start} but {committed_len} tokens are committed")
    if not tokens:
        raise ProtocolViolation(f"empty commit at {start}")
    check_tokens(tokens, vocab_size, "commit")
    end = start + len(tokens)
    for i, token in enumerate(tokens):
        pos = start + i
        if pos >= len(sequence) or sequence[pos] != token:
            return CommitOutcome(keep=pos, append=list(tokens[i:]), committed_len=end)
    return CommitOutcome(keep=len(sequence), append=[], committed_len=end)
