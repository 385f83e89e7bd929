"""Tool calling: the request's tools and tool_choice (request), the grammar that forces a call
(forcing), how a template's model writes calls and how they are read back (formats), and
the streamed form of calls (streaming)."""
