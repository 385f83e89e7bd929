"""KV transfer between prefill and decode engines: the bootstrap-room poll protocol on Mooncake.

Public API (see README.md in this folder for the protocol and how an engine wires it):

- ``KVPoll``: the poll states (Failed 0 .. Success 4).
- ``TransferConfig``: flags/env of the layer.
- ``KVLayout``, ``layout_for_pool``, ``kv_buffers_from_pool``, ``kv_buffers_from_views``,
  ``aux_buffer_from_tensor``, ``head_range``: what a rank registers.
- ``AuxData``, ``make_aux_tensor``, ``pack_aux``, ``unpack_aux``: the aux slot.
- ``KVManager`` (Mooncake), ``KVSender``, ``KVReceiver``: per engine / per room.
- ``BootstrapServer``: the prefill replica's layout registry over HTTP.
- ``agree_poll_states``, ``poll_and_agree``: MIN across TP ranks.
- errors: ``KVTransferError`` and its subclasses, ``TransferError``.
"""

from .agreement import agree_poll_states, poll_and_agree
from .aux_data import AUX_BYTES, AuxData, make_aux_tensor, pack_aux, unpack_aux
from .bootstrap_server import DEFAULT_BOOTSTRAP_PORT, BootstrapServer
from .config import TransferConfig
from .errors import (
    BootstrapError,
    KVAbortedError,
    KVLengthMismatchError,
    KVMetadataError,
    KVPeerFailedError,
    KVPeerLostError,
    KVTimeoutError,
    KVTransferError,
    KVWriteError,
    LayoutMismatchError,
    RdmaUnavailableError,
    RoomInUseError,
    TransferEngineUnavailableError,
    TransferError,
    TransferUsageError,
)
from .kv_contract import BaseKVManager, BaseKVReceiver, BaseKVSender
from .kv_layout import (
    AuxBuffer,
    KVBuffer,
    KVLayout,
    aux_buffer_from_tensor,
    head_range,
    kv_buffers_from_pool,
    kv_buffers_from_views,
    layout_for_pool,
)
from .kv_manager import MooncakeKVManager
from .kv_receiver import MooncakeKVReceiver
from .kv_sender import MooncakeKVSender
from .poll_state import KVPoll

KVManager = MooncakeKVManager
KVSender = MooncakeKVSender
KVReceiver = MooncakeKVReceiver

__all__ = [
    "AUX_BYTES", "DEFAULT_BOOTSTRAP_PORT", "AuxBuffer", "AuxData", "BaseKVManager", "BaseKVReceiver",
    "BaseKVSender", "BootstrapError", "BootstrapServer", "KVAbortedError", "KVBuffer", "KVLayout",
    "KVLengthMismatchError", "KVManager", "KVMetadataError", "KVPeerFailedError", "KVPeerLostError",
    "KVPoll", "KVReceiver", "KVSender", "KVTimeoutError", "KVTransferError", "KVWriteError",
    "LayoutMismatchError", "MooncakeKVManager", "MooncakeKVReceiver", "MooncakeKVSender",
    "RdmaUnavailableError", "RoomInUseError", "TransferConfig", "TransferEngineUnavailableError",
    "TransferError", "TransferUsageError", "agree_poll_states", "aux_buffer_from_tensor", "head_range",
    "kv_buffers_from_pool", "kv_buffers_from_views", "layout_for_pool", "make_aux_tensor",
    "pack_aux", "poll_and_agree", "unpack_aux",
]
