"""Watch caches of the operator's objects, like client-go's informers.

A reconcile used to GET every child it compares (ten per group), and a thousand groups made the
API server, not the operator, the bottleneck. Instead one list+watch per kind (label-selected on
the server: only objects the operator manages) keeps a copy of each child in memory; reconciles
read it, and each change of a child triggers its owner's reconcile (what kopf's per-kind event
handlers did, without kopf's per-object machinery for ten thousand objects).

A cached object may be a moment behind the server. That is safe: updates carry the cached
``resourceVersion`` (a stale one gets HTTP 409 and the reconcile rereads from the server), a create
of an object the cache does not know yet gets 409 and becomes an update, and every change reaches
the cache as an event that triggers one more reconcile. Until a kind's first list has arrived, reads
of it go to the server.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from kubernetes.client import ApiClient

from splitserve.operator.kube import PLURALS, KubeError, watch_events

log = logging.getLogger(__name__)

# Seconds a watch asks the server to keep it open; the client waits a little longer for data.
WATCH_TIMEOUT_S = 240
READ_TIMEOUT_S = WATCH_TIMEOUT_S + 30
RELIST_DELAY_S = 1.0
GLOB_CHARS = frozenset("*?[")



class Seen(NamedTuple):
    """What the watch last delivered of an object (the operator's own writes aside)."""

    resource_version: int
    generation: int | None


# Called with the object as the watch delivered it (on deletion: its last state) and what the
# watch had delivered of it before (None: it is new to the operator).
OnChange = Callable[[dict[str, Any], Seen | None], None]


def compact(obj: Mapping[str, Any]) -> str:
    """The object as it is kept: JSON text without ``managedFields`` (a third of an object's size,
    read by no reconcile). Text, not dicts: a tenth of the memory, and every read is a fresh copy."""
    meta = {k: v for k, v in obj["metadata"].items() if k != "managedFields"}
    return json.dumps({**obj, "metadata": meta}, separators=(",", ":"))


def resource_version(obj: Mapping[str, Any]) -> int:
    """The object's resourceVersion as a number (etcd's revision; -1 when it is not one)."""
    try:
        return int(obj["metadata"].get("resourceVersion", -1))
    except (TypeError, ValueError):
        return -1


def watch_paths(api_version: str, kind: str, namespaces: list[str]) -> list[str]:
    """Collection paths to list and watch: one cluster-wide, or one per named namespace."""
    plural = PLURALS[(api_version, kind)]
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if not namespaces or any(GLOB_CHARS & set(ns) for ns in namespaces):
        return [f"{prefix}/{plural}"]  # globs: watch everywhere, keep the matching namespaces
    return [f"{prefix}/namespaces/{ns}/{plural}" for ns in namespaces]


class KindCache:
    """The objects of one kind that match a label selector, kept current by list+watch threads."""

    def __init__(self, api: ApiClient, api_version: str, kind: str, namespaces: list[str], selector: str,
                 on_change: OnChange, notify_listed: bool = False) -> None:
        """``selector``: a label selector ("" for every object); ``notify_listed``: the first list
        reports each object as new too (what kopf's resume did for the groups and roles)."""
        self.api, self.api_version, self.kind = api, api_version, kind
        self.patterns, self.selector, self.on_change = list(namespaces), selector, on_change
        self.notify_listed = notify_listed
        self.paths = watch_paths(api_version, kind, self.patterns)
        self._objects: dict[tuple[str, str], str] = {}
        self._versions: dict[tuple[str, str], int] = {}  # of the text kept, which may be our own write
        self._seen: dict[tuple[str, str], Seen] = {}  # from the watch only: what changes are told by
        self._lock = threading.Lock()
        self._listed: set[str] = set()
        self.synced = threading.Event()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(path,), daemon=True,
                                          name=f"informer-{kind}-{i}") for i, path in enumerate(self.paths)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()

    def lookup(self, namespace: str, name: str) -> tuple[bool, dict[str, Any] | None]:
        """(whether the cache knows, the object or None when it does not exist)."""
        if not self.synced.is_set():
            return False, None
        with self._lock:
            text = self._objects.get((namespace, name))
        return True, (json.loads(text) if text is not None else None)

    def names(self) -> list[tuple[str, str]]:
        """(namespace, name) of every object held."""
        with self._lock:
            return list(self._objects)

    def __len__(self) -> int:
        with self._lock:
            return len(self._objects)

    def store(self, obj: Mapping[str, Any]) -> None:
        """Keeps an object the operator just wrote (unless the watch brought a newer one already),
        so the next reconcile does not compare against the version before its own write. The
        watch still reports the write as a change when it arrives."""
        if not self._wanted(obj):
            return
        meta, version = obj["metadata"], resource_version(obj)
        key = (meta["namespace"], meta["name"])
        with self._lock:
            if key not in self._objects or version > self._versions[key]:
                self._objects[key], self._versions[key] = compact(obj), version

    def _wanted(self, obj: Mapping[str, Any]) -> bool:
        namespace = obj["metadata"].get("namespace", "")
        return not self.patterns or any(fnmatch.fnmatchcase(namespace, p) for p in self.patterns)

    def _observe(self, obj: Mapping[str, Any]) -> tuple[bool, Seen | None]:
        """Takes what the watch (or a list) delivered: (whether it is a change, what was seen before)."""
        meta, version = obj["metadata"], resource_version(obj)
        key = (meta["namespace"], meta["name"])
        with self._lock:
            before = self._seen.get(key)
            if before is not None and version <= before.resource_version:
                return False, before
            self._seen[key] = Seen(version, meta.get("generation"))
            if key not in self._objects or version >= self._versions[key]:
                self._objects[key], self._versions[key] = compact(obj), version
        return True, before

    def _forget(self, key: tuple[str, str]) -> Seen | None:
        with self._lock:
            self._objects.pop(key, None)
            self._versions.pop(key, None)
            return self._seen.pop(key, None)

    def _run(self, path: str) -> None:
        while not self._stop.is_set():
            try:
                version = self._relist(path)
                while not self._stop.is_set():  # each watch ends after its timeout; go on from there
                    for kind, obj in self._watch(path, version):
                        version = obj["metadata"]["resourceVersion"]
                        if kind == "BOOKMARK" or not self._wanted(obj):
                            continue
                        if kind == "DELETED":
                            before = self._forget((obj["metadata"]["namespace"], obj["metadata"]["name"]))
                        else:
                            changed, before = self._observe(obj)
                            if not changed:
                                continue
                        self._notify(obj, before)
            except Exception as exc:  # a 410 (version too old), a dropped connection, ...
                if not self._stop.is_set():
                    log.info("%s watch of %s ended (%s); listing again", self.kind, path, exc)
                    time.sleep(RELIST_DELAY_S)

    def _relist(self, path: str) -> str:
        query = [("labelSelector", self.selector)] if self.selector else []
        listed = request_json(self.api, path, query)
        items = [dict(item, apiVersion=self.api_version, kind=self.kind) for item in listed.get("items", [])
                 if self._wanted(item)]
        first = path not in self._listed
        seen = {(o["metadata"]["namespace"], o["metadata"]["name"]) for o in items}
        scope = path.split("/namespaces/")[1].split("/")[0] if "/namespaces/" in path else None
        with self._lock:
            gone = [(k, self._objects.get(k)) for k in {*self._objects, *self._seen}
                    if k not in seen and (scope is None or k[0] == scope)]
        gone = [(text, self._forget(k)) for k, text in gone]
        changed = [(o, before) for o in items for is_change, before in [self._observe(o)] if is_change]
        self._listed.add(path)
        if len(self._listed) == len(self.paths):
            self.synced.set()
        if not first or self.notify_listed:
            # Changes a broken watch missed; on the first list, every object (if asked).
            for obj, before in changed:
                self._notify(obj, before)
            for text, before in gone:
                if text is not None:
                    self._notify(json.loads(text), before)
        return listed["metadata"]["resourceVersion"]

    def _notify(self, obj: dict[str, Any], before: Seen | None) -> None:
        try:
            self.on_change(obj, before)
        except Exception:
            log.exception("handling a change of %s %s/%s", self.kind, obj["metadata"].get("namespace"),
                          obj["metadata"].get("name"))

    def _watch(self, path: str, version: str) -> Iterator[tuple[str, dict[str, Any]]]:
        query = [("watch", "true"), ("resourceVersion", version), ("timeoutSeconds", str(WATCH_TIMEOUT_S)),
                 ("allowWatchBookmarks", "true")]
        if self.selector:
            query.append(("labelSelector", self.selector))
        for kind, obj in watch_events(self.api, path, query, self._stop, (10, READ_TIMEOUT_S)):
            yield kind, dict(obj, apiVersion=self.api_version, kind=self.kind)


