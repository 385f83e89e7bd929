"""The OpenAI-compatible HTTP API of one engine: the server, request parsing, tool calls, detokenization, and the
engine core process with its client."""
