"""Imported by every Python process the local node starts (it is first on their PYTHONPATH).

The local node gives each pod a loopback address instead of a network namespace. Inside a pod,
a wildcard bind ("0.0.0.0", "") means "the pod's own interfaces"; here it is rewritten to the
pod's address, so that two pods may both listen on port 8000 as they would in a cluster.
"""

import os
import socket

_POD_IP = os.environ.get("LOCAL_NODE_POD_IP")

if _POD_IP:
    _bind = socket.socket.bind

    def _bind_to_pod(self: socket.socket, address: object) -> None:
        if (isinstance(address, tuple) and self.family == socket.AF_INET and address[0] in ("0.0.0.0", "")):
            address = (_POD_IP, *address[1:])
        _bind(self, address)

    socket.socket.bind = _bind_to_pod  # type: ignore[method-assign]
