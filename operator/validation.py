"""Checks of a spec that the CRD's OpenAPI schema cannot express on every supported server.

The schema refuses bad values field by field; these functions catch what spans fields (GPUs
against tensor-parallel size, a drafter without speculative decoding, ...). A spec with
problems is never reconciled: the operator reports them in the ``Degraded`` condition.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from splitserve.operator.names import MAX_GROUP_NAME, ROLE_NAMES
from splitserve.operator.role_builders import KV_STORE_ENGINE_FLAGS, MANAGED_ENGINE_FLAGS, MANAGED_ENV, env_var
from splitserve.operator.role_table import traits

KV_STORE_ENV = (env_var("KV_STORE"), env_var("KV_STORE_SEGMENT_MB"))


class InvalidSpec(ValueError):
    """A spec that can never be reconciled; the message lists every problem."""

    def __init__(self, kind: str, name: str, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(f"{kind} {name}: " + "; ".join(problems))


def role_template_problems(where: str, role: Mapping[str, Any]) -> list[str]:
    """Problems of one role's fields (``spec.roles.<role>`` or a ServingRole's spec)."""
    problems = []
    tp = int(role.get("tensorParallelSize", 1))
    gpus = int((role.get("resources") or {}).get("gpus", 0) or 0)
    if gpus and gpus != tp:
        problems.append(f"{where}.resources.gpus is {gpus} but tensorParallelSize is {tp}: "
                        f"each pod needs one GPU per tensor-parallel rank (or 0 GPUs to run on CPU)")
    for i, arg in enumerate(role.get("engineArgs") or []):
        flag = str(arg).split("=", 1)[0]
        if flag in MANAGED_ENGINE_FLAGS:
            problems.append(f"{where}.engineArgs[{i}] sets {flag}, which the operator sets from the spec")
    for i, var in enumerate(role.get("env") or []):
        if var.get("name") in MANAGED_ENV:
            problems.append(f"{where}.env[{i}] sets {var['name']}, which the operator sets itself")
    names = [var.get("name") for var in role.get("env") or []]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"{where}.env sets {dup} more than once")
    return problems


def group_spec_problems(name: str, spec: Mapping[str, Any]) -> list[str]:
    """Every problem of a ServingGroup's name and spec; empty when it can be reconciled."""
    problems = []
    if len(name) > MAX_GROUP_NAME:
        problems.append(f"metadata.name {name!r} is {len(name)} characters; at most {MAX_GROUP_NAME} "
                        f"leave room for the pods' names (<group>-<role>-<ordinal>)")
    roles = spec.get("roles") or {}
    for role in ROLE_NAMES:
        if roles.get(role) is not None:
            problems += role_template_problems(f"spec.roles.{role}", roles[role])
    drafting = [r for r in ROLE_NAMES if traits(r).requires_speculative]
    for role in drafting:
        if roles.get(role) is not None and int(roles[role].get("replicas", 1)) > 0 and spec.get("speculative") is None:
            problems.append(f"spec.roles.{role} is set but spec.speculative is not: "
                            f"{role}s serve only decoupled speculative decoding")
    if spec.get("speculative") is not None and not any(roles.get(r) is not None for r in drafting):
        problems.append(f"spec.speculative is set but spec.roles.{' / '.join(drafting)} is not: "
                        "speculative decoding needs drafter pods")
    for role in ROLE_NAMES:
        fed = traits(role).feeds
        if roles.get(role) is not None and fed and int(roles.get(fed, {}).get("replicas", 1)) == 0:
            problems.append(f"spec.roles.{role} is set but {fed} has 0 replicas: {role} pods feed {fed} pods")
    return problems + slo_problems(spec.get("slo")) + kv_store_problems(spec)


def kv_store_problems(spec: Mapping[str, Any]) -> list[str]:
    """Problems of ``spec.kvStore`` that span fields: a name without the namespace scope, and engine settings
    the store's wiring would fight with (an engineArgs flag overrides the env var the operator sets)."""
    kv = spec.get("kvStore") or {}
    problems = []
    if kv.get("name") and kv.get("scope", "group") != "namespace":
        problems.append("spec.kvStore.name names a namespace KV store, but spec.kvStore.scope is not namespace "
                        "(a group's own store is <group>-kv-store)")
    if not kv.get("enabled"):
        return problems
    roles = spec.get("roles") or {}
    for role in ROLE_NAMES:
        if roles.get(role) is None or not traits(role).kv_store:
            continue
        for i, arg in enumerate(roles[role].get("engineArgs") or []):
            flag = str(arg).split("=", 1)[0]
            if flag in KV_STORE_ENGINE_FLAGS:
                problems.append(f"spec.roles.{role}.engineArgs[{i}] sets {flag}, which spec.kvStore sets")
        for i, var in enumerate(roles[role].get("env") or []):
            if var.get("name") in KV_STORE_ENV:
                problems.append(f"spec.roles.{role}.env[{i}] sets {var['name']}, which spec.kvStore sets")
    return problems


def slo_problems(slo: Mapping[str, Any] | None) -> list[str]:
    """Problems of ``spec.slo`` that span fields: each role's minReplicas above its maxReplicas."""
    problems = []
    for role, limits in ((slo or {}).get("roles") or {}).items():
        low, high = int((limits or {}).get("minReplicas", 1)), int((limits or {}).get("maxReplicas", 8))
        if low > high:
            problems.append(f"spec.slo.roles.{role}.minReplicas ({low}) is above its maxReplicas ({high})")
    return problems


def role_spec_problems(name: str, spec: Mapping[str, Any]) -> list[str]:
    """Every problem of a ServingRole's name and spec; empty when it can be reconciled."""
    problems = role_template_problems("spec", spec)
    if len(name) > MAX_GROUP_NAME + len("-prefill"):
        problems.append(f"metadata.name {name!r} is {len(name)} characters; at most "
                        f"{MAX_GROUP_NAME + len('-prefill')} leave room for the pods' names")
    role = spec.get("role")
    if role in ROLE_NAMES and traits(role).requires_speculative and spec.get("speculative") is None:
        problems.append(f"spec.role is {role} but spec.speculative is not set")
    if spec.get("kvStore") and role in ROLE_NAMES and traits(role).kv_store:
        problems += [f"spec.env[{i}] sets {var['name']}, which spec.kvStore sets"
                     for i, var in enumerate(spec.get("env") or []) if var.get("name") in KV_STORE_ENV]
        problems += [f"spec.engineArgs[{i}] sets {str(arg).split('=', 1)[0]}, which spec.kvStore sets"
                     for i, arg in enumerate(spec.get("engineArgs") or [])
                     if str(arg).split("=", 1)[0] in KV_STORE_ENGINE_FLAGS]
    return problems
