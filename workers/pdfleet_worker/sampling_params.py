"""Per-request sampling and stopping settings; the server builds them from OpenAI fields, the engine checks them.

NOTE: at the package root, beside config.py: the wire checks a request's structured output with it, the sampler
(layers/) applies it and the engine schedules by it, and none of those may import another's package. No torch.
"""

from __future__ import annotations

import dataclasses
import math

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """What the output must match (vLLM's structured_outputs): `spec` is a JSON schema as JSON text (json),
    a regular expression (regex), the JSON list of allowed strings (choice), a Lark grammar (grammar), or
    empty (json_object: any JSON object). engine/structured.py compiles it into a token mask."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str) or (self.kind != "json_object" and not self.spec):
            raise ValueError(f"structured output {self.kind} needs a non-empty spec")


@dataclasses.dataclass
class SamplingParams:
    """How to pick tokens and when to stop. temperature == 0 means greedy.

    Logits go through, in this order (transformers' order where it has the processor): logit_bias,
    repetition_penalty (prompt and output tokens), presence/frequency penalties (output tokens, OpenAI's
    definition), min_tokens (EOS and stop_token_ids blocked), the structured output's token mask, then
    temperature, top_k, top_p and min_p, and the pick (argmax when greedy)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # None: off; n >= 0: the sampled token plus the n most likely
    prompt_logprobs: int | None = None  # None: off; n >= 0: each prompt token's logprob plus the n most likely
    structured: StructuredOutput | None = None
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if _not_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if _not_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and _not_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.stop is not None:
            if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
                raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
            self.stop = list(self.stop)
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                not _not_int(t) and t >= 0 for t in self.stop_token_ids
            ):
                raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
            self.stop_token_ids = list(self.stop_token_ids)
        if _not_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _finite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                not _not_int(t) and t >= 0 and _finite(b) for t, b in self.logit_bias.items()
            ):
                raise ValueError(f"logit_bias must map token ids to finite numbers, got {self.logit_bias!r}")
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (_not_int(value) or value < 0):
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise ValueError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
            if self.ignore_eos:
                raise ValueError("ignore_eos cannot be combined with a structured output (EOS ends it)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Needs the request's token counts (repetition, presence or frequency penalty)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def processed(self) -> bool:
        """Anything between the model's logits and the pick besides temperature/top-k/top-p."""
        return bool(self.penalized or self.logit_bias or self.min_tokens or self.min_p or self.structured)


def _not_int(value: object) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def _finite(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
