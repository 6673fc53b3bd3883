"""`ScalerState`: what the autoscaler remembers about one deployment between intervals (pure, JSON-serializable).

`autoscaler.decide` takes and returns it; the operator keeps it in memory, `pdfleet up` and the
simulator in their loops, the bench per policy.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from pdfleet_operator.api.inference_deployment import InferenceDeploymentSpec


@dataclass(frozen=True)
class ScalerState:
    """What the autoscaler remembers between intervals; JSON-serializable (an annotation or memory).

    `replicas` is the size last decided per role; `recommendations` the (time, replicas) history the
    stabilization windows look back over; `last_scale_up` when each role last grew (grace period);
    `watching_since` when the autoscaler first saw each role's metrics; `last_need` the (time,
    replicas' worth) of each role's own queue at the last decision (the queue trend). For the token
    rate: `throughput` the tokens/s one replica of each role was seen to serve when saturated;
    `samples` the (time, replicas reporting, saturated) of each role at the decisions that cover the
    last rate window (what the rate was served by); `last_queue` the (time, tokens) queued at the
    last decision (the arrival rate counts the queue's growth); `generation_per_prompt` the tokens
    decode generates per prompt token prefill serves, learned while neither role has requests waiting
    (decode's look-ahead by token rate); `rate_history` the (time, tokens/s served, replicas reporting)
    of each role at the decisions over the last two rate windows (the rate trend).

    `throughput` and `samples` see a role as one class (`WHOLE_ROLE`): what a source without the
    per-class breakdown gives, and all that state written before the breakdown existed holds.
    `class_throughput` and `class_samples` are the same per AcceleratorClass (role -> class -> ...):
    a pool spread over classes of different speed has no single per-replica throughput.
    """

    replicas: Mapping[str, int] = field(default_factory=dict)
    recommendations: Mapping[str, tuple[tuple[float, int], ...]] = field(default_factory=dict)
    last_scale_up: Mapping[str, float] = field(default_factory=dict)
    watching_since: Mapping[str, float] = field(default_factory=dict)
    last_need: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    throughput: Mapping[str, float] = field(default_factory=dict)
    samples: Mapping[str, tuple[tuple[float, int, bool], ...]] = field(default_factory=dict)
    last_queue: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    generation_per_prompt: float | None = None
    class_throughput: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    class_samples: Mapping[str, Mapping[str, tuple[tuple[float, int, bool], ...]]] = field(default_factory=dict)
    rate_history: Mapping[str, tuple[tuple[float, float, int], ...]] = field(default_factory=dict)

    @classmethod
    def initial(cls, spec: InferenceDeploymentSpec, replicas: Mapping[str, int] | None = None) -> "ScalerState":
        """A fresh state at the given sizes (what the Deployments run now), or each role's minReplicas."""
        sizes = {role: rs.min_replicas for role, rs in spec.roles().items()}
        sizes.update({role: int(n) for role, n in (replicas or {}).items() if role in sizes})
        return cls(replicas=sizes)

    def to_json(self) -> str:
        return json.dumps(
            {
                "replicas": dict(self.replicas),
                "recommendations": {role: [list(p) for p in hist] for role, hist in self.recommendations.items()},
                "lastScaleUp": dict(self.last_scale_up),
                "watchingSince": dict(self.watching_since),
                "lastNeed": {role: list(p) for role, p in self.last_need.items()},
                "throughput": dict(self.throughput),
                "samples": {role: [list(x) for x in hist] for role, hist in self.samples.items()},
                "lastQueue": {role: list(p) for role, p in self.last_queue.items()},
                "generationPerPrompt": self.generation_per_prompt,
                "classThroughput": {role: dict(by_class) for role, by_class in self.class_throughput.items()},
                "classSamples": {
                    role: {cls: [list(x) for x in hist] for cls, hist in by_class.items()}
                    for role, by_class in self.class_samples.items()
                },
                "rateHistory": {role: [list(p) for p in hist] for role, hist in self.rate_history.items()},
            },
            sort_keys=True,
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> "ScalerState":
        """Parse `to_json` output; ValueError naming the problem when it is not one.

        NOTE: the token-rate keys may be absent (a state written before they existed): that is a
        throughput not learned yet, not an error. State written before the per-class keys holds one
        number per role in `throughput`: it loads as the role learned as one class (`WHOLE_ROLE`).
        """
        try:
            raw = json.loads(text)
            return cls(
                replicas={str(r): int(n) for r, n in raw["replicas"].items()},
                recommendations={
                    str(r): tuple((float(t), int(n)) for t, n in hist) for r, hist in raw["recommendations"].items()
                },
                last_scale_up={str(r): float(t) for r, t in raw["lastScaleUp"].items()},
                watching_since={str(r): float(t) for r, t in raw["watchingSince"].items()},
                last_need={str(r): (float(t), float(n)) for r, (t, n) in raw["lastNeed"].items()},
                throughput={str(r): float(c) for r, c in raw.get("throughput", {}).items()},
                samples={
                    str(r): tuple((float(t), int(n), bool(sat)) for t, n, sat in hist)
                    for r, hist in raw.get("samples", {}).items()
                },
                last_queue={str(r): (float(t), float(q)) for r, (t, q) in raw.get("lastQueue", {}).items()},
                generation_per_prompt=(
                    None if raw.get("generationPerPrompt") is None else float(raw["generationPerPrompt"])
                ),
                class_throughput={
                    str(r): {str(k): float(c) for k, c in by_class.items()}
                    for r, by_class in raw.get("classThroughput", {}).items()
                },
                class_samples={
                    str(r): {
                        str(k): tuple((float(t), int(n), bool(sat)) for t, n, sat in hist)
                        for k, hist in by_class.items()
                    }
                    for r, by_class in raw.get("classSamples", {}).items()
                },
                rate_history={
                    str(r): tuple((float(t), float(v), int(n)) for t, v, n in hist)
                    for r, hist in raw.get("rateHistory", {}).items()
                },
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"invalid autoscaler state {text[:200]!r}: {exc}") from exc


Samples = tuple[tuple[float, int, bool], ...]  # (time, replicas reporting, saturated) per decision
