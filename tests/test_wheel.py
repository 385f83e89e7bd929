"""The wheel installs: built from this checkout, installed without `-e` into a fresh virtualenv, its
`splitserve up` serves a completion, from a folder that holds no source."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest
from servers import REPO, running_up

pytestmark = pytest.mark.slow

SUBPACKAGES = ("api", "api.tools", "bench", "draft_mesh", "engine", "engine.checkpoints", "engine.grammar",
               "engine.layers", "engine.models", "engine.multimodal", "engine.roles", "engine.runner",
               "engine.sampling", "engine.tp", "launcher", "operator", "proto", "router", "transfer",
               "transfer.cuda_ipc", "transfer.embedding", "transfer.kv", "transfer.mooncake")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # --no-build-isolation: the build needs only setuptools, which is here; no index is asked.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(REPO)], check=True, timeout=300, capture_output=True)
    (path,) = out.glob("splitserve-*.whl")
    return path


def test_the_wheel_holds_every_package_and_nothing_that_does_not_ship(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    packages = {n.rsplit("/", 1)[0].replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert {"splitserve", *(f"splitserve.{p}" for p in SUBPACKAGES)} <= packages
    assert "splitserve/proto/draft_mesh.proto" in names
    assert not [n for n in names if n.startswith(("splitserve/tests/", "splitserve/benchmarks/",
                                                  "splitserve/scripts/")) or n == "splitserve/setup.py"]


def test_the_installed_wheel_serves_through_splitserve_up(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    # The dependencies (torch, ...) come from this interpreter's site-packages; splitserve only from the wheel.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True, timeout=300,
                   capture_output=True)
    where = subprocess.run([str(python), "-c", "import splitserve, json; print(json.dumps(splitserve.__file__))"],
                           check=True, capture_output=True, text=True, cwd=tmp_path).stdout
    assert json.loads(where).startswith(str(venv)), where  # not this checkout through an editable install

    command = [str(venv / "bin" / "splitserve")]
    with running_up(["--unified", "1", "--model", "tiny"], tmp_path / "up.log", command=command, cwd=tmp_path) as up:
        r = httpx.post(f"{up.url}/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        up.sigterm_leaves_no_child()
