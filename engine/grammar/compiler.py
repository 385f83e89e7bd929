"""Compiles grammar specs for one model's vocabulary with xgrammar (which caches the results).

The tokenizer's vocabulary is read once, by `warm_up_in_background` at engine start (importing
xgrammar imports transformers: seconds, which must not stall a serving process's first
structured request and its health probes; it runs beside the engine's own warm-up, and /health
says ready once both have ended). Compiles run on the HTTP server's worker threads
(validating and warming xgrammar's cache) and, on a cache miss, on the engine loop.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from typing import Any

from splitserve.engine.grammar.spec import GrammarSpec

logger = logging.getLogger(__name__)

COMPILER_THREADS = 2
CACHE_LIMIT_BYTES = 256 << 20


class InvalidGrammar(ValueError):
    """The schema, regex or EBNF does not compile."""


class GrammarCompiler:
    """Turns GrammarSpecs into xgrammar CompiledGrammars for a tokenizer and a model vocabulary."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        """hf_tokenizer: a `tokenizers.Tokenizer` (its vocabulary and byte encoding are read)."""
        self._tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _xgr_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import PreTrainedTokenizerFast

                info = xgr.TokenizerInfo.from_huggingface(
                    PreTrainedTokenizerFast(tokenizer_object=self._tokenizer), vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids)
                logger.info("grammar compiler ready: %s vocabulary of %d tokens", info.vocab_type.name,
                            info.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILER_THREADS,
                                                     cache_limit_bytes=CACHE_LIMIT_BYTES)
            return self._compiler

    def warm_up_in_background(self) -> threading.Thread:
        """Builds the xgrammar compiler on a thread, which it returns (the engine's start joins it, beside its
        own warm-up); a compile meanwhile waits for it."""
        def warm() -> None:
            try:
                self._xgr_compiler()
            except Exception:  # reported again, as a clear error, by the first compile
                logger.exception("grammar compiler failed to start")
        thread = threading.Thread(target=warm, name="grammar-warm-up", daemon=True)
        thread.start()
        return thread

    def compile(self, spec: GrammarSpec) -> Any:
        """The CompiledGrammar of `spec`; raises InvalidGrammar naming what failed."""
        compiler = self._xgr_compiler()
        try:
            if spec.kind in ("json_schema", "json_object"):
                # Compact JSON: unbounded whitespace would let a weak model pad forever.
                schema = json.dumps(bounded_strings_as_patterns(json.loads(spec.source)))
                return compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.source)
            return compiler.compile_grammar(spec.source)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidGrammar(f"the {spec.kind.replace('_', ' ')} does not compile: {exc}") from None


# A JSON string character that needs no escape: xgrammar 0.2.9 lets a string with minLength or
# maxLength hold raw control characters (invalid JSON); a pattern keeps it valid.
PLAIN_CHAR = '[^\\x00-\\x1f"\\\\]'


def bounded_strings_as_patterns(schema: Any) -> Any:
    """`schema` with each {"type": "string", "minLength"/"maxLength": ...} (and no pattern, format,
    enum or const) given as a pattern of unescaped characters instead: a subset of its strings."""
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bounded_strings_as_patterns(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and not {"pattern", "format", "enum", "const"} & out.keys():
        low, high = int(out.pop("minLength", 0)), out.pop("maxLength", None)
        out["pattern"] = f"^{PLAIN_CHAR}{{{low},{'' if high is None else int(high)}}}$"
    return out
