"""A pod's volumes as folders, and the mount namespace that puts them at their mount paths.

emptyDir, configMap, secret and the service-account token volume become folders under the
pod's directory; hostPath is the host's own path. The container runs in a private mount
namespace (``unshare --mount``) where each folder is bind-mounted at its ``mountPath``, so
the process sees the paths a real pod sees. A mount path whose parent folder does not exist on
this machine (``/etc/splitserve/peers``) is made inside an overlay of its nearest existing
ancestor, so nothing is created on the host's own filesystem.
"""

from __future__ import annotations

import base64
import os
import pathlib
import shlex
from collections.abc import Mapping
from typing import Any

from local_node.pod_env import EnvError, ObjectLookup


def write_files(folder: pathlib.Path, files: Mapping[str, bytes]) -> bool:
    """Makes ``folder`` hold exactly ``files``; returns whether anything changed."""
    folder.mkdir(parents=True, exist_ok=True)
    changed = False
    for old in folder.iterdir():
        if old.name not in files and old.is_file():
            old.unlink()
            changed = True
    for name, content in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_bytes() != content:
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_bytes(content)
            tmp.replace(path)  # atomic, as the kubelet's symlink swap: readers never see half a file
            changed = True
    return changed


def projected_files(kind: str, obj: Mapping[str, Any] | None, source: Mapping[str, Any], where: str,
                    ) -> dict[str, bytes] | None:
    """The files of a configMap or secret volume (None: missing and optional)."""
    if obj is None:
        if source.get("optional"):
            return {}
        raise EnvError(f"{where}: {kind} not found")
    data = {k: (base64.b64decode(v) if kind == "Secret" else v.encode()) for k, v in (obj.get("data") or {}).items()}
    if source.get("items"):
        return {item["path"]: data[item["key"]] for item in source["items"] if item["key"] in data}
    return data


def sync_volumes(pod: Mapping[str, Any], root: pathlib.Path, lookup: ObjectLookup) -> dict[str, pathlib.Path]:
    """Writes every volume of the pod into ``root``; returns volume name -> host folder.

    Called again while the pod runs, so that ConfigMap and Secret volumes follow their objects
    (the kubelet refreshes them too, which is how the peers ConfigMap reaches running pods).
    """
    namespace = pod["metadata"]["namespace"]
    folders: dict[str, pathlib.Path] = {}
    for volume in pod["spec"].get("volumes") or []:
        name, folder = volume["name"], root / "volumes" / volume["name"]
        if "emptyDir" in volume:
            folder.mkdir(parents=True, exist_ok=True)
        elif "hostPath" in volume:
            folder = pathlib.Path(volume["hostPath"]["path"])
            kind = volume["hostPath"].get("type", "")
            if kind == "DirectoryOrCreate":
                folder.mkdir(parents=True, exist_ok=True)
            elif kind == "Directory" and not folder.is_dir():
                raise EnvError(f"volume {name}: hostPath {folder} is not a directory")
        elif "configMap" in volume or "secret" in volume:
            kind, source = ("ConfigMap", volume["configMap"]) if "configMap" in volume else ("Secret", volume["secret"])
            obj_name = source.get("name") or source.get("secretName")
            files = projected_files(kind, lookup(kind, namespace, obj_name), source, f"volume {name}")
            write_files(folder, files or {})
        else:
            raise EnvError(f"volume {name}: kind {sorted(set(volume) - {'name'})} is not supported by the local node")
        folders[name] = folder
    return folders


def nearest_existing(path: pathlib.Path) -> pathlib.Path:
    """The closest ancestor of ``path`` that exists (symlinks resolved)."""
    for parent in path.parents:
        if parent.exists():
            return parent.resolve()
    return pathlib.Path("/")


def mount_script(container: Mapping[str, Any], folders: Mapping[str, pathlib.Path], root: pathlib.Path) -> str:
    """Shell lines that, run in a fresh mount namespace, put each volume at its mount path."""
    lines = ["set -e", "mount --make-rprivate /"]
    overlaid: set[pathlib.Path] = set()
    for i, mount in enumerate(sorted(container.get("volumeMounts") or [], key=lambda m: m["mountPath"])):
        if mount["name"] not in folders:
            raise EnvError(f"volumeMount {mount['name']}: no such volume")
        source = folders[mount["name"]] / mount.get("subPath", "")
        target = pathlib.Path(mount["mountPath"])
        if not target.exists():
            ancestor = nearest_existing(target)
            if ancestor == pathlib.Path("/"):
                raise EnvError(f"mountPath {target}: no folder above it exists on this machine except /")
            if not any(ancestor == o or ancestor.is_relative_to(o) for o in overlaid):
                upper, work = root / "overlay" / f"{i}-upper", root / "overlay" / f"{i}-work"
                upper.mkdir(parents=True, exist_ok=True)
                work.mkdir(parents=True, exist_ok=True)
                lines.append(f"mount -t overlay overlay -o lowerdir={ancestor},upperdir={upper},workdir={work} "
                             f"{ancestor}")
                overlaid.add(ancestor)
            make = "touch" if source.is_file() else "mkdir -p"
            if source.is_file():
                lines.append(f"mkdir -p {shlex.quote(str(target.parent))}")
            lines.append(f"{make} {shlex.quote(str(target))}")
        lines.append(f"mount --bind {shlex.quote(str(source))} {shlex.quote(str(target))}")
        if mount.get("readOnly"):
            lines.append(f"mount -o remount,bind,ro {shlex.quote(str(target))}")
    return "\n".join(lines)


def namespaced_argv(script: str, argv: list[str]) -> list[str]:
    """``argv`` run after ``script`` in a private mount namespace (the shell execs the container)."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{script}\nexec "$@"', "sh", *argv]


def working_dir(container: Mapping[str, Any]) -> str:
    """The container's working directory (``/`` when the image's is not known)."""
    return container.get("workingDir") or os.sep
