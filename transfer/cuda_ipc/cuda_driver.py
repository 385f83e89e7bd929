"""The one place that calls the CUDA driver (``libcuda``) directly, through ctypes: CUDA IPC.

What the ``cuda_ipc`` backend needs and torch does not offer for a raw pointer: the allocation
an address belongs to (``cuMemGetAddressRange``), an IPC handle for it (``cuIpcGetMemHandle``),
and opening / closing a peer's handle (``cuIpcOpenMemHandle`` / ``cuIpcCloseMemHandle``).
Every call's ``CUresult`` is checked and turned into ``CudaDriverError``.

Driver calls act on the calling thread's current context: each entry point first makes the
device's primary context (the one torch's runtime uses) current, so worker threads work too.
"""

from __future__ import annotations

import ctypes
import threading

from splitserve.transfer.errors import TransferError

IPC_HANDLE_BYTES = 64
CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class CudaDriverError(TransferError):
    """A CUDA driver call returned an error."""

    def __init__(self, call: str, code: int, name: str, detail: str = "") -> None:
        self.call = call
        self.code = code
        super().__init__(f"CUDA driver {call} failed: {name} ({code})" + (f": {detail}" if detail else ""))


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]


class CudaDriver:
    """ctypes bindings of the few driver calls CUDA IPC needs, for one device."""

    _lib: ctypes.CDLL | None = None
    _lib_lock = threading.Lock()

    def __init__(self, device_index: int) -> None:
        self.lib = self._load()
        self.device_index = device_index
        self._check("cuInit", self.lib.cuInit(0))
        device = ctypes.c_int()
        self._check("cuDeviceGet", self.lib.cuDeviceGet(ctypes.byref(device), device_index))
        self._context = ctypes.c_void_p()
        self._check("cuDevicePrimaryCtxRetain",
                    self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self._context), device))

    @classmethod
    def _load(cls) -> ctypes.CDLL:
        with cls._lib_lock:
            if cls._lib is None:
                lib = ctypes.CDLL("libcuda.so.1")
                lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcMemHandle, ctypes.c_uint]
                lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcMemHandle), ctypes.c_uint64]
                lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
                lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                                        ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
                lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
                cls._lib = lib
            return cls._lib

    def _check(self, call: str, code: int, detail: str = "") -> None:
        if code != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(code, ctypes.byref(name))
            raise CudaDriverError(call, code, (name.value or b"?").decode(), detail)

    def _make_current(self) -> None:
        self._check("cuCtxSetCurrent", self.lib.cuCtxSetCurrent(self._context))

    def allocation_of(self, ptr: int) -> tuple[int, int]:
        """(base, size) of the device allocation holding ``ptr``."""
        self._make_current()
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._check("cuMemGetAddressRange", self.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                                                               ptr),
                    f"{ptr:#x} is not CUDA device memory of device {self.device_index}")
        return base.value, size.value

    def ipc_handle(self, base: int) -> bytes:
        """The IPC handle of the allocation starting at ``base``."""
        self._make_current()
        handle = _IpcMemHandle()
        self._check("cuIpcGetMemHandle", self.lib.cuIpcGetMemHandle(ctypes.byref(handle), base),
                    f"allocation {base:#x} (memory from cuMemCreate, e.g. PyTorch's expandable segments, "
                    "has no legacy IPC handle)")
        return ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_BYTES)  # .reserved stops at a NUL

    def open_ipc_handle(self, handle: bytes) -> int:
        """Maps a peer process's allocation into this one; returns its base address here."""
        if len(handle) != IPC_HANDLE_BYTES:
            raise ValueError(f"an IPC handle has {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
        self._make_current()
        ptr = ctypes.c_uint64()
        self._check("cuIpcOpenMemHandle", self.lib.cuIpcOpenMemHandle_v2(
            ctypes.byref(ptr), _IpcMemHandle.from_buffer_copy(handle), CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
            "the peer must run on this host, on a GPU this one can reach, in another process")
        return ptr.value

    def close_ipc_handle(self, ptr: int) -> None:
        """Unmaps what ``open_ipc_handle`` returned."""
        self._make_current()
        self._check("cuIpcCloseMemHandle", self.lib.cuIpcCloseMemHandle(ptr))
