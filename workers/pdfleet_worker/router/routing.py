"""Query routing to a smaller model: which requests the router judges simple enough for another deployment (its rules,
an optional classifier hook and its confidence floor); the proxy asks `Routing.decide` before it picks a worker, the
simulator asks `length_decision`. Pure apart from loading the classifier. No torch.

A request goes to the target (route "small") when every rule that is set holds:
  max_prompt_tokens  the prompt's tokens (the model's tokenizer when the router has one: `--route-tokenizer`)
  max_prompt_chars   the prompt's characters (a chat request: its messages' text contents)
  max_tokens         the request's max_tokens / max_completion_tokens; a request that sets neither is not simple
  patterns           the prompt matches at least one of these regular expressions (Python `re`, search)
  exclude_patterns   the prompt matches none of these
and, with a classifier, its confidence that the request is simple is at least the floor. Anything else is served
by the deployment's own pools (route "default"), with the first reason that decided it.

The classifier contract: `module:function`, imported once when the router starts, called as
`function(request: RouteRequest) -> float` on a worker thread (never on the event loop) for requests that
passed the rules; the float is the confidence in [0, 1] that the request is simple. Anything else it returns, an
exception, or taking longer than the timeout sends the request to the big model (reason classifier_error).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import re
from collections.abc import Callable
from typing import Any

SMALL, DEFAULT = "small", "default"
ROUTES = (SMALL, DEFAULT)
# Why a request went where it went: the label values of pdfleet_router_routed_requests_total{reason}.
REASONS = {
    SMALL: ("rules", "classifier"),
    DEFAULT: (
        "prompt_tokens",
        "prompt_chars",
        "max_tokens",
        "no_max_tokens",
        "pattern",
        "excluded",
        "classifier_low",
        "classifier_error",
        "target_unavailable",
        "target_refused",
        "already_routed",
        "not_routable",
    ),
}
# Set on the call to the target router: that router never routes the request again (no loops).
ROUTED_HEADER = "x-pdfleet-routed"


@dataclasses.dataclass(frozen=True)
class RouteRequest:
    """What a classifier sees of one request (read-only: changing `body` changes nothing sent)."""

    path: str  # /v1/completions or /v1/chat/completions
    body: dict[str, Any]  # the client's JSON body
    prompt: str  # the prompt text (chat: the messages' text contents joined by newlines)
    prompt_tokens: int | None  # tokens of `prompt` when the router has the model's tokenizer
    max_tokens: int | None  # max_completion_tokens, else max_tokens, when the request sets one


@dataclasses.dataclass(frozen=True)
class Decision:
    route: str
    reason: str
    confidence: float | None = None


@dataclasses.dataclass(frozen=True)
class Rules:
    max_prompt_tokens: int | None = None
    max_prompt_chars: int | None = None
    max_tokens: int | None = None
    patterns: tuple[str, ...] = ()
    exclude_patterns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_prompt_tokens", "max_prompt_chars", "max_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"routing {name} must be an integer >= 1, got {value!r}")
        for name in ("patterns", "exclude_patterns"):
            for i, pattern in enumerate(getattr(self, name)):
                check_pattern(pattern, f"routing {name}[{i}]")

    @property
    def empty(self) -> bool:
        return (
            self.max_prompt_tokens is None
            and self.max_prompt_chars is None
            and self.max_tokens is None
            and not self.patterns
            and not self.exclude_patterns
        )

    @property
    def needs_text(self) -> bool:
        return bool(self.patterns or self.exclude_patterns)


def check_pattern(pattern: str, where: str) -> re.Pattern[str]:
    """The compiled pattern; ValueError naming `where` when Python's `re` cannot compile it."""
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{where}: {pattern!r} is not a valid regular expression: {e}") from None


def length_decision(
    rules: Rules, prompt_tokens: int | None, prompt_chars: int | None, max_tokens: int | None
) -> Decision | None:
    """The length rules alone: a DEFAULT decision with its reason, or None when they all hold."""
    if rules.max_prompt_tokens is not None:
        assert prompt_tokens is not None, "max_prompt_tokens set but the prompt was not counted"
        if prompt_tokens > rules.max_prompt_tokens:
            return Decision(DEFAULT, "prompt_tokens")
    if rules.max_prompt_chars is not None and prompt_chars is not None and prompt_chars > rules.max_prompt_chars:
        return Decision(DEFAULT, "prompt_chars")
    if rules.max_tokens is not None:
        if max_tokens is None:
            return Decision(DEFAULT, "no_max_tokens")
        if max_tokens > rules.max_tokens:
            return Decision(DEFAULT, "max_tokens")
    return None


