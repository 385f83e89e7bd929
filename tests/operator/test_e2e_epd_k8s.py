"""End to end on a local cluster: `manifests/examples/epd.yaml` (1 encode + 1 prefill + 1 decode)
applied with `kubectl`, every pod run as a local process by the local node, and image chat
completions through the group's router equal the unified engine token for token.

The example names a 7B LLaVA checkpoint on GPUs; here its model is a small random LLaVA checkpoint
this test writes (a hostPath volume, as the example's own), and its roles ask for no GPU.
Everything else is the example as written. The cluster fixture is test_e2e_k8s.py's.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import pathlib
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from PIL import Image
from servers import free_port

from splitserve.engine.checkpoints.tiny_llava import write_llava_checkpoint


def _e2e_module():
    """test_e2e_k8s.py, loaded by path (--import-mode=importlib puts no test folder on sys.path)."""
    spec = importlib.util.spec_from_file_location("e2e_k8s_fixtures", pathlib.Path(__file__).with_name(
        "test_e2e_k8s.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_e2e = _e2e_module()
EXAMPLES, LocalCluster = _e2e.EXAMPLES, _e2e.LocalCluster
local = _e2e.local  # this module's own cluster (control plane, local node, the chart's operator)

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

MODEL_NAME = "llava-tiny"


def epd_on_cpus(checkpoint: pathlib.Path) -> tuple[str, str]:
    """The epd example with its model replaced by `checkpoint` and no GPUs: (group name, YAML)."""
    doc = yaml.safe_load((EXAMPLES / "epd.yaml").read_text())
    assert set(doc["spec"]["roles"]) == {"encode", "prefill", "decode"}
    # Mounted where it is on the host: the local node mounts only below folders that exist here.
    doc["spec"]["model"] = {"name": MODEL_NAME, "hostPath": {"path": str(checkpoint)}, "mountPath": str(checkpoint)}
    for role in doc["spec"]["roles"].values():
        role["resources"] = {"requests": {"cpu": "250m", "memory": "1Gi"}}
    return doc["metadata"]["name"], yaml.safe_dump(doc)


def png_url(w: int, h: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(url: str, parts: list[dict[str, Any]]) -> list[int]:
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": parts}], "max_tokens": 8, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


CASES = [
    [{"type": "image_url", "image_url": {"url": png_url(40, 30, 1)}}, {"type": "text", "text": "describe"}],
    [{"type": "text", "text": "two"}, {"type": "image_url", "image_url": {"url": png_url(70, 50, 2)}},
     {"type": "image_url", "image_url": {"url": png_url(33, 33, 3)}}],
    [{"type": "text", "text": "text only: no encoder"}],
]


def test_the_epd_example_serves_images_like_the_unified_engine(local: LocalCluster,
                                                               tmp_path_factory: pytest.TempPathFactory,
                                                               start_server: Any) -> None:
    checkpoint = write_llava_checkpoint(tmp_path_factory.mktemp("llava") / "ckpt", seed=7)
    group, manifest = epd_on_cpus(checkpoint)
    ns = "e2e-epd"
    local.kubectl("create", "namespace", ns)
    local.kubectl("apply", "-n", ns, "-f", "-", input=manifest)
    local.wait_for(lambda: local.group_ready(ns, group), f"ServingGroup {group} Ready", timeout=240)
    router = local.wait_for(lambda: local.router_url(ns, group), "the router's endpoint")

    (encoder,) = local.pods(ns, f"splitserve.io/group={group},splitserve.io/role=encode")
    container = encoder["spec"]["containers"][0]
    assert container["command"][:4] == ["splitserve", "serve", "--role", "encode"]
    encoder_url = f"http://{encoder['status']['podIP']}:8000"
    # The encoder ships from its pod address, on the example's fixed embedding port.
    assert httpx.get(f"{encoder_url}/health", timeout=5).json()["embedding_endpoint"] == \
        f"tcp://{encoder['status']['podIP']}:8999"

    def router_sees_the_encoder() -> bool:
        backends = httpx.get(f"{router}/health", timeout=5).json()["backends"]
        return any(b["role"] == "encode" and b["healthy"] for b in backends)

    local.wait_for(router_sees_the_encoder, "the router's healthy encode backend", timeout=60)
    got = [chat(router, parts) for parts in CASES]

    port = free_port()
    start_server(["serve", "--model", str(checkpoint), "--served-model-name", MODEL_NAME, "--port", str(port)],
                 health_url=f"http://127.0.0.1:{port}/health")
    assert got == [chat(f"http://127.0.0.1:{port}", parts) for parts in CASES]
    # The two image requests' three images were encoded by the encode pod, not by prefill.
    assert httpx.get(f"{encoder_url}/health", timeout=5).json()["embedding"]["cached_images"] == 3
