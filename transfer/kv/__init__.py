"""KV transfer from prefill to decode: the layout a rank registers, the copy plan, the manager and one room's sender
and receiver."""
