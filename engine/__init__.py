"""The serving engine: model, KV cache, scheduler, sampling, HTTP API, roles and router."""
