"""The Mooncake backend: the one place that calls Mooncake's TransferEngine, one engine per peer."""
