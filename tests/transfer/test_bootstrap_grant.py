"""Bootstrap grants: only the holder of the group's key can make one that verifies."""

import pytest

from splitserve.transfer.bootstrap_grant import bootstrap_grant_valid, sign_bootstrap

KEY = "ab" * 32


def test_a_grant_verifies_for_its_own_triple_only():
    sig = sign_bootstrap(KEY, "10.0.0.1", 8998, 12345)
    assert bootstrap_grant_valid(KEY, "10.0.0.1", 8998, 12345, sig)
    assert not bootstrap_grant_valid(KEY, "10.0.0.2", 8998, 12345, sig)
    assert not bootstrap_grant_valid(KEY, "10.0.0.1", 8999, 12345, sig)
    assert not bootstrap_grant_valid(KEY, "10.0.0.1", 8998, 12346, sig)


def test_a_grant_made_with_another_key_or_missing_is_refused():
    sig = sign_bootstrap("cd" * 32, "10.0.0.1", 8998, 1)
    assert not bootstrap_grant_valid(KEY, "10.0.0.1", 8998, 1, sig)
    assert not bootstrap_grant_valid(KEY, "10.0.0.1", 8998, 1, None)
    assert not bootstrap_grant_valid(KEY, "10.0.0.1", 8998, 1, "")
    assert not bootstrap_grant_valid("", "10.0.0.1", 8998, 1, sig)


def test_signing_without_a_key_is_an_error():
    with pytest.raises(ValueError, match="key"):
        sign_bootstrap("", "h", 1, 1)
