"""Structured outputs in the sampling backends: the grammar bitmask in sample() and verify(),
its state rebuilt from tokens, and the request fields that ask for it."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from splitserve.engine.checkpoints.tiny_model import EOS, tiny_model_folder
from splitserve.engine.checkpoints.tokenizer import TextTokenizer
from splitserve.engine.grammar.bitmask import apply_bitmask, bitmask_of
from splitserve.engine.grammar.compiler import GrammarCompiler, InvalidGrammar
from splitserve.engine.grammar.slots import GrammarSlots
from splitserve.engine.grammar.spec import GrammarSpec, InvalidGrammarField, grammar_spec_from
from splitserve.engine.sampling import FullSampler, SamplingBatch
from splitserve.engine.sampling_params import InvalidSamplingParams, SamplingParams

xgr = pytest.importorskip("xgrammar")

VOCAB = 320
SCHEMA = {
    "type": "object",
    "properties": {
        # ASCII: xgrammar 0.2.9 lets random bytes form overlong 4-byte UTF-8 in free strings
        "name": {"type": "string", "pattern": "^[a-z ]{1,6}$"},
        "code": {"type": "string", "pattern": "^[A-Z]{0,3}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "code", "age", "kind", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer(tiny_model_folder(0))


@pytest.fixture(scope="module")
def compiler(tokenizer: TextTokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.tokenizer, VOCAB, [tokenizer.token_id(EOS)])


def sampler_for(compiler: GrammarCompiler, slots: int = 4) -> FullSampler:
    sampler = FullSampler(slots, VOCAB, seed=0)
    sampler.grammar = GrammarSlots(compiler)
    return sampler


def spec(schema: dict) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema))


def generate(sampler: FullSampler, slot: int, params: SamplingParams, logits_gen: torch.Generator,
             eos: int, max_tokens: int = 200) -> list[int]:
    sampler.reset_slot(slot, params, [1, 2])
    out: list[int] = []
    for _ in range(max_tokens):
        logits = torch.randn(1, VOCAB, generator=logits_gen) * 3
        batch = SamplingBatch(torch.tensor([slot]), [params], host_slots=[slot])
        token = int(sampler.sample(logits, batch).tokens[0])
        sampler.commit(torch.tensor([slot]), [[token]])
        if token == eos:
            return out
        out.append(token)
    raise AssertionError("the grammar did not end within max_tokens")


def test_bitmask_matches_xgrammar_apply() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 10), dtype=torch.int32, generator=gen)
    ours = apply_bitmask(logits, bitmask)
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, bitmask)
    assert torch.equal(ours, theirs)
    assert torch.equal(apply_bitmask(logits, bitmask_of([5, 300], VOCAB).expand(3, -1)).isfinite().nonzero()[:, 1],
                       torch.tensor([5, 300, 5, 300, 5, 300]))


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_random_logits_under_a_schema_always_give_valid_json(compiler, tokenizer, temperature: float) -> None:
    sampler = sampler_for(compiler)
    eos = tokenizer.token_id(EOS)
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(max_new_tokens=200, temperature=temperature, grammar=spec(SCHEMA))
    for trial in range(20 if temperature else 3):
        text = tokenizer.decode(generate(sampler, trial % 4, params, gen, eos))
        jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_choice_and_ebnf_constrain_the_output(compiler, tokenizer) -> None:
    sampler = sampler_for(compiler)
    eos = tokenizer.token_id(EOS)
    gen = torch.Generator().manual_seed(2)
    cases = [({"guided_regex": "[a-c]{2,4}-[0-9]"}, r"^[a-c]{2,4}-[0-9]$"),
             ({"guided_choice": ["yes", "no", 'a "b"\\']}, r'^(yes|no|a "b"\\)$'),
             ({"ebnf": 'root ::= "x" ("y" | "z")*  "!"'}, r"^x[yz]*!$"),
             ({"regex": "(ab)+"}, r"^(ab)+$")]
    import re
    for body, pattern in cases:
        params = SamplingParams(max_new_tokens=300, grammar=grammar_spec_from(body))
        for trial in range(5):
            text = tokenizer.decode(generate(sampler, trial % 4, params, gen, eos, max_tokens=300))
            assert re.match(pattern, text), (body, text)


def test_state_rebuilt_from_tokens_gives_the_same_masks(compiler, tokenizer) -> None:
    """What a decode engine does with the prefill's first token: reset, then commit the tokens so far."""
    slots = GrammarSlots(compiler)
    text = '{"name": "ab", "code": "X", "age": 1'
    ids = tokenizer.encode(text, add_special_tokens=False)
    slots.reset(0, spec(SCHEMA))
    for i, t in enumerate(ids):
        slots.commit(0, [t])
        slots.reset(1, spec(SCHEMA))
        slots.commit(1, ids[: i + 1])
        assert torch.equal(slots.fill([0]), slots.fill([1]))


