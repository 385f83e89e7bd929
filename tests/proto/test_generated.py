"""The committed generated modules are exactly what grpcio-tools makes of the .proto files."""

from __future__ import annotations

from pathlib import Path

from splitserve.proto.generate import PROTO_DIR, generated_files


def test_generated_modules_match_the_proto_files(tmp_path: Path) -> None:
    fresh = generated_files(tmp_path)
    assert set(fresh) == {"draft_mesh_pb2.py", "draft_mesh_pb2_grpc.py"}
    for name, text in fresh.items():
        committed = (PROTO_DIR / name).read_text()
        assert committed == text, f"proto/{name} drifted from proto/*.proto: run python -m splitserve.proto.generate"
