"""The router's pieces on their own: bootstrap grants (pair requests)."""

from __future__ import annotations

from splitserve.engine.router import pair_request
from splitserve.transfer.bootstrap_grant import SIGNATURE_FIELD, bootstrap_grant_valid


def test_pair_request_is_signed_with_the_groups_key_for_its_exact_triple() -> None:
    body = {"model": "m", "prompt": [1, 2]}
    pair = pair_request(body, "10.0.0.7", 8998, 12345, key="k" * 64)
    assert (pair["bootstrap_host"], pair["bootstrap_port"], pair["bootstrap_room"]) == ("10.0.0.7", 8998, 12345)
    assert bootstrap_grant_valid("k" * 64, "10.0.0.7", 8998, 12345, pair[SIGNATURE_FIELD])
    assert not bootstrap_grant_valid("k" * 64, "10.0.0.7", 8998, 12346, pair[SIGNATURE_FIELD])
    assert not bootstrap_grant_valid("other", "10.0.0.7", 8998, 12345, pair[SIGNATURE_FIELD])
    assert body == {"model": "m", "prompt": [1, 2]}  # the client's body is left as it was


def test_pair_request_without_a_key_carries_no_signature() -> None:
    assert SIGNATURE_FIELD not in pair_request({"prompt": "a"}, "h", 1, 2, key="")
