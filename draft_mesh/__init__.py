"""The draft mesh: drafters negotiate with verifiers over gRPC (proto/draft_mesh.proto) and stream
drafted tokens to them over ZeroMQ; see docs/architecture.md, "The draft mesh"."""

from splitserve.draft_mesh.config import SpecConfig

__all__ = ["SpecConfig"]
