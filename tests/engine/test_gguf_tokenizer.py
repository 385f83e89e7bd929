"""The tokenizer built from SmolLM2's GGUF metadata equals transformers' tokenizer for that file,
with the digit split llama.cpp applies for its pre-tokenizer name."""

from __future__ import annotations

import itertools
import unicodedata

import pytest
from smollm2_reference import hf_tokenizer, tokenizer_strings
from tokenizers import Tokenizer, pre_tokenizers

from splitserve.engine.checkpoints.model_names import smollm2_file
from splitserve.engine.checkpoints.tokenizer import TextTokenizer

pytestmark = pytest.mark.slow  # two tokenizers of a 49k vocabulary (about 10 s)


@pytest.fixture(scope="module")
def ours() -> TextTokenizer:
    return TextTokenizer(smollm2_file())


def with_digits_isolated(hf_backend: Tokenizer) -> Tokenizer:
    """transformers' tokenizer for the file, splitting off every digit first: what llama.cpp does for
    `tokenizer.ggml.pre = smollm` (and SmolLM2's own tokenizer.json); transformers' GGUF loader
    does not know that name and skips it."""
    tok = Tokenizer.from_str(hf_backend.to_str())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return tok


def whitespace_before_number(text: str) -> bool:
    return any(a.isspace() and unicodedata.category(b).startswith("N") for a, b in itertools.pairwise(text))


def test_encodings_and_decodings_equal_transformers_on_300_strings(ours: TextTokenizer) -> None:
    hf = hf_tokenizer()
    reference = with_digits_isolated(hf.backend_tokenizer)
    strings = tokenizer_strings(300)
    assert len(set(strings)) >= 290
    same_as_hf, differing = 0, []
    for text in strings:
        ids = ours.encode(text)
        if ids != reference.encode(text).ids or ours.decode(ids, skip_special_tokens=False) != hf.decode(ids) \
                or ours.decode(ids) != hf.decode(ids, skip_special_tokens=True):
            differing.append(text)
        if ids == hf.encode(text):
            same_as_hf += 1
        else:  # only where a number follows whitespace ("  1": llama.cpp "ĠĠ 1", transformers "Ġ Ġ1")
            assert whitespace_before_number(text), text
    assert not differing, f"{len(differing)}/{len(strings)} differ, first: {differing[:5]!r}"
    assert same_as_hf >= 280, same_as_hf


def test_special_tokens_bos_eos_and_vocabulary_equal_transformers(ours: TextTokenizer) -> None:
    hf = hf_tokenizer()
    assert (ours.bos_token, ours.eos_token) == (hf.bos_token, hf.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert ours.vocab_size == len(hf) == 49152
    assert ours.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]


def test_chat_template_from_metadata_renders_as_transformers_does(ours: TextTokenizer) -> None:
    hf = hf_tokenizer()
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye 👋"}],
    ]
    for messages in conversations:
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages) == want
        assert want.startswith("<|im_start|>system\n") and want.endswith("<|im_start|>assistant\n")