def prompt_text(path: str, body: dict[str, Any]) -> str | None:
    """The text a request's rules read; None when the body has no prompt the router can read as text
    (token-id prompts, non-text message parts only): such a request is not routed."""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        parts: list[str] = []
        for msg in messages:
            content = msg.get("content") if isinstance(msg, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts += [c["text"] for c in content if isinstance(c, dict) and isinstance(c.get("text"), str)]
        return "\n".join(parts) if parts else None
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
        return "\n".join(prompt)
    return None


def prompt_length(path: str, body: dict[str, Any], count_tokens: Callable[[str], int] | None = None) -> int | None:
    """A request's prompt in tokens: a token-id prompt's length, else its text counted with the model's tokenizer
    (`count_tokens`) or estimated at 4 characters per token; None when there is no prompt to measure."""
    prompt = body.get("prompt")
    # NOTE: the types' set, not isinstance per item: a third of the time (a bool's type is bool, not int), and this
    # runs on every PD request's route (2,000 token ids: ~25 against ~90 us)
    if isinstance(prompt, list) and prompt and set(map(type, prompt)) == {int}:
        return len(prompt)
    text = prompt_text(path, body)
    if text is None:
        return None
    return count_tokens(text) if count_tokens is not None else math.ceil(len(text) / 4)


def requested_max_tokens(body: dict[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def load_classifier(entry_point: str) -> Callable[[RouteRequest], Any]:
    """`module:function` imported; ValueError saying what is wrong with it."""
    module_name, sep, attr = entry_point.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"routing classifier {entry_point!r}: expected module:function, e.g. "
            "pdfleet_worker.router.classifiers:short_question"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"routing classifier {entry_point!r}: cannot import {module_name}: {e}") from None
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
    if not callable(fn):
        raise ValueError(f"routing classifier {entry_point!r}: {module_name} has no callable {attr}")
    return fn


def confidence(value: Any) -> float | None:
    """A classifier's answer as a confidence in [0, 1]; None when it is not one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) and 0.0 <= value <= 1.0 else None


class Routing:
    """The rules of one router (`pdfleet router --route-to URL ...`), patterns compiled once."""

    def __init__(
        self,
        rules: Rules,
        classifier: Callable[[RouteRequest], Any] | None = None,
        confidence_floor: float = 0.5,
        tokenizer: Callable[[str], int] | None = None,
    ):
        if rules.empty and classifier is None:
            raise ValueError(
                "routing needs at least one rule or a classifier: otherwise every request would go to the target"
            )
        if not 0.0 <= confidence_floor <= 1.0:
            raise ValueError(f"routing confidence floor must be in [0, 1], got {confidence_floor!r}")
        if rules.max_prompt_tokens is not None and tokenizer is None:
            raise ValueError("routing max_prompt_tokens needs the model's tokenizer (--route-tokenizer DIR)")
        self.rules = rules
        self.classifier = classifier
        self.confidence_floor = confidence_floor
        self.count_tokens = tokenizer
        self._patterns = [re.compile(p) for p in rules.patterns]
        self._excludes = [re.compile(p) for p in rules.exclude_patterns]

    def request(self, path: str, body: dict[str, Any]) -> RouteRequest | Decision:
        """The rules: a DEFAULT Decision, or the RouteRequest that passed them (for the classifier)."""
        text = prompt_text(path, body)
        if text is None:
            return Decision(DEFAULT, "not_routable")
        tokens = self.count_tokens(text) if self.count_tokens is not None else None
        wanted = requested_max_tokens(body)
        by_length = length_decision(self.rules, tokens, len(text), wanted)
        if by_length is not None:
            return by_length
        if any(p.search(text) for p in self._excludes):
            return Decision(DEFAULT, "excluded")
        if self._patterns and not any(p.search(text) for p in self._patterns):
            return Decision(DEFAULT, "pattern")
        return RouteRequest(path, body, text, tokens, wanted)

    def judge(self, answer: Any) -> Decision:
        """The classifier's answer for a request that passed the rules."""
        score = confidence(answer)
        if score is None:
            return Decision(DEFAULT, "classifier_error")
        if score < self.confidence_floor:
            return Decision(DEFAULT, "classifier_low", score)
        return Decision(SMALL, "classifier", score)


def tokenizer_counter(model_dir: str) -> Callable[[str], int]:
    """Counts a text's tokens with a model directory's tokenizer.json (no special tokens); ValueError if unreadable."""
    from pathlib import Path

    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception type
        raise ValueError(f"--route-tokenizer: cannot read {path}: {e}") from None
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)
