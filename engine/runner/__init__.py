"""Turns a step plan into tensors and runs the model: the forward batch, the model runner and its CUDA graphs."""