def test_verify_accepts_a_draft_token_only_if_the_grammar_allows_it(compiler, tokenizer) -> None:
    sampler = sampler_for(compiler)
    greedy = SamplingParams(temperature=0.0, grammar=GrammarSpec("regex", "[0-9]+x"))
    sampler.reset_slot(0, greedy, [1])
    digit = tokenizer.encode("7", add_special_tokens=False)[0]
    letter = tokenizer.encode("q", add_special_tokens=False)[0]
    before = sampler.grammar.fill([0])
    # The target model prefers the draft everywhere (+20 at its token): only the grammar rejects.
    draft = [digit, digit, letter, digit]
    logits = torch.zeros(1, len(draft) + 1, VOCAB)
    for j, t in enumerate(draft):
        logits[0, j, t] = 20.0
    logits[0, len(draft), digit] = 20.0
    batch = SamplingBatch(torch.tensor([0]), [greedy], host_slots=[0])
    out = sampler.verify(logits, torch.tensor([draft]), batch)
    assert int(out.accept_lengths[0]) == 3  # two digits accepted, the letter rejected, a correction
    correction = int(out.tokens[0, 2])
    assert tokenizer.decode([correction]) in [*"0123456789", "x"]
    assert torch.equal(sampler.grammar.fill([0]), before)  # verify walked the matcher and rolled it back
    sampler.commit(torch.tensor([0]), [out.tokens[0, :3].tolist()])
    assert not torch.equal(sampler.grammar.fill([0]), before) or correction != digit

    # Sampled verification (temperature 1, deterministic draft) never accepts a forbidden token either.
    sampled = SamplingParams(temperature=1.0, grammar=GrammarSpec("regex", "[0-9]+x"))
    for trial in range(20):
        sampler.reset_slot(1, sampled, [1])
        out = sampler.verify(logits, torch.tensor([draft]), SamplingBatch(torch.tensor([1]), [sampled]))
        n = int(out.accept_lengths[0])
        assert n <= 3
        assert all(tokenizer.decode([t]) in [*"0123456789", "x"] for t in out.tokens[0, :n].tolist()), trial


def test_unconstrained_rows_of_a_batch_are_untouched(compiler) -> None:
    sampler = sampler_for(compiler)
    free = SamplingParams(temperature=0.0, repetition_penalty=1.0, logit_bias={3: 0.0})
    bound = SamplingParams(temperature=0.0, grammar=GrammarSpec("regex", "z"))
    sampler.reset_slot(0, free, [1])
    sampler.reset_slot(1, bound, [1])
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    out = sampler.sample(logits, SamplingBatch(torch.tensor([0, 1]), [free, bound]))
    assert int(out.tokens[0]) == int(logits[0].argmax())
    assert int(out.tokens[1]) == ord("z")


