"""Client API keys at the router: Bearer keys from a flag, the environment or a file (read again when it
changes), a 401 in OpenAI's error shape otherwise, and health, readiness and metrics left open for probes."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import openai
import pytest
from server_group import ServerGroup

from splitserve.api.openai_protocol import ApiError
from splitserve.engine.checkpoints.tiny_model import tiny_model_folder
from splitserve.router.api_keys import ApiKeys


def refused(keys: ApiKeys, header: str | None) -> bool:
    try:
        keys.check(header)
    except ApiError as exc:
        assert exc.status == 401 and exc.body()["error"]["code"] == "invalid_api_key"
        return True
    return False


def test_a_router_without_keys_is_open_and_one_with_keys_takes_only_bearer_keys() -> None:
    assert not refused(ApiKeys(), None)
    keys = ApiKeys(key="sk-one")
    assert not refused(keys, "Bearer sk-one") and not refused(keys, "bearer  sk-one ")
    for header in (None, "", "Bearer", "Bearer sk-two", "Basic sk-one", "sk-one", "Bearer sk-one2"):
        assert refused(keys, header), header


def test_keys_come_from_a_file_that_is_read_again_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# client keys\nsk-a\n\n  sk-b  # the batch job\n")
    keys = ApiKeys(key_file=str(path))
    assert not refused(keys, "Bearer sk-a") and not refused(keys, "Bearer sk-b") and refused(keys, "Bearer sk-c")
    path.write_text("sk-c\n")
    os.utime(path, ns=(1, 10**18))  # a new mtime whatever the clock's resolution
    assert refused(keys, "Bearer sk-a") and not refused(keys, "Bearer sk-c")
    path.unlink()  # a Secret briefly absent while it is rewritten: the keys read before still hold
    assert not refused(keys, "Bearer sk-c")
    with pytest.raises(OSError):
        ApiKeys(key_file=str(tmp_path / "absent"))  # a missing file fails the start


@pytest.mark.slow
def test_the_router_refuses_requests_without_its_key_and_serves_the_openai_client_with_it(tmp_path: Path) -> None:
    g = ServerGroup(tmp_path, tiny_model_folder(0), ["--served-model-name", "m", "--device", "cpu"])
    try:
        engine = g.engine("unified", "unified")
        g.start("router", ["router", "--unified", engine, "--routing", "least-loaded"],
                env={"SPLITSERVE_ROUTER_API_KEY": "sk-test-key"})
        g.wait()
        router = g.url("router")
        body = {"model": "m", "prompt": "Hello", "max_tokens": 2}
        for headers in ({}, {"authorization": "Bearer wrong"}):
            r = httpx.post(f"{router}/v1/completions", json=body, headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        assert httpx.get(f"{router}/v1/models", timeout=30).status_code == 401
        for path in ("/health", "/ready", "/metrics"):
            assert httpx.get(f"{router}{path}", timeout=30).status_code == 200, path
        client = openai.OpenAI(base_url=f"{router}/v1", api_key="sk-test-key", max_retries=0)
        out = client.completions.create(model="m", prompt="Hello", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens == 3
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{router}/v1", api_key="sk-wrong", max_retries=0).models.list()
    finally:
        g.stop()
