"""HTTP calls to a bootstrap server: publish a rank's layout, look the whole layout up."""

from __future__ import annotations

import logging
import time

import httpx

from splitserve.transfer.bootstrap_grant import KEY_HEADER
from splitserve.transfer.errors import BootstrapError
from splitserve.transfer.kv.layout import KVLayout

log = logging.getLogger(__name__)


def _headers(key: str) -> dict[str, str]:
    return {KEY_HEADER: key} if key else {}


def publish_layout(bootstrap_addr: str, layout: KVLayout, key: str = "", timeout_s: float = 60.0) -> None:
    """Registers ``layout`` at ``bootstrap_addr``, retrying until it is up or ``timeout_s`` passes.

    Raises ``BootstrapError`` on a refusal (409 mismatch, 401 key) or when time runs out.
    """
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        try:
            resp = httpx.put(f"http://{bootstrap_addr}/layout", json=layout.to_dict(), trust_env=False,
                             headers=_headers(key), timeout=5.0)
            if resp.status_code == 200:
                return
            if resp.status_code in (400, 401, 409):
                raise BootstrapError(f"bootstrap server {bootstrap_addr} refused tp rank "
                                     f"{layout.tp_rank}: {resp.status_code} {resp.text}")
            last = f"{resp.status_code} {resp.text}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        if time.monotonic() > deadline:
            raise BootstrapError(f"cannot register at bootstrap server {bootstrap_addr} within "
                                 f"{timeout_s:g}s: {last}")
        time.sleep(0.1)


def fetch_layouts(bootstrap_addr: str, key: str = "", timeout_s: float = 5.0) -> list[KVLayout] | None:
    """Every prefill rank's layout, or None while the server answers 503 (not all registered).

    Raises ``BootstrapError`` when the server is unreachable or answers garbage.
    """
    try:
        resp = httpx.get(f"http://{bootstrap_addr}/layout", headers=_headers(key), timeout=timeout_s,
                         trust_env=False)
    except httpx.HTTPError as exc:
        raise BootstrapError(f"bootstrap server {bootstrap_addr} unreachable: {exc!r}") from exc
    if resp.status_code == 503:
        return None
    if resp.status_code != 200:
        raise BootstrapError(f"bootstrap server {bootstrap_addr} answered {resp.status_code}: {resp.text}")
    try:
        body = resp.json()
        ranks = [KVLayout.from_dict(r) for r in body["ranks"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise BootstrapError(f"bootstrap server {bootstrap_addr} sent a bad layout: {exc}") from exc
    if [r.tp_rank for r in ranks] != list(range(len(ranks))) or any(r.tp_size != len(ranks) for r in ranks):
        raise BootstrapError(f"bootstrap server {bootstrap_addr} sent inconsistent ranks")
    return ranks