def request_json(api: ApiClient, path: str, query: list[tuple[str, str]]) -> dict[str, Any]:
    """One GET through ``api``; raises :class:`KubeError` on >= 400."""
    method, url, headers, body, post = api.param_serialize(
        method="GET", resource_path=path, query_params=query, header_params={"Accept": "application/json"},
        auth_settings=["BearerToken"])
    response = api.call_api(method, url, header_params=headers, body=body, post_params=post, _request_timeout=60)
    data = response.read()
    if response.status >= 400:
        raise KubeError("GET", path, response.status, data.decode(errors="replace")[:300])
    return json.loads(data)


@dataclass(frozen=True)
class CachedKind:
    """A kind to cache: which objects (a label selector, "" for all) and whether its first list
    reports every object as new."""

    api_version: str
    kind: str
    selector: str = ""
    notify_listed: bool = False


class ObjectCache:
    """One :class:`KindCache` per kind; ``on_change`` gets every change of any of them."""

    def __init__(self, api: ApiClient, kinds: list[CachedKind], namespaces: list[str], on_change: OnChange) -> None:
        self.kinds = {k.kind: KindCache(api, k.api_version, k.kind, namespaces, k.selector, on_change,
                                        notify_listed=k.notify_listed) for k in kinds}

    def start(self) -> ObjectCache:
        for cache in self.kinds.values():
            cache.start()
        return self

    def stop(self) -> None:
        for cache in self.kinds.values():
            cache.stop()

    def wait_synced(self, timeout: float) -> bool:
        """Whether every kind has listed within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        return all(c.synced.wait(max(0.0, deadline - time.monotonic())) for c in self.kinds.values())

    def lookup(self, kind: str, namespace: str, name: str) -> tuple[bool, dict[str, Any] | None]:
        """(whether the cache knows, the object or None): unknown for kinds not cached or not listed yet."""
        cache = self.kinds.get(kind)
        return cache.lookup(namespace, name) if cache is not None else (False, None)

    def store(self, obj: Mapping[str, Any]) -> None:
        """Keeps what the operator just wrote (see :meth:`KindCache.store`)."""
        cache = self.kinds.get(obj.get("kind", ""))
        if cache is not None and obj.get("metadata", {}).get("resourceVersion"):
            cache.store(obj)
