"""The committed generated modules are exactly what grpcio-tools makes of the .proto files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "generate_proto.py"
_spec = importlib.util.spec_from_file_location("generate_proto", SCRIPT)
generate_proto = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generate_proto)
PROTO_DIR, generated_files = generate_proto.PROTO_DIR, generate_proto.generated_files


def test_generated_modules_match_the_proto_files(tmp_path: Path) -> None:
    fresh = generated_files(tmp_path)
    assert set(fresh) == {"draft_mesh_pb2.py", "draft_mesh_pb2_grpc.py"}
    for name, text in fresh.items():
        committed = (PROTO_DIR / name).read_text()
        assert committed == text, f"proto/{name} drifted from proto/*.proto: run python3 scripts/generate_proto.py"
