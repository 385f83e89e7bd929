"""Image-embedding transfer from encode to prefill: slots, messages, and one item's sender and receiver."""
