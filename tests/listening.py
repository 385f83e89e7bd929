"""The TCP sockets a process listens on, from /proc (no `ss` needed)."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct

LISTEN = "0A"


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets a process has open."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def decode_address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address of /proc/net/tcp{,6}: 32-bit words in host byte order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(struct.pack("=I", int.from_bytes(raw[i:i + 4], "big")) for i in range(0, len(raw), 4))
    return ipaddress.ip_address(socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words))


def listening(pid: int) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """(address, port) of every TCP socket ``pid`` listens on, IPv4 and IPv6."""
    inodes = socket_inodes(pid)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                local, state, inode = fields[1], fields[3], int(fields[9])
                if state == LISTEN and inode in inodes:
                    address, port = local.split(":")
                    found.append((decode_address(address), int(port, 16)))
    return sorted(found, key=lambda a: (a[1], str(a[0])))


def is_loopback(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """127.0.0.0/8, ::1 or an IPv4-mapped loopback address (::ffff:127.0.0.1)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback
