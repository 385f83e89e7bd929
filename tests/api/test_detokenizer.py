"""Incremental detokenization: multi-byte characters intact, stop strings cut and held back."""

from __future__ import annotations

import pytest

from splitserve.api.detokenizer import IncrementalDetokenizer, add_one_token_each
from splitserve.engine.checkpoints.tiny_model import tiny_model_folder
from splitserve.engine.checkpoints.tokenizer import TextTokenizer


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


def windowed_reference(tokenizer: TextTokenizer, ids: list[int], stop: list[str]) -> tuple[list[str], str | None]:
    """The incremental algorithm over every id (decode drops some itself): the deltas a request
    gets token by token and at its end, and the stop string it ended on."""
    hold = max((len(s) for s in stop), default=1) - 1
    text, emitted, prefix, read, deltas = "", 0, 0, 0, []
    for n in range(1, len(ids) + 1):
        before = tokenizer.decode(ids[prefix:read])
        after = tokenizer.decode(ids[prefix:n])
        if not after.endswith("\ufffd") and len(after) > len(before):
            search_from = max(0, len(text) - hold)
            text += after[len(before):]
            prefix, read = max(0, n - 6), n
            found = [(text.find(s, search_from), s) for s in stop if text.find(s, search_from) != -1]
            if found:
                at, s = min(found)
                deltas.append(text[emitted:at])
                return deltas, s
        end = max(emitted, len(text) - hold)
        deltas.append(text[emitted:end])
        emitted = end
    if read < len(ids):
        text += tokenizer.decode(ids[prefix:])[len(tokenizer.decode(ids[prefix:read])):]
    deltas.append(text[emitted:])
    return deltas, None


def test_ids_decode_drops_give_the_same_text_and_keep_the_windows_short(tokenizer: TextTokenizer) -> None:
    """Ids past the vocabulary (random weights of a real shape emit them) and special tokens (skipped)
    never enter the windows: every delta is the one the windows over all ids give, multi-byte
    characters and stop strings across them included, and a run of them decodes nothing."""
    unknown, special = tokenizer.vocab_size + 1000, tokenizer.token_id(tokenizer.eos_token)
    assert special is not None and tokenizer.decoded_ids()[special] == 0 and tokenizer.decoded_ids(False)[special] == 1
    parts = ["naïve", " 日本", " ST", "OP", " ok ☃"]
    cases = []
    for seed in range(6):
        ids: list[int] = []
        for i, part in enumerate(parts):
            ids += tokenizer.encode(part, add_special_tokens=False)
            ids += [unknown + seed, special, unknown][: (seed + i) % 4]
        cases.append((ids, [["STOP"], [], ["日本 S"]][seed % 3]))
    mid_char = tokenizer.encode("日", add_special_tokens=False)
    cases.append(([mid_char[0], unknown, special, *mid_char[1:], unknown], []))  # drops inside a character
    for ids, stop in cases:
        want, want_stop = windowed_reference(tokenizer, ids, stop)
        for batched in (False, True):
            detok = IncrementalDetokenizer(tokenizer, stop=stop)
            got = []
            for tid in ids:
                if batched:
                    add_one_token_each([detok], [tid])
                else:
                    detok.add([tid])
                if detok.stopped_on is not None:
                    break
                got.append(detok.take_delta(final=False))
            got.append(detok.take_delta(final=True))
            assert (got, detok.stopped_on) == (want, want_stop), (ids, stop, batched)
    detok = IncrementalDetokenizer(tokenizer, stop=[])
    detok.add(tokenizer.encode("ab", add_special_tokens=False) + [unknown] * 300 + [special] * 300)
    assert detok.ids == tokenizer.encode("ab", add_special_tokens=False)  # nothing to decode came in
    assert detok.take_delta(final=True) == "ab"
