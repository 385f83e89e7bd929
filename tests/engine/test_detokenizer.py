"""Incremental detokenization: multi-byte characters intact, stop strings cut and held back."""

from __future__ import annotations

import pytest

from splitserve.engine.detokenizer import IncrementalDetokenizer
from splitserve.engine.tiny_model import tiny_model_folder
from splitserve.engine.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> TextTokenizer:
    return TextTokenizer(tiny_model_folder())


def test_multibyte_characters_are_emitted_whole(tokenizer: TextTokenizer) -> None:
    text = "naïve 日本 ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=[])
    deltas = []
    for tid in ids:
        detok.add([tid])
        deltas.append(detok.take_delta(final=False))
    assert "".join(deltas) + detok.take_delta(final=True) == text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_is_cut_and_its_prefix_never_leaks(tokenizer: TextTokenizer) -> None:
    ids = tokenizer.encode("hello STOP world", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["STOP"])
    emitted = ""
    for tid in ids:
        detok.add([tid])
        emitted += detok.take_delta(final=False)
        assert "ST" not in emitted  # held back until it is known whether "STOP" follows
        if detok.stopped_on:
            break
    assert detok.stopped_on == "STOP"
    assert emitted + detok.take_delta(final=True) == "hello "


def test_output_ending_inside_a_character_is_flushed_at_the_end(tokenizer: TextTokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, stop=[])
    detok.add([*tokenizer.encode("a", add_special_tokens=False), 230])  # first byte of a 3-byte char
    assert detok.take_delta(final=False) == "a"
    assert detok.take_delta(final=True) == "\ufffd"
