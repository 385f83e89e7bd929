"""Authentication of the draft mesh's gRPC calls with the group's key.

The caller sends two metadata entries: ``x-splitserve-mesh-ts`` (unix seconds) and
``x-splitserve-mesh-mac``, the hex HMAC-SHA256 of ``"<method>\\n<ts>\\n"`` followed by the
request's serialized bytes. The server recomputes it and refuses calls whose MAC is wrong or
whose timestamp is further than ``MAX_SKEW_S`` from its clock (a recorded call cannot be replayed
later). Without a key nothing is signed or checked.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Iterable

TS_KEY = "x-splitserve-mesh-ts"
MAC_KEY = "x-splitserve-mesh-mac"
MAX_SKEW_S = 120.0


def call_mac(key: str, method: str, ts: str, body: bytes) -> str:
    return hmac.new(key.encode(), f"{method}\n{ts}\n".encode() + body, hashlib.sha256).hexdigest()


def signed_metadata(key: str, method: str, body: bytes, now: float | None = None) -> tuple[tuple[str, str], ...]:
    """The metadata a call of `method` with serialized request `body` carries."""
    if not key:
        return ()
    ts = f"{time.time() if now is None else now:.3f}"
    return ((TS_KEY, ts), (MAC_KEY, call_mac(key, method, ts, body)))


def call_refusal(key: str, method: str, body: bytes, metadata: Iterable[tuple[str, str | bytes]],
                 now: float | None = None) -> str | None:
    """Why a call must be refused (None: it is authentic, or there is no key)."""
    if not key:
        return None
    meta = {k: v for k, v in metadata if isinstance(v, str)}
    ts, mac = meta.get(TS_KEY), meta.get(MAC_KEY)
    if ts is None or mac is None:
        return "the call is not signed with the group's key"
    try:
        skew = abs((time.time() if now is None else now) - float(ts))
    except ValueError:
        return f"bad {TS_KEY} {ts!r}"
    if skew > MAX_SKEW_S:
        return f"the call's timestamp is {skew:.0f} s off this drafter's clock"
    if not hmac.compare_digest(mac, call_mac(key, method, ts, body)):
        return "bad MAC: the caller does not hold the group's key"
    return None
