"""The CUDA IPC backend: KV writes between processes on one host's GPUs."""
