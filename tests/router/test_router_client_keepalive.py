"""The router keeps a client's idle keep-alive connection open longer than clients pool them (5 s in httpx and the
OpenAI SDK), so a client reusing a pooled connection never races the router closing it."""

from __future__ import annotations

import socket
import time

import pytest
from server_group import ServerGroup

from splitserve.engine.checkpoints.tiny_model import tiny_model_folder

pytestmark = pytest.mark.slow

IDLE_S = 6.0  # past uvicorn's default keep-alive (5 s), under the router's


def get_models(sock: socket.socket, port: int) -> bytes:
    """One GET /v1/models on a kept-alive connection; its response head and body (Content-Length framed)."""
    sock.sendall(f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data  # the router closed the connection
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def test_an_idle_client_connection_is_still_served_after_six_seconds(tmp_path) -> None:
    g = ServerGroup(tmp_path, tiny_model_folder(0), ["--served-model-name", "m", "--device", "cpu"])
    try:
        engine = g.engine("unified", "unified")
        g.start("router", ["router", "--unified", engine, "--routing", "least-loaded"])
        g.wait()
        port = int(g.url("router").rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            assert get_models(sock, port).startswith(b"HTTP/1.1 200")
            time.sleep(IDLE_S)
            again = get_models(sock, port)
            assert again.startswith(b"HTTP/1.1 200"), again  # the same connection, still open
    finally:
        g.stop()
