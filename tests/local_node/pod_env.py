"""A container's environment and command line, resolved as the kubelet resolves them.

``value``, ``valueFrom`` (downward API ``fieldRef``, ``resourceFieldRef``, ``secretKeyRef``,
``configMapKeyRef``), ``envFrom``, then ``$(VAR)`` expansion of later values and of the
command and arguments against the variables defined so far (``$$`` escapes a ``$``).
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Mapping
from typing import Any

# (kind, namespace, name) -> object or None: how ConfigMaps and Secrets are looked up.
ObjectLookup = Callable[[str, str, str], dict[str, Any] | None]
VAR_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class EnvError(RuntimeError):
    """A required reference (a Secret, a ConfigMap, a key) is missing: the container cannot start."""


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined variables are replaced, others kept as written."""
    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)
    return VAR_REFERENCE.sub(replace, text)


def field_value(pod: Mapping[str, Any], path: str, pod_ip: str, host_ip: str) -> str:
    """The downward API value of ``fieldRef.fieldPath``."""
    meta, spec = pod["metadata"], pod["spec"]
    mapped = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if mapped:
        return str((meta.get(mapped.group(1)) or {}).get(mapped.group(2), ""))
    values = {
        "metadata.name": meta["name"], "metadata.namespace": meta["namespace"], "metadata.uid": meta["uid"],
        "spec.nodeName": spec.get("nodeName", ""), "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": pod_ip, "status.podIPs": pod_ip, "status.hostIP": host_ip,
    }
    if path not in values:
        raise EnvError(f"unsupported fieldRef {path!r}")
    return values[path]


def resource_value(container: Mapping[str, Any], ref: Mapping[str, Any]) -> str:
    """``resourceFieldRef``: a limit or request of the container, as written (divisor 1)."""
    kind, _, name = ref["resource"].partition(".")
    return str(((container.get("resources") or {}).get(kind) or {}).get(name, "0"))


def key_value(lookup: ObjectLookup, kind: str, namespace: str, ref: Mapping[str, Any]) -> str | None:
    """A key of a ConfigMap or Secret; None when it is missing and the reference is optional."""
    obj = lookup(kind, namespace, ref["name"])
    data = (obj or {}).get("data") or {}
    if ref["key"] not in data:
        if ref.get("optional"):
            return None
        raise EnvError(f"{kind} {namespace}/{ref['name']} has no key {ref['key']!r}" if obj else
                       f"{kind} {namespace}/{ref['name']} not found")
    value = data[ref["key"]]
    return base64.b64decode(value).decode() if kind == "Secret" else value


def container_env(pod: Mapping[str, Any], container: Mapping[str, Any], lookup: ObjectLookup, pod_ip: str,
                  host_ip: str, base: Mapping[str, str]) -> dict[str, str]:
    """The container's environment over ``base`` (what the kubelet and the image add)."""
    namespace = pod["metadata"]["namespace"]
    env = dict(base)
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            if key not in source:
                continue
            obj = lookup(kind, namespace, source[key]["name"])
            if obj is None and not source[key].get("optional"):
                raise EnvError(f"{kind} {namespace}/{source[key]['name']} not found")
            for name, value in ((obj or {}).get("data") or {}).items():
                env[prefix + name] = base64.b64decode(value).decode() if kind == "Secret" else value
    for var in container.get("env") or []:
        name, source = var["name"], var.get("valueFrom")
        if source is None:
            env[name] = expand(str(var.get("value", "")), env)
        elif "fieldRef" in source:
            env[name] = field_value(pod, source["fieldRef"]["fieldPath"], pod_ip, host_ip)
        elif "resourceFieldRef" in source:
            env[name] = resource_value(container, source["resourceFieldRef"])
        else:
            kind, key = ("Secret", "secretKeyRef") if "secretKeyRef" in source else ("ConfigMap", "configMapKeyRef")
            value = key_value(lookup, kind, namespace, source[key])
            if value is not None:
                env[name] = value
    return env


def container_argv(container: Mapping[str, Any], env: Mapping[str, str],
                   entrypoints: Mapping[str, list[str]]) -> list[str]:
    """command + args, expanded; an image entrypoint named in ``entrypoints`` becomes its local program."""
    argv = [expand(str(a), env) for a in [*(container.get("command") or []), *(container.get("args") or [])]]
    if not argv:
        raise EnvError(f"container {container['name']} has no command (image defaults are not known here)")
    return [*entrypoints[argv[0]], *argv[1:]] if argv[0] in entrypoints else argv
