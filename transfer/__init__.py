"""KV transfer between prefill and decode engines: the bootstrap-room poll protocol on Mooncake.

Public API (see README.md in this folder for the protocol and how an engine wires it):

- ``KVPoll``: the poll states (Failed 0 .. Success 4).
- ``TransferConfig``: flags/env of the layer.
- ``KVLayout``, ``layout_for_pool``, ``kv_buffers_from_pool``, ``kv_buffers_from_views``,
  ``aux_buffer_from_tensor``, ``head_range``: what a rank registers.
- ``AuxData``, ``make_aux_tensor``, ``pack_aux``, ``AuxWriter``, ``unpack_aux``, ``AuxReader``: the aux slot.
- ``KVManager`` (one per engine rank, over Mooncake; the CUDA IPC manager subclasses it), ``KVSender``,
  ``KVReceiver``: per engine / per room; ``new_kv_manager`` picks the backend by ``transfer_protocol``
  (``CudaIpcKVManager`` for ``cuda_ipc``).
- ``BootstrapServer``: the prefill replica's layout registry over HTTP.
- ``agree_poll_states``, ``poll_and_agree``: MIN across TP ranks.
- errors: ``KVTransferError`` and its subclasses, ``TransferError``.
"""

import importlib
from typing import Any

# Names are loaded on first use, so that a light user of one module (the router signs grants
# with bootstrap_grant) does not import torch and Mooncake with the rest.
_MODULE_OF = {
    "agree_poll_states": "agreement", "poll_and_agree": "agreement",
    "AUX_BYTES": "kv.aux_data", "AuxData": "kv.aux_data", "AuxReader": "kv.aux_data", "AuxWriter": "kv.aux_data",
    "make_aux_tensor": "kv.aux_data",
    "pack_aux": "kv.aux_data",
    "unpack_aux": "kv.aux_data",
    "DEFAULT_BOOTSTRAP_PORT": "bootstrap_server", "BootstrapServer": "bootstrap_server",
    "TransferConfig": "config",
    **{name: "errors" for name in (
        "BootstrapError", "CudaIpcError", "CudaIpcUnavailableError", "KVAbortedError", "KVLengthMismatchError",
        "KVMetadataError", "KVPeerFailedError", "KVPeerLostError", "KVTimeoutError", "KVTransferError",
        "KVWorkerError", "KVWriteError",
        "LayoutMismatchError", "RdmaUnavailableError", "RoomInUseError", "TransferEngineUnavailableError",
        "TransferError", "TransferUsageError")},
    "BaseKVManager": "contract", "BaseKVReceiver": "contract", "BaseKVSender": "contract",
    **{name: "kv.layout" for name in (
        "AuxBuffer", "KVBuffer", "KVLayout", "aux_buffer_from_tensor", "head_range", "kv_buffers_from_pool",
        "kv_buffers_from_views", "layout_for_pool")},
    "CudaIpcKVManager": "cuda_ipc.manager", "aux_device": "kv.backend", "new_kv_manager": "kv.backend",
    "KVManager": "kv.manager", "KVReceiver": "kv.receiver", "KVSender": "kv.sender",
    "KVPoll": "poll_state",
}


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "AUX_BYTES",
    "DEFAULT_BOOTSTRAP_PORT",
    "AuxBuffer",
    "AuxData",
    "AuxReader",
    "AuxWriter",
    "BaseKVManager",
    "BaseKVReceiver",
    "BaseKVSender",
    "BootstrapError",
    "BootstrapServer",
    "CudaIpcError",
    "CudaIpcKVManager",
    "CudaIpcUnavailableError",
    "KVAbortedError",
    "KVBuffer",
    "KVLayout",
    "KVLengthMismatchError",
    "KVManager",
    "KVMetadataError",
    "KVPeerFailedError",
    "KVPeerLostError",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "KVTimeoutError",
    "KVTransferError",
    "KVWorkerError",
    "KVWriteError",
    "LayoutMismatchError",
    "RdmaUnavailableError",
    "RoomInUseError",
    "TransferConfig",
    "TransferEngineUnavailableError",
    "TransferError",
    "TransferUsageError",
    "agree_poll_states",
    "aux_buffer_from_tensor",
    "aux_device",
    "head_range",
    "kv_buffers_from_pool",
    "kv_buffers_from_views",
    "layout_for_pool",
    "make_aux_tensor",
    "new_kv_manager",
    "pack_aux",
    "poll_and_agree",
    "unpack_aux",
]
