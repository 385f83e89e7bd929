"""What differs between roles in the pods the operator builds, in one table.

Every role's engine pod is the same `splitserve serve --role <role>` container with the same
HTTP port, probes and environment; this table holds the differences: the extra ports a role
listens on (with the engine flag that sets each and its key in ``peers.json``), whether the
role takes part in speculative decoding (it then gets ``spec.speculative`` and its variables),
whether it serves a model of its own, which role it needs beside it, and whether it uses the
shared KV store. The builders and the validation read it instead of branching on role names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from splitserve.operator.names import (
    DEFAULT_BOOTSTRAP_PORT,
    DEFAULT_DRAFT_MESH_PORT,
    DEFAULT_EMBEDDING_PORT,
    ROLE_NAMES,
)


def bootstrap_port(spec: Mapping[str, Any]) -> int:
    """The prefill pods' bootstrap port (``spec.transfer.bootstrapPort``, group or role spec)."""
    return int((spec.get("transfer") or {}).get("bootstrapPort", DEFAULT_BOOTSTRAP_PORT))


def embedding_port(spec: Mapping[str, Any]) -> int:
    """The encode and prefill pods' embedding transfer control port (``spec.transfer.embeddingPort``)."""
    return int((spec.get("transfer") or {}).get("embeddingPort", DEFAULT_EMBEDDING_PORT))


def mesh_port(spec: Mapping[str, Any]) -> int:
    """The drafter pods' DraftMesh gRPC port (``spec.speculative.meshPort``)."""
    return int((spec.get("speculative") or {}).get("meshPort", DEFAULT_DRAFT_MESH_PORT))


@dataclass(frozen=True)
class RolePort:
    """A port a role listens on besides ``http``."""

    name: str  # the container port's (and headless Service port's) name
    number: Callable[[Mapping[str, Any]], int]  # from the group's or the role's spec
    peers_key: str  # the key of each endpoint in peers.json
    engine_flag: str | None = None  # the `splitserve serve` flag that sets it, if it has one


@dataclass(frozen=True)
class RoleTraits:
    """How one role's pods differ from the others'."""

    ports: tuple[RolePort, ...] = ()
    # Takes part in decoupled speculative decoding: gets spec.speculative and its env variables.
    speculative: bool = False
    # Serves the model named by this field of spec.speculative instead of spec.model.
    own_model: str | None = None
    # Only meaningful with spec.speculative (the drafter).
    requires_speculative: bool = False
    # Works for this role, which must then have replicas (encoders feed prefill pods).
    feeds: str | None = None
    # Keeps a prefix cache of the group's model: wired to the shared KV store (spec.kvStore).
    kv_store: bool = False


BOOTSTRAP = RolePort("bootstrap", bootstrap_port, "bootstrapPort", "--bootstrap-port")
DRAFT_MESH = RolePort("draft-mesh", mesh_port, "meshPort")
# Encoders write image rows to prefill pods; both ends' control sockets sit on this fixed port, so
# that a NetworkPolicy or a Service can name it (a text-only prefill just leaves it unused).
EMBEDDING = RolePort("embedding", embedding_port, "embeddingPort", "--embedding-control-port")

ROLE_TRAITS: dict[str, RoleTraits] = {
    "prefill": RoleTraits(ports=(BOOTSTRAP, EMBEDDING), kv_store=True),
    "decode": RoleTraits(speculative=True, kv_store=True),
    "encode": RoleTraits(ports=(EMBEDDING,), feeds="prefill"),
    "drafter": RoleTraits(ports=(DRAFT_MESH,), speculative=True, own_model="draftModel",
                          requires_speculative=True),
}
assert tuple(ROLE_TRAITS) == ROLE_NAMES, "every role has one row, in ROLE_NAMES order"


def traits(role: str) -> RoleTraits:
    """The row of a role."""
    return ROLE_TRAITS[role]
