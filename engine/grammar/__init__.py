"""Structured outputs: what a request constrains its output to (spec), compiled for the model's
vocabulary (compiler), tracked per sampler slot (slots) and applied to logits (bitmask)."""
