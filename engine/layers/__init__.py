"""Layers, one file per kind."""
