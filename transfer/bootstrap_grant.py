"""Bootstrap grants: proof that the router, not a client, pointed an engine at a prefill's room.

The router signs each request's ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room``
with the group's key (the same ``transfer_control_key`` that signs control messages) and sends
the signature as ``bootstrap_signature``. An engine with a key refuses bootstrap fields that are
missing a signature or carry a wrong one (403), so a client can neither make a decode connect
to an address of its choosing (and hand it the key) nor make it hold pages for a made-up room.

Prompt grants: the router, which tokenizes each text request to route it, sends the prompt's token ids
(``prompt_token_ids``) with the digest of the tokenizer that made them (``tokenizer_digest``) and signs both
(``prompt_signature``); an engine with that tokenizer takes the ids as the prompt instead of templating and
tokenizing the body again, and refuses ids that are not signed (401).
"""

from __future__ import annotations

import array
import hashlib
import hmac
import sys

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


# ---- prompt grants: token ids the router made, so the engines skip templating and tokenizing ----------

PROMPT_IDS_FIELD = "prompt_token_ids"
PROMPT_DIGEST_FIELD = "tokenizer_digest"
PROMPT_SIGNATURE_FIELD = "prompt_signature"
PROMPT_FIELDS = (PROMPT_IDS_FIELD, PROMPT_DIGEST_FIELD, PROMPT_SIGNATURE_FIELD)


def _prompt_bytes(digest: str, ids: list[int]) -> bytes:
    # The digest length-prefixed, then the ids as int64 little-endian: no two (digest, ids) share a message.
    packed = array.array("q", ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return f"splitserve-prompt-grant/1\n{len(digest)}:{digest}\n".encode() + packed.tobytes()


def sign_prompt(key: str, digest: str, ids: list[int]) -> str:
    """The hex HMAC-SHA256 under ``key`` of a prompt's token ids and the digest of the tokenizer that made them.
    Raises TypeError or OverflowError for ids that are not 64-bit integers."""
    if not key:
        raise ValueError("signing a prompt grant needs the group's key")
    return hmac.new(key.encode(), _prompt_bytes(digest, ids), hashlib.sha256).hexdigest()


def prompt_grant_valid(key: str, digest: str, ids: list[int], signature: str | None) -> bool:
    """True when ``signature`` is the router's grant of these ids under ``key`` (constant time); False for
    ids that are not integers."""
    if not key or not signature:
        return False
    try:
        return hmac.compare_digest(sign_prompt(key, digest, ids), signature)
    except (TypeError, OverflowError):
        return False
