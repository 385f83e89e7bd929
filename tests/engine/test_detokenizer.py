"""Incremental detokenization: multi-byte characters intact, stop strings cut and held back."""

from __future__ import annotations

import pytest

from splitserve.engine.detokenizer import IncrementalDetokenizer, add_one_token_each
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


def test_a_step_of_requests_detokenized_together_gives_each_requests_own_text(tokenizer: TextTokenizer) -> None:
    texts = ["naïve 日本 ok", "hello STOP world", "plain ascii text here", "☃ snow ☃"]
    stops = [[], ["STOP"], [], ["now"]]
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    alone = [IncrementalDetokenizer(tokenizer, stop=s) for s in stops]
    together = [IncrementalDetokenizer(tokenizer, stop=s) for s in stops]
    got_alone, got_together = [""] * 4, [""] * 4
    for step in range(max(len(x) for x in ids)):
        rows = [i for i in range(4) if step < len(ids[i])]  # requests end at different steps
        for i in rows:
            alone[i].add([ids[i][step]])
            got_alone[i] += alone[i].take_delta(final=False)
        add_one_token_each([together[i] for i in rows], [ids[i][step] for i in rows])
        for i in rows:
            got_together[i] += together[i].take_delta(final=False)
    got_alone = [g + d.take_delta(final=True) for g, d in zip(got_alone, alone, strict=True)]
    got_together = [g + d.take_delta(final=True) for g, d in zip(got_together, together, strict=True)]
    assert got_together == got_alone == ["naïve 日本 ok", "hello ", "plain ascii text here", "☃ s"]
    assert [d.stopped_on for d in together] == [None, "STOP", None, "now"]
