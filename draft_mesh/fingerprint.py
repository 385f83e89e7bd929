"""What a verifier and a drafter compare before they may work together."""

from __future__ import annotations

import hashlib
import json

from splitserve.engine.checkpoints.tokenizer import TextTokenizer


def tokenizer_fingerprint(tokenizer: TextTokenizer) -> str:
    """sha256 of the token -> id map (added tokens included) and the special tokens: equal
    fingerprints mean a token id means the same text on both sides."""
    vocab = tokenizer.tokenizer.get_vocab(with_added_tokens=True)
    body = json.dumps({"vocab": sorted(vocab.items(), key=lambda kv: kv[1]),
                       "bos": tokenizer.bos_token, "eos": tokenizer.eos_token}, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def model_fingerprint(architecture: str, num_layers: int, hidden_size: int, vocab_size: int, name: str) -> str:
    """A readable summary of the target model, for the drafter's logs."""
    return f"{name}:{architecture}:L{num_layers}:H{hidden_size}:V{vocab_size}"
