"""Checkpoints and the names `--model` takes: safetensors folders, GGUF files, tokenizers and the built-in random
models."""
