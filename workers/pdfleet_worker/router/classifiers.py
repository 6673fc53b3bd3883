"""Classifiers for query routing (`spec.routing.classifier.entryPoint`): the contract's reference implementation, a
keyword and length heuristic with no model; the router loads one by `module:function` (routing.load_classifier)."""

from __future__ import annotations

import re

from pdfleet_worker.router.routing import RouteRequest

# Words that ask for reasoning, long output or code: a prompt that has them is less likely simple.
_COMPLEX = re.compile(
    r"\b(why|explain|compare|analy[sz]e|prove|derive|design|implement|refactor|debug|step[- ]by[- ]step|"
    r"essay|report|summari[sz]e|translate|code|function|algorithm)\b",
    re.IGNORECASE,
)


def short_question(request: RouteRequest) -> float:
    """Confidence that a request is simple: 1.0 for a one-line prompt of a few words with no word that asks for
    reasoning, code or long output, falling with each such word, each extra line and the prompt's length."""
    text = request.prompt
    words = len(text.split())
    score = 1.0
    score -= 0.35 * len(_COMPLEX.findall(text))
    score -= 0.1 * text.count("\n")
    score -= min(0.6, max(0, words - 12) / 100)
    return max(0.0, min(1.0, score))
