"""Keeps Mooncake's listening sockets on loopback when the engine only advertises loopback.

Mooncake (0.3.x) binds its RPC handshake port to ``0.0.0.0`` and its TCP data port to ``[::]``
(dual stack: every IPv4 and IPv6 address) whatever host it is initialized with;
``MC_TCP_BIND_ADDRESS`` only picks the address it advertises. Those ports take writes into
registered memory without authentication, so on one machine (``splitserve up``, tests) they
must not be reachable from the network. Mooncake has no setting for it, so this module redirects
the ``bind`` calls of Mooncake's own libraries: each library's global offset table entry for
``bind`` (the slot the dynamic linker fills with libc's ``bind``) is pointed at a function that
turns a wildcard address into loopback (``0.0.0.0`` -> the loopback host, ``::`` ->
``::ffff:<host>``, on which a dual-stack socket accepts IPv4 loopback connections) and calls
libc's ``bind``. Binds to a specific address, and every other library's (ZeroMQ, gRPC, Python's
sockets), are untouched.

Linux only (``/proc``, ``dlinfo``), x86-64 and AArch64 ELF. Where the patch cannot be applied
:func:`bind_mooncake_to_loopback` says why and Mooncake keeps its wildcard ports.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import mmap
import os
import socket
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Relocation types of a GOT slot holding a function's address: (JUMP_SLOT, GLOB_DAT) per e_machine.
GOT_RELOCATIONS = {62: (7, 6), 183: (1026, 1025)}  # EM_X86_64, EM_AARCH64
SHT_RELA = 4
RTLD_DI_LINKMAP = 2
PROT = {"r": mmap.PROT_READ, "w": mmap.PROT_WRITE, "x": mmap.PROT_EXEC}

_lock = threading.Lock()
_patched: dict[str, str] = {}  # library path -> the loopback address its wildcard binds go to
_keep_alive: list[object] = []  # the callbacks the patched slots point at: never collected


@dataclass(frozen=True)
class Loopback:
    """Where wildcard binds go: an IPv4 address for AF_INET, an IPv6 one for AF_INET6."""

    v4: bytes  # 4 bytes, network order
    v6: bytes  # 16 bytes


def loopback_for(host: str) -> Loopback | None:
    """The loopback addresses a transfer host stands for, or None when it is not a loopback address."""
    if host == "localhost":
        host = "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if not address.is_loopback:
        return None
    if address.version == 4:
        return Loopback(address.packed, ipaddress.IPv6Address(f"::ffff:{address}").packed)
    return Loopback(ipaddress.IPv4Address("127.0.0.1").packed, address.packed)


def rewrite_wildcard(family: int, raw: bytes, to: Loopback) -> bytes | None:
    """A sockaddr_in / sockaddr_in6 with its wildcard address replaced by ``to``; None if it names an address."""
    if family == socket.AF_INET and len(raw) >= 8 and raw[4:8] == b"\0" * 4:
        return raw[:4] + to.v4 + raw[8:]
    if family == socket.AF_INET6 and len(raw) >= 24 and raw[8:24] == b"\0" * 16:
        return raw[:8] + to.v6 + raw[24:]
    return None


def got_slots(path: str, symbol: str) -> list[int]:
    """Offsets (from the load address) of the GOT slots through which the ELF file ``path`` calls ``symbol``."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not a 64-bit little-endian ELF file")
    machine = struct.unpack_from("<H", data, 18)[0]
    if machine not in GOT_RELOCATIONS:
        raise ValueError(f"{path}: machine {machine} not supported")
    types = GOT_RELOCATIONS[machine]
    shoff, = struct.unpack_from("<Q", data, 40)
    shentsize, shnum = struct.unpack_from("<HH", data, 58)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    slots = []
    for _name, kind, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if kind != SHT_RELA or not entsize:
            continue
        symtab, strtab = sections[link], sections[sections[link][6]]
        for at in range(offset, offset + size, entsize):
            r_offset, r_info, _addend = struct.unpack_from("<QQq", data, at)
            if r_info & 0xFFFFFFFF not in types:
                continue
            st_name, = struct.unpack_from("<I", data, symtab[4] + (r_info >> 32) * symtab[9])
            start = strtab[4] + st_name
            if data[start:data.index(b"\0", start)].decode() == symbol:
                slots.append(r_offset)
    return slots


