"""Regenerates the Python modules of proto/*.proto (`python3 scripts/generate_proto.py`; needs grpcio-tools).

The generated `*_pb2.py` / `*_pb2_grpc.py` are committed; tests/proto/test_generated.py
regenerates them into a temporary folder and fails when the committed ones drift.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parents[1] / "proto"
PROTOS = ("draft_mesh.proto",)
# Compiled as if at splitserve/proto/, so the generated gRPC module imports its messages as
# `from splitserve.proto import draft_mesh_pb2`.
PACKAGE_PATH = "splitserve/proto"


def generated_files(out_dir: Path) -> dict[str, str]:
    """Runs grpc_tools.protoc over PROTOS into `out_dir`; returns {file name: text}."""
    from grpc_tools import protoc  # a development dependency (grpcio-tools, in the test extra)

    args = ["protoc", f"-I{PACKAGE_PATH}={PROTO_DIR}", f"-I{Path(protoc.__file__).parent / '_proto'}",
            f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", *(f"{PACKAGE_PATH}/{p}" for p in PROTOS)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    folder = out_dir / PACKAGE_PATH
    return {p.name: p.read_text() for p in sorted(folder.glob("*_pb2*.py"))}


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in generated_files(Path(tmp)).items():
            (PROTO_DIR / name).write_text(text)
            print(f"wrote {PROTO_DIR / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
