"""The routing rules as pure functions (router/routing.py): the order reasons are given in, what counts as the prompt,
the classifier's answers read as confidences, refusals naming the flag."""

from __future__ import annotations

import math

import pytest

from pdfleet_worker.router import routing
from pdfleet_worker.router.classifiers import short_question

CHAT = "/v1/chat/completions"


def judge(rules: routing.Rules, body: dict, path: str = "/v1/completions", **kw):
    return routing.Routing(rules, **kw).request(path, body)


def test_every_rule_must_hold_and_the_first_that_fails_names_the_reason():
    rules = routing.Rules(max_prompt_chars=10, max_tokens=8, patterns=(r"\?$",), exclude_patterns=("secret",))
    assert isinstance(judge(rules, {"prompt": "why?", "max_tokens": 8}), routing.RouteRequest)
    assert judge(rules, {"prompt": "x" * 11 + "?", "max_tokens": 8}) == routing.Decision("default", "prompt_chars")
    assert judge(rules, {"prompt": "why?", "max_tokens": 9}) == routing.Decision("default", "max_tokens")
    assert judge(rules, {"prompt": "why?"}) == routing.Decision("default", "no_max_tokens")
    assert judge(rules, {"prompt": "secret?", "max_tokens": 1}) == routing.Decision("default", "excluded")
    assert judge(rules, {"prompt": "why", "max_tokens": 1}) == routing.Decision("default", "pattern")


def test_the_prompt_is_the_text_of_the_messages_or_the_prompt():
    assert (
        routing.prompt_text(
            CHAT,
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                ]
            },
        )
        == "be brief\nhi"
    )
    assert routing.prompt_text("/v1/completions", {"prompt": ["a", "b"]}) == "a\nb"
    assert routing.prompt_text("/v1/completions", {"prompt": [1, 2, 3]}) is None  # token ids: not routed
    assert judge(routing.Rules(max_tokens=4), {"prompt": [1, 2], "max_tokens": 1}) == routing.Decision(
        "default", "not_routable"
    )
    assert routing.requested_max_tokens({"max_tokens": 9, "max_completion_tokens": 3}) == 3


def test_tokens_are_counted_by_the_tokenizer_given():
    rules = routing.Rules(max_prompt_tokens=3)
    words = lambda text: len(text.split())  # noqa: E731
    assert isinstance(judge(rules, {"prompt": "a b c"}, tokenizer=words), routing.RouteRequest)
    assert judge(rules, {"prompt": "a b c d"}, tokenizer=words) == routing.Decision("default", "prompt_tokens")
    with pytest.raises(ValueError, match="--route-tokenizer"):
        routing.Routing(rules)


@pytest.mark.parametrize(
    "answer, decision",
    [
        (0.9, routing.Decision("small", "classifier", 0.9)),
        (0.5, routing.Decision("small", "classifier", 0.5)),
        (0.49, routing.Decision("default", "classifier_low", 0.49)),
        (1.5, routing.Decision("default", "classifier_error")),
        (math.nan, routing.Decision("default", "classifier_error")),
        ("0.9", routing.Decision("default", "classifier_error")),
        (True, routing.Decision("default", "classifier_error")),
    ],
)
def test_a_classifier_answer_is_a_confidence_or_an_error(answer, decision):
    r = routing.Routing(routing.Rules(), classifier=lambda req: answer, confidence_floor=0.5)
    assert r.judge(answer) == decision


def test_the_reference_classifier_scores_short_questions_high():
    def req(text: str) -> routing.RouteRequest:
        return routing.RouteRequest("/v1/completions", {}, text, None, 8)

    assert short_question(req("What is the capital of France?")) == 1.0
    assert short_question(req("Explain why and compare the two algorithms step by step")) < 0.3


def test_bad_rules_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"patterns\[1\]: '\(' is not a valid regular expression"):
        routing.Rules(patterns=("ok", "("))
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        routing.Rules(max_tokens=0)
    with pytest.raises(ValueError, match="at least one rule or a classifier"):
        routing.Routing(routing.Rules())
    with pytest.raises(ValueError, match="expected module:function"):
        routing.load_classifier("no-colon")
    with pytest.raises(ValueError, match="has no callable nope"):
        routing.load_classifier("pdfleet_worker.router.classifiers:nope")
    assert routing.load_classifier("pdfleet_worker.router.classifiers:short_question") is short_question