def load_bias(path: str) -> int:
    """The address a loaded shared library's offsets are relative to (its link_map's l_addr)."""
    handle = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # already loaded: no second copy
    libc = ctypes.CDLL(None)
    link_map = ctypes.c_void_p()
    if libc.dlinfo(ctypes.c_void_p(handle._handle), RTLD_DI_LINKMAP, ctypes.byref(link_map)) != 0:
        raise OSError(f"dlinfo({path}) failed")
    return ctypes.c_size_t.from_address(link_map.value).value


def page_protection(address: int) -> int:
    """The current protection of the page holding ``address`` (from /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            bounds, perms = line.split()[:2]
            start, end = (int(x, 16) for x in bounds.split("-"))
            if start <= address < end:
                return sum(PROT[p] for p in perms[:3] if p in PROT)
    raise OSError(f"{address:#x} is not mapped")


def write_pointer(address: int, value: int) -> None:
    """Stores a pointer at ``address``, lifting the page's write protection (RELRO) for the store."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = address & ~(mmap.PAGESIZE - 1)
    before = page_protection(address)
    if not before & mmap.PROT_WRITE and libc.mprotect(page, mmap.PAGESIZE, before | mmap.PROT_WRITE) != 0:
        raise OSError(ctypes.get_errno(), f"mprotect({page:#x}) failed")
    ctypes.c_void_p.from_address(address).value = value
    if not before & mmap.PROT_WRITE:
        libc.mprotect(page, mmap.PAGESIZE, before)


BindFunction = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32)


def loopback_bind(to: Loopback) -> object:
    """A C ``bind`` that narrows wildcard addresses to ``to`` and calls libc's ``bind``."""
    libc = ctypes.CDLL(None, use_errno=True)
    real = libc.bind
    real.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32]
    real.restype = ctypes.c_int
    errno_location = libc.__errno_location
    errno_location.restype = ctypes.POINTER(ctypes.c_int)

    def bind(fd: int, addr: int | None, length: int) -> int:
        try:
            raw = ctypes.string_at(addr, length) if addr and length >= 2 else b""
            family = struct.unpack_from("=H", raw)[0] if raw else -1
            narrowed = rewrite_wildcard(family, raw, to) if raw else None
            if narrowed is not None:
                buffer = ctypes.create_string_buffer(narrowed, length)
                code = real(fd, ctypes.addressof(buffer), length)
            else:
                code = real(fd, addr, length)
        except Exception:  # never into C++ with a Python exception pending
            log.exception("loopback bind failed; calling bind as asked")
            code = real(fd, addr, length)
        errno_location()[0] = ctypes.get_errno()  # the caller reads errno on -1 (EADDRINUSE: next port)
        return code

    return BindFunction(bind)


def mooncake_libraries() -> list[str]:
    """The shared libraries of the mooncake package this process has loaded."""
    import mooncake

    root = os.path.dirname(os.path.abspath(mooncake.__file__))
    roots = (root + os.sep, os.path.join(os.path.dirname(root), "mooncake_transfer_engine"))
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith(roots) and ".so" in os.path.basename(fields[5]):
                found.add(fields[5])
    return sorted(found)


def bind_mooncake_to_loopback(host: str) -> list[str]:
    """Points the ``bind`` of every loaded Mooncake library at :func:`loopback_bind` for ``host`` (a loopback
    address); returns the libraries patched by this call. Call it after importing ``mooncake.engine`` and
    before creating a TransferEngine. Idempotent; a failure is logged, not raised."""
    to = loopback_for(host)
    if to is None:
        raise ValueError(f"{host!r} is not a loopback address")
    patched = []
    with _lock:
        try:
            libraries = mooncake_libraries()
        except (ImportError, OSError) as exc:
            log.warning("Mooncake's ports stay on every interface: cannot list its libraries (%s)", exc)
            return []
        for path in libraries:
            if path in _patched:
                if _patched[path] != host:
                    log.warning("Mooncake's binds in %s already go to %s, not %s", path, _patched[path], host)
                continue
            try:
                slots = got_slots(path, "bind")
                if slots:
                    function = loopback_bind(to)
                    bias = load_bias(path)
                    address = ctypes.cast(function, ctypes.c_void_p).value
                    _keep_alive.append(function)
                    for offset in slots:
                        write_pointer(bias + offset, address)
                    patched.append(path)
                _patched[path] = host
            except (OSError, ValueError, IndexError, struct.error, AttributeError) as exc:
                log.warning("Mooncake's ports in %s stay on every interface: cannot redirect its bind (%s)",
                            os.path.basename(path), exc)
    if patched:
        log.debug("Mooncake binds to %s: %s", host, ", ".join(os.path.basename(p) for p in patched))
    return patched
