"""Client API keys at the router: `Authorization: Bearer KEY`, as OpenAI clients send it.

Keys come from `--api-key` (or SPLITSERVE_ROUTER_API_KEY) and from `--api-key-file`, one key per line (a mounted
Kubernetes Secret, say; `#` starts a comment). The file is read again when it changes, so a rotated Secret takes
effect without a restart. With no key configured the router is open. Health, readiness and metrics stay open
either way: probes and scrapers carry no client key.
"""

from __future__ import annotations

import hmac
import logging
import os
from pathlib import Path

from splitserve.api.openai_protocol import ApiError

logger = logging.getLogger(__name__)


class ApiKeys:
    """The keys a client may show; `check` raises a 401 ApiError for a request without one of them."""

    def __init__(self, key: str = "", key_file: str = "") -> None:
        self.key = key.strip()
        self.key_file = Path(key_file) if key_file else None
        self._file_keys: list[str] = []
        self._file_stamp: tuple[int, int] | None = None
        if self.key_file is not None:
            self._reload()  # a missing or unreadable file fails the start, not the first request

    @property
    def enabled(self) -> bool:
        return bool(self.key or self.key_file)

    def _reload(self) -> None:
        assert self.key_file is not None
        stat = os.stat(self.key_file)
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._file_stamp:
            return
        lines = self.key_file.read_text().splitlines()
        self._file_keys = [k for k in (line.split("#", 1)[0].strip() for line in lines) if k]
        self._file_stamp = stamp
        if not self._file_keys:
            logger.warning("API key file %s holds no key: every request will be refused", self.key_file)

    def keys(self) -> list[str]:
        if self.key_file is not None:
            try:
                self._reload()
            except OSError as exc:  # keep the last keys read: a Secret being rewritten is briefly absent
                logger.warning("API key file %s: %s (keeping the keys read before)", self.key_file, exc)
        return [k for k in (self.key, *self._file_keys) if k]

    def check(self, authorization: str | None) -> None:
        if not self.enabled:
            return
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise ApiError("missing API key: send 'Authorization: Bearer YOUR_KEY'", status=401,
                           kind="invalid_request_error", code="invalid_api_key")
        # Compare with every key, so the time taken does not tell which key a guess came close to.
        if not any([hmac.compare_digest(token.encode(), k.encode()) for k in self.keys()]):
            raise ApiError("incorrect API key provided", status=401, kind="invalid_request_error",
                           code="invalid_api_key")
