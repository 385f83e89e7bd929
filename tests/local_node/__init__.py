"""A local node for tests: plays the kubelet for the pods the real kube-scheduler binds to it.

It registers a Node (CPU, memory, ``nvidia.com/gpu`` capacity) and runs each pod's containers
as local processes (``run_pods=True``), or only marks them Running and Ready with an address
(``run_pods=False``, the simulated mode of the scale benchmark). Not a product command.

What it does not do (the pods the operator builds need none of it): init containers are not
run, ``securityContext`` (users, capabilities, privileged, read-only root) is ignored (every
process runs as the test's user), resource limits are not enforced (no cgroups), images are not
pulled (only ``known_images`` run, as this machine's ``splitserve``), there is no network
namespace (a pod binds its own address from a locally routed range) and no kube-proxy (Service
cluster IPs do not answer; pods' cluster DNS names resolve through the node's hosts file).
"""

from local_node.node import LocalNode, NodeCapacity, PodAddresses

__all__ = ["LocalNode", "NodeCapacity", "PodAddresses"]
