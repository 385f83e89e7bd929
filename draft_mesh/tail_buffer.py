"""The verifier's buffer of one request's drafted tokens (pure; the verifier role feeds and reads it).

The drafter streams its chain of drafted tokens in order, each with its position and the
committed length it was drafted from (`base_committed_len`). The buffer keeps that chain from
`start` on. Before each step it is checked against the verifier's committed tokens: tokens the
verifier has committed are dropped when they agree; when one disagrees the rest of the chain is
wrong, so it is cleared and a floor is raised to the committed length: tokens drafted from a
base below it (before the drafter saw the commit that corrects it) are stale and dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TailBuffer:
    """Drafted tokens of one request, for positions `start`, `start + 1`, ..."""

    start: int = 0
    chain: list[int] = field(default_factory=list)
    floor: int = 0  # tokens with base_committed_len below this are stale
    stale_dropped: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.chain)

    def add(self, token: int, base_committed_len: int, position: int) -> bool:
        """Takes one streamed token; False when it is stale and dropped."""
        if base_committed_len < self.floor or position < base_committed_len:
            self.stale_dropped += 1
            return False
        if self.chain and self.start <= position <= self.end:
            del self.chain[position - self.start:]  # the drafter re-drafted from here
            self.chain.append(token)
        else:  # the first token, a chain restarted earlier, or one after a gap
            self.start, self.chain = position, [token]
        return True

    def reconcile(self, committed: list[int], offset: int = 0) -> bool:
        """Drops the chain's committed part (`committed[i]` is the token at position `offset + i`,
        and the chain never starts before `offset`); False (the chain cleared, the floor raised)
        when a drafted token disagrees with a committed one."""
        length = offset + len(committed)
        if self.start >= length:
            return True
        overlap = min(self.end, length)
        if self.chain[: overlap - self.start] != committed[self.start - offset:overlap - offset]:
            self.start, self.chain, self.floor = length, [], max(self.floor, length)
            return False
        del self.chain[: length - self.start]
        self.start = length
        return True

    def draft(self, committed_len: int, k: int) -> list[int]:
        """Up to k drafted tokens for positions committed_len, committed_len + 1, ... (after reconcile)."""
        if self.start != committed_len:
            return []
        return self.chain[:k]
