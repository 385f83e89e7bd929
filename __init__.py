"""splitserve: disaggregated LLM serving (encode, prefill, decode, drafter) on Kubernetes."""

__version__ = "0.1.0"
