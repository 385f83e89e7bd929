"""Mooncake's listening ports narrowed to loopback (transfer/mooncake/loopback_bind.py)."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from listening import is_loopback

from splitserve.transfer.mooncake.loopback_bind import Loopback, got_slots, loopback_for, rewrite_wildcard

TESTS = Path(__file__).resolve().parents[1]


def sockaddr_in(address: str, port: int) -> bytes:
    return socket.AF_INET.to_bytes(2, sys.byteorder) + port.to_bytes(2, "big") + \
        ipaddress.IPv4Address(address).packed + b"\0" * 8


def sockaddr_in6(address: str, port: int) -> bytes:
    return socket.AF_INET6.to_bytes(2, sys.byteorder) + port.to_bytes(2, "big") + b"\0" * 4 + \
        ipaddress.IPv6Address(address).packed + b"\0" * 4


def test_only_loopback_hosts_are_narrowed_to() -> None:
    v4 = loopback_for("127.0.0.1")
    assert v4 == loopback_for("localhost") == Loopback(bytes([127, 0, 0, 1]),
                                                       ipaddress.IPv6Address("::ffff:127.0.0.1").packed)
    assert loopback_for("127.0.0.2").v4 == bytes([127, 0, 0, 2])
    assert loopback_for("::1") == Loopback(bytes([127, 0, 0, 1]), ipaddress.IPv6Address("::1").packed)
    for host in ("10.1.0.7", "0.0.0.0", "::", "pod.example", ""):
        assert loopback_for(host) is None, host


def test_wildcards_become_loopback_and_specific_addresses_stay() -> None:
    to = loopback_for("127.0.0.1")
    assert rewrite_wildcard(socket.AF_INET, sockaddr_in("0.0.0.0", 15001), to) == sockaddr_in("127.0.0.1", 15001)
    # A dual-stack socket bound to ::ffff:127.0.0.1 takes IPv4 loopback connections, as peers make them.
    assert rewrite_wildcard(socket.AF_INET6, sockaddr_in6("::", 16001), to) == sockaddr_in6("::ffff:127.0.0.1", 16001)
    assert rewrite_wildcard(socket.AF_INET, sockaddr_in("10.1.0.7", 15001), to) is None
    assert rewrite_wildcard(socket.AF_INET6, sockaddr_in6("::1", 15001), to) is None
    assert rewrite_wildcard(socket.AF_UNIX, b"\x01\x00/tmp/x", to) is None


def test_mooncakes_library_calls_bind_through_its_got() -> None:
    mooncake = pytest.importorskip("mooncake.engine")
    assert got_slots(mooncake.__file__, "bind"), "engine.so imports bind"
    assert got_slots(mooncake.__file__, "no_such_symbol") == []


PROBE = textwrap.dedent("""
    import ctypes, json, os, sys
    sys.path.insert(0, sys.argv[1])
    from listening import listening
    from splitserve.transfer.mooncake.engine import MooncakeEngine
    a, b = MooncakeEngine("127.0.0.1", "tcp"), MooncakeEngine("127.0.0.1", "tcp")
    src, dst = ctypes.create_string_buffer(b"k" * 65536), ctypes.create_string_buffer(65536)
    a.register(ctypes.addressof(src), 65536)
    b.register(ctypes.addressof(dst), 65536)
    code = a.write(b.session_id, [ctypes.addressof(src)], [ctypes.addressof(dst)], [65536])
    print(json.dumps({"code": code, "landed": dst.raw == b"k" * 65536,
                      "listening": [[str(x), p] for x, p in listening(os.getpid())]}))
""")


def test_engines_on_loopback_listen_on_loopback_only_and_still_transfer() -> None:
    """In a process of its own: the redirection is process-wide and for good."""
    pytest.importorskip("mooncake.engine")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MC_")}  # no MC_TCP_BIND_ADDRESS
    out = subprocess.run([sys.executable, "-P", "-c", PROBE, str(TESTS)], capture_output=True, text=True,
                         env=env, cwd=TESTS.parents[1], timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["code"] == 0 and result["landed"]
    found = [(ipaddress.ip_address(a), p) for a, p in result["listening"]]
    assert len(found) >= 4, found  # two engines: an RPC handshake port and a TCP data port each
    assert all(is_loopback(a) for a, _ in found), found
