"""The disaggregated roles: what each adds to the engine loop."""
