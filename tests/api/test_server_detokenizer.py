"""The API server's detokenizers (`serve --engine-process`): the text they put in the core's output
rows is the text the engine makes itself from the same tokens."""

from __future__ import annotations

from splitserve.api.core_protocol import ROW_KEY, ROW_TEXT, output_to_wire
from splitserve.api.detokenizer import IncrementalDetokenizer
from splitserve.api.server_detokenizer import ServerDetokenizers, detokenized_by_server
from splitserve.engine.checkpoints.tiny_model import tiny_model_folder
from splitserve.engine.checkpoints.tokenizer import TextTokenizer
from splitserve.engine.request import FinishReason, TokenOutput
from splitserve.engine.sampling_params import SamplingParams


def engine_outputs(tokenizer: TextTokenizer, tokens: list[int], eos: int, last: FinishReason | None
                   ) -> list[TokenOutput]:
    """What the engine emits for a request given `tokens` one per step: its own detokenizer's deltas;
    EOS ends it (no text), `last` ends it on its last token (None: the stream is aborted after it)."""
    detok, outs = IncrementalDetokenizer(tokenizer, []), []
    for i, token in enumerate(tokens):
        finish = FinishReason.STOP if token == eos else (last if i == len(tokens) - 1 else None)
        if token != eos:
            detok.add([token])
        outs.append(TokenOutput("r", [token], detok.take_delta(final=finish is not None), finish_reason=finish))
        if finish is not None:
            return outs
    outs.append(TokenOutput("r", [], detok.take_delta(final=True), finish_reason=FinishReason.ABORT))
    return outs


def test_the_server_makes_the_engines_text_from_the_token_ids() -> None:
    tokenizer = TextTokenizer(tiny_model_folder())
    eos = tokenizer.token_id(tokenizer.eos_token)
    snow = tokenizer.encode("☃ naïve", add_special_tokens=False)
    requests = {  # key: (tokens, how it ends)
        0: (tokenizer.encode("plain text", add_special_tokens=False), FinishReason.LENGTH),
        1: ([*snow, 100000, eos], None),  # an id past the vocabulary, then EOS ends it
        2: ([snow[0], snow[1]], None),  # aborted inside a character: the replacement at the end
        3: (snow, FinishReason.LENGTH),
    }
    engine = {key: engine_outputs(tokenizer, tokens, eos, last) for key, (tokens, last) in requests.items()}
    server = ServerDetokenizers(tokenizer)
    for key in engine:
        server.open(key)
    rows_of = {key: [] for key in engine}
    messages = []  # one per step; request 3 sends two rows in some steps (verified drafts)
    cursor = dict.fromkeys(engine, 0)
    while any(cursor[k] < len(engine[k]) for k in engine):
        message = []
        for key, outs in engine.items():
            for _ in range(2 if key == 3 else 1):
                if cursor[key] < len(outs):
                    row = output_to_wire(outs[cursor[key]])
                    row[ROW_KEY], row[ROW_TEXT] = key, ""  # the core sends no text for these requests
                    message.append(row)
                    rows_of[key].append(row)
                    cursor[key] += 1
        messages.append(message)
    for message in messages:
        server.fill(message)
    for key, outs in engine.items():
        assert [row[ROW_TEXT] for row in rows_of[key]] == [out.text for out in outs], key
    assert "".join(out.text for out in engine[3]) == "☃ naïve"
    assert len(server) == 0  # every request ended: none kept


def test_requests_with_stop_strings_keep_their_text_in_the_core() -> None:
    assert detokenized_by_server(SamplingParams())
    assert detokenized_by_server(SamplingParams(stop=[""]))  # an empty stop string stops nothing
    assert not detokenized_by_server(SamplingParams(stop=["\n"]))
    server = ServerDetokenizers(TextTokenizer(tiny_model_folder()))
    row = output_to_wire(TokenOutput("r", [72], "H"))
    row[ROW_KEY] = 7  # a key never opened here: the core's text stays
    server.fill([row])
    assert row[ROW_TEXT] == "H"


def test_a_stream_closed_while_its_last_row_is_filled_does_not_stop_the_reader() -> None:
    """`close` runs on the event loop (the client left), `fill` on the reader thread: a close that lands
    between the reader's lookup of a request and the end of its last row must not raise there (the
    exception would end the reader thread, and no output of any request would arrive after it)."""

    class ClosedAfterLookup(dict):
        def get(self, key, default=None):
            found = super().get(key, default)
            self.pop(key, None)  # the event loop's close(key), just after the reader's lookup
            return found

    tokenizer = TextTokenizer(tiny_model_folder())
    server = ServerDetokenizers(tokenizer)
    server.open(5)
    server._by_key = ClosedAfterLookup(server._by_key)
    row = output_to_wire(TokenOutput("r", [72], "", finish_reason=FinishReason.LENGTH))
    row[ROW_KEY] = 5
    server.fill([row])
    assert row[ROW_TEXT] == tokenizer.decode([72]) and len(server) == 0
