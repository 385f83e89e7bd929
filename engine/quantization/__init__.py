"""Weight quantization: FP8 checkpoints (compressed-tensors, ModelOpt) and FP8 on load (docs/fp8.md)."""
