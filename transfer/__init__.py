"""KV and embedding transfer: bootstrap server, poll states, Mooncake senders and receivers."""
