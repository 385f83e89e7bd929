"""A local node for tests: plays the kubelet for the pods the real kube-scheduler binds to it.

It registers a Node (CPU, memory, ``nvidia.com/gpu`` capacity) and runs each pod's containers
as local processes (``run_pods=True``), or only marks them Running and Ready with an address
(``run_pods=False``, the simulated mode of the scale benchmark). Not a product command.
"""

from local_node.node import LocalNode, NodeCapacity, PodAddresses

__all__ = ["LocalNode", "NodeCapacity", "PodAddresses"]
