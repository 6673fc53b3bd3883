"""Query routing in the simulator: the trace's simple requests go to the routing target by the router's own length
rules, the target's fleet shows in the cost, and what the simulator cannot judge (text) is refused naming the field."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from pdfleet_operator import trace as tr
from pdfleet_operator.api.inference_deployment import RoutingSpec
from pdfleet_operator.sim import cli, fleet
from pdfleet_operator.sim import routing as sim_routing
from pdfleet_worker.router import routing
from tests.sim.support import ROOT

EXAMPLE = ROOT / "examples" / "sim" / "routing.yaml"


def test_the_assistant_trace_is_40_percent_simple() -> None:
    t = tr.synthetic("assistant", mean_rate=20, duration=3600, seed=1)
    simple = (t.prompt <= 500) & (t.output <= 500)
    assert 0.40 <= simple.mean() <= 0.47  # the simple 40% plus the few complex ones this short


def test_the_simulator_routes_with_the_routers_rules() -> None:
    spec = RoutingSpec.model_validate({"target": "small", "rules": {"maxPromptTokens": 100, "maxTokens": 50}})
    prompt, output = np.array([100, 101, 10, 10]), np.array([50, 5, 51, 1])
    assert sim_routing.simple(spec, prompt, output).tolist() == [True, False, False, True]
    rules = routing.Rules(max_prompt_tokens=100, max_tokens=50)
    assert [routing.length_decision(rules, int(p), None, int(o)) for p, o in zip(prompt, output)] == [
        None,
        routing.Decision("default", "prompt_tokens"),
        routing.Decision("default", "max_tokens"),
        None,
    ]


def _doc() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


@pytest.mark.parametrize(
    "routing_patch, message",
    [
        (
            {"rules": {"maxPromptChars": 100}},
            "spec.routing.rules.maxPromptChars: the simulator's requests are token counts",
        ),
        ({"rules": {"patterns": ["^hi"]}}, "spec.routing.rules.patterns"),
        ({"classifier": {"entryPoint": "m:f"}}, "spec.routing.classifier"),
        ({"target": "nowhere"}, "'nowhere' is not a deployment of this policy"),
    ],
)
def test_what_cannot_be_simulated_is_refused(routing_patch, message) -> None:
    doc = _doc()
    doc["policies"][1]["deployments"][0]["spec"]["routing"].update(routing_patch)
    with pytest.raises(fleet.FleetError, match=message.replace("(", r"\(")):
        fleet.parse(doc, source="routing.yaml", base_dir=EXAMPLE.parent)


def test_a_target_has_no_share_of_its_own() -> None:
    doc = _doc()
    doc["policies"][1]["deployments"][1]["share"] = 0.5
    with pytest.raises(fleet.FleetError, match=r"deployments\[1\].share: 'qwen2-0-5b' is a spec.routing.target"):
        fleet.parse(doc, source="routing.yaml", base_dir=EXAMPLE.parent)


def test_routing_shows_in_the_cost_of_the_pair(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    code = cli.main(
        [
            "simulate",
            "--fleet",
            str(EXAMPLE),
            "--trace",
            "assistant",
            "--compare",
            "--out",
            str(out),
            "--duration",
            "20m",
            "--warmup",
            "5m",
            "--rate",
            "4",
            "--quiet",
            "--no-plots",
        ]
    )
    assert code == 0, capsys.readouterr().out
    doc = json.loads((out / "report.json").read_text())
    alone, routed = doc["policies"]["big-alone"], doc["policies"]["routed"]
    assert alone["routed_share"] == 0 and 0.35 < routed["routed_share"] < 0.5
    assert "qwen2-0-5b/colocated/h100-mig-1g-10gb" in routed["pools"]
    assert routed["generated_tokens"] == pytest.approx(alone["generated_tokens"], rel=0.01)
    cmp = doc["comparison"]
    assert cmp["cost_ratio"] == pytest.approx(routed["cost_per_1m_tokens"] / alone["cost_per_1m_tokens"], abs=1e-3)
