"""The tokenizer a GGUF file describes, built with the `tokenizers` library from its metadata:
the byte-level BPE vocabulary and merges, the control tokens as special tokens, BOS/EOS, and the
chat template.

GGUF names the pre-tokenizer (`tokenizer.ggml.pre`) instead of storing it; the splits below are
llama.cpp's for those names.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from splitserve.engine.checkpoints.gguf import GGUFCheckpoint, GGUFError

logger = logging.getLogger(__name__)

# llama.cpp's token types (tokenizer.ggml.token_type).
CONTROL, USER_DEFINED = 3, 4

# Pre-tokenizer names whose text split is GPT-2's regex after isolating every digit.
DIGITS_THEN_GPT2 = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})
GPT2_SPLIT = frozenset({"default", "gpt2", "gpt-2", "mpt", "olmo", "jais"})


@dataclass(frozen=True)
class GGUFTokenizer:
    """What TextTokenizer needs: the tokenizer, the BOS/EOS texts and the chat template."""

    tokenizer: Tokenizer
    bos_token: str | None
    eos_token: str | None
    chat_template: str | None


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character map: printable bytes are themselves, the rest from U+0100 on."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in kept:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The text split llama.cpp applies for `tokenizer.ggml.pre`, then the byte-level mapping."""
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), gpt2])
    if pre is not None and pre not in GPT2_SPLIT:
        logger.warning("GGUF pre-tokenizer %r is not known here; splitting text as GPT-2 does", pre)
    return gpt2


def gguf_tokenizer(ckpt: GGUFCheckpoint) -> GGUFTokenizer:
    """The file's tokenizer; only byte-level BPE (`tokenizer.ggml.model` = gpt2) is supported."""
    kind = ckpt.value("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"{ckpt.path.name}: GGUF tokenizer {kind!r} not supported (only byte-level BPE, 'gpt2')")
    tokens: list[str] = ckpt.value("tokenizer.ggml.tokens")
    types: list[int] = ckpt.value("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in ckpt.value("tokenizer.ggml.merges") or []]
    alphabet = byte_level_alphabet()
    allowed = set(alphabet.values())
    # A vocabulary entry outside the byte alphabet (a mislabelled control token) is respelled in it.
    vocab = {(t if set(t) <= allowed else "".join(alphabet[b] for b in t.encode())): i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizer(ckpt.value("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    # Control and user-defined tokens match whole in the text; only the control ones are special.
    # (One spelled outside the byte alphabet is mislabelled: adding it would grow the vocabulary.)
    marked = [(t, token_type) for t, token_type in zip(tokens, types, strict=True) if set(t) <= allowed]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, k in marked if k == CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in marked if k == USER_DEFINED])

    bos_id, eos_id = ckpt.value("tokenizer.ggml.bos_token_id"), ckpt.value("tokenizer.ggml.eos_token_id")
    bos = None if bos_id is None else tokens[int(bos_id)]
    eos = None if eos_id is None else tokens[int(eos_id)]
    # Tokens the encoder adds around every text: llama.cpp's flags, off unless the file sets them.
    add_bos = bos is not None and bool(ckpt.value("tokenizer.ggml.add_bos_token", False))
    add_eos = eos is not None and bool(ckpt.value("tokenizer.ggml.add_eos_token", False))
    if add_bos or add_eos:
        single = " ".join([bos] * add_bos + ["$A"] + [eos] * add_eos)
        marks = [(bos, int(bos_id))] * add_bos + [(eos, int(eos_id))] * add_eos
        tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=marks)
    return GGUFTokenizer(tok, bos, eos, ckpt.value("tokenizer.chat_template"))
