"""Bootstrap grants: proof that the router, not a client, pointed an engine at a prefill's room.

The router signs each request's ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room``
with the group's key (the same ``transfer_control_key`` that signs control messages) and sends
the signature as ``bootstrap_signature``. An engine with a key refuses bootstrap fields that are
missing a signature or carry a wrong one (403), so a client can neither make a decode connect
to an address of its choosing (and hand it the key) nor make it hold pages for a made-up room.
"""

from __future__ import annotations

import hashlib
import hmac

SIGNATURE_FIELD = "bootstrap_signature"
# The HTTP header in which the group's own processes show the key (bootstrap server, /internal/*,
# an encoder's /v1/encode).
KEY_HEADER = "X-Splitserve-Key"


def _grant_bytes(host: str, port: int, room: int) -> bytes:
    # Newline-separated: a host cannot contain one, so no two triples share a message.
    return f"splitserve-bootstrap-grant/1\n{host}\n{int(port)}\n{int(room)}".encode()


def sign_bootstrap(key: str, host: str, port: int, room: int) -> str:
    """The hex HMAC-SHA256 of the triple under ``key``."""
    if not key:
        raise ValueError("signing a bootstrap grant needs the group's key")
    return hmac.new(key.encode(), _grant_bytes(host, port, room), hashlib.sha256).hexdigest()


def bootstrap_grant_valid(key: str, host: str, port: int, room: int, signature: str | None) -> bool:
    """True when ``signature`` is the grant of the triple under ``key`` (constant time)."""
    if not key or not signature:
        return False
    return hmac.compare_digest(sign_bootstrap(key, host, port, room), signature)
