"""Structured outputs with llguidance: compiles a StructuredOutput (JSON schema, any JSON object, regex, choice, Lark
grammar) into a grammar for the model's tokenizer and makes the per-request matcher whose token mask the Sampler
applies; LLMEngine owns one, the server validates specs through it before admitting a request."""

from __future__ import annotations

import collections
import json
import threading

from pdfleet_worker.sampling_params import StructuredOutput

CACHE_SIZE = 256  # compiled grammars kept (a client usually sends the same few schemas)
# NOTE: compact JSON (no whitespace between tokens): with flexible whitespace a model may emit blanks
# for ever (a random one does), and a parser reads both alike.
JSON_OPTIONS = {"whitespace_flexible": False}


class Grammars:
    """One tokenizer's grammar compiler and cache. Thread-safe: the server compiles off the event loop
    while the engine thread makes matchers."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]):
        if not eos_token_ids:
            raise ValueError("structured outputs need an EOS token to end on; this model has none")
        self.tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer = None
        self._cache: collections.OrderedDict[StructuredOutput, str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                self._tokenizer = llguidance.LLTokenizer(
                    self.tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
            return self._tokenizer

    def compile(self, spec: StructuredOutput) -> str:
        """The spec as a checked llguidance grammar; ValueError saying what is wrong with it."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        import llguidance

        grammar = _grammar(spec)
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer())
        if failed:
            raise ValueError(f"the {spec.kind} structured output cannot be compiled: {messages[0].strip()}")
        with self._lock:
            self._cache[spec] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, spec: StructuredOutput):
        """A fresh matcher at the start of the grammar (one per request)."""
        import llguidance

        m = llguidance.LLMatcher(self.tokenizer(), self.compile(spec), log_level=0)
        if m.is_error():
            raise ValueError(f"the {spec.kind} structured output cannot be used: {m.get_error()}")
        return m


def _grammar(spec: StructuredOutput) -> str:
    import llguidance

    M = llguidance.LLMatcher
    if spec.kind == "json":
        try:
            schema = json.loads(spec.spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema is an object or a boolean, got {type(schema).__name__}")
        return M.grammar_from_json_schema(
            schema if isinstance(schema, dict) else {} if schema else {"not": {}}, defaults=JSON_OPTIONS
        )
    if spec.kind == "json_object":
        return M.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if spec.kind == "regex":
        return M.grammar_from_regex(spec.spec)
    if spec.kind == "choice":
        try:
            choices = json.loads(spec.spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"a choice is a JSON list of strings: {e}") from None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("a choice is a non-empty list of non-empty strings")
        # Lark string literals take JSON's escapes.
        return M.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
    assert spec.kind == "grammar", spec.kind
    return M.grammar_from_lark(spec.spec)