def test_request_fields() -> None:
    assert grammar_spec_from({}) is None
    assert grammar_spec_from({"response_format": {"type": "text"}}) is None
    assert grammar_spec_from({"response_format": {"type": "json_object"}}).kind == "json_object"
    s = grammar_spec_from({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                                                      "strict": True}}})
    assert s.kind == "json_schema" and json.loads(s.source) == SCHEMA
    assert grammar_spec_from({"guided_json": json.dumps(SCHEMA)}) == s
    assert grammar_spec_from({"json_schema": json.dumps(SCHEMA)}).source_field == "json_schema"
    for body, field in [({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
                        ({"response_format": {"type": "xml"}}, "response_format"),
                        ({"guided_choice": []}, "guided_choice"), ({"regex": ""}, "regex"),
                        ({"guided_json": "{nope"}, "guided_json")]:
        with pytest.raises(InvalidGrammarField) as err:
            grammar_spec_from(body)
        assert err.value.field == field
    with pytest.raises(InvalidSamplingParams, match="ignore_eos"):
        SamplingParams(ignore_eos=True, grammar=GrammarSpec("regex", "a")).validate(VOCAB)


def test_a_grammar_that_does_not_compile_is_refused(compiler) -> None:
    with pytest.raises(InvalidGrammar, match="regex"):
        compiler.compile(GrammarSpec("regex", "(unclosed"))
    with pytest.raises(InvalidGrammar, match="ebnf"):
        compiler.compile(GrammarSpec("ebnf", "root ::= "))


def test_bounded_strings_become_patterns_of_unescaped_characters() -> None:
    import re

    from splitserve.engine.grammar.compiler import bounded_strings_as_patterns
    out = bounded_strings_as_patterns({"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 3}, "b": {"type": "string", "minLength": 2, "pattern": "^x+$"},
        "type": {"type": "string", "minLength": 1}}})
    a, b, t = out["properties"]["a"], out["properties"]["b"], out["properties"]["type"]
    assert "maxLength" not in a and re.fullmatch(a["pattern"], "abc") and not re.fullmatch(a["pattern"], "abcd")
    assert not re.fullmatch(a["pattern"], "a\x01") and not re.fullmatch(a["pattern"], 'a"')
    assert b == {"type": "string", "minLength": 2, "pattern": "^x+$"}  # a pattern is left alone
    assert re.fullmatch(t["pattern"], "x") and not re.fullmatch(t["pattern"], "")


class OfferDrafts:
    """A role offering each decoding request the next K tokens of a known continuation, with every
    `wrong_every`-th replaced by `wrong` (a token the grammar forbids)."""

    def __init__(self, continuation: list[int], k: int, wrong: int, wrong_every: int) -> None:
        from splitserve.engine.role import Role

        class _Role(Role):
            def poll(inner) -> None:
                from splitserve.engine.request import RequestStatus
                for req in inner.engine.requests.values():
                    if req.status is not RequestStatus.RUNNING or req.pending_len != 1 or not req.output_ids:
                        continue
                    n = len(req.output_ids)
                    rest = continuation[n:][:k]
                    req.draft_tokens = [wrong if wrong_every and (n + i) % wrong_every == 0 else t
                                        for i, t in enumerate(rest)]
                    self.offered += len(rest)

        self.role = _Role()
        self.offered = 0


def test_the_engine_verify_step_keeps_a_grammar(tokenizer) -> None:
    """Drafts through the engine's verify step: forbidden draft tokens are never accepted, so the
    greedy output under the grammar is the one plain decoding gives."""
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.engine import Engine
    from splitserve.engine.offline import generate_tokens

    def run(role) -> list[int]:
        engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, max_total_tokens=1024,
                                     max_running_requests=2), role=role)
        engine.start()
        try:
            params = SamplingParams(max_new_tokens=40, temperature=0.0, grammar=GrammarSpec("regex", "[0-9]{12}x"))
            return generate_tokens(engine, [[1, 2, 3]], params)[0]
        finally:
            engine.stop()

    plain = run(None)
    assert re.fullmatch(r"[0-9]{12}x", tokenizer.decode(plain))
    letter = tokenizer.encode("q", add_special_tokens=False)[0]
    wrong = OfferDrafts(plain, k=4, wrong=letter, wrong_every=3)
    assert run(wrong.role) == plain and wrong.offered > 0
    right = OfferDrafts(plain, k=4, wrong=letter, wrong_every=0)
    assert run(right.role) == plain and right.offered > 0
