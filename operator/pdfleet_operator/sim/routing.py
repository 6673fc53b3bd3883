"""Query routing in the simulator: which trace requests a deployment's router sends to its `spec.routing.target`, by the
router's own length rules (`pdfleet_worker.router.routing.length_decision`); the simulator calls `simple` when it
assigns requests to deployments.

A trace request's prompt is its prompt tokens and its requested max_tokens its output tokens (a client that asked
for fewer would have got fewer). Rules that read text are refused by the fleet file (sim/fleet.py).
"""

from __future__ import annotations

import numpy as np

from pdfleet_operator.api.inference_deployment import RoutingSpec
from pdfleet_worker.router import routing


def rules_of(spec: RoutingSpec) -> routing.Rules:
    r = spec.rules
    assert r.max_prompt_chars is None and not r.patterns and not r.exclude_patterns and spec.classifier is None, (
        "text rules reached the simulator (sim/fleet.py refuses them)"
    )
    return routing.Rules(max_prompt_tokens=r.max_prompt_tokens, max_tokens=r.max_tokens)


def simple(spec: RoutingSpec, prompt: np.ndarray, output: np.ndarray) -> np.ndarray:
    """Per request: whether the router would route it to the target."""
    rules = rules_of(spec)
    return np.fromiter(
        (routing.length_decision(rules, int(p), None, int(o)) is None for p, o in zip(prompt, output)),
        dtype=bool,
        count=len(prompt),
    )
