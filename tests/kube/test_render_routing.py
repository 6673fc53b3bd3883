"""Query routing and heartbeats in the rendered objects: the router's flags (the target's router Service, the rules, the
classifier, the tokenizer it mounts for maxPromptTokens), the NetworkPolicy that lets this deployment's routers reach
the target's, and nothing of it without spec.routing."""

from __future__ import annotations

import kubernetes_validate

from pdfleet_operator.api import InferenceDeployment
from pdfleet_operator.decide import inventory, pd_threshold, placement
from pdfleet_operator.kube import render
from tests.kube.cluster import classes, example_deployments, standard_nodes

CLASSES = classes()
EXAMPLES = example_deployments()


def rendered(name: str) -> dict[tuple[str, str], dict]:
    dep = InferenceDeployment.model_validate(EXAMPLES[name])
    plan = placement.plan(dep.spec, CLASSES, inventory.build(standard_nodes(), []), None)
    objs = render.render(render.Owner(name, "team-a", "uid-" + name), dep.spec, plan, CLASSES, revision=1)
    for obj in objs:
        kubernetes_validate.validate(obj, "1.30.0", strict=True)
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def test_the_router_routes_to_the_target_service_with_the_rules():
    objs = rendered("qwen2-7b-routed")
    pod = objs[("Deployment", "qwen2-7b-routed-router")]["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    tail = args[args.index("--heartbeat-interval") :]
    assert tail == [
        "--heartbeat-interval",
        "10",
        "--drain-timeout",
        "600",
        "--pd-min-prompt-tokens",  # the cost model's for the spec's classes (decide/pd_threshold.py)
        str(
            pd_threshold.threshold(
                InferenceDeployment.model_validate(example_deployments()["qwen2-7b-routed"]).spec, classes()
            )
        ),
        "--route-to",
        "http://qwen2-0-5b.team-a.svc:80",
        "--route-max-prompt-tokens",
        "512",
        "--route-max-tokens",
        "256",
        "--route-exclude-pattern",
        r"(?i)\b(code|function|sql|proof)\b",
        "--route-classifier",
        "pdfleet_worker.router.classifiers:short_question",
        "--route-classifier-timeout",
        "0.2",
        "--route-confidence-floor",
        "0.5",
        "--route-tokenizer",
        "/models/Qwen2-7B-Instruct",
    ]
    # maxPromptTokens: the router reads the model's tokenizer from the model volume, read-only
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in pod["containers"][0]["volumeMounts"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod["volumes"]


def test_a_network_policy_lets_this_router_reach_the_target_router():
    objs = rendered("qwen2-7b-routed")
    policy = objs[("NetworkPolicy", "qwen2-7b-routed-routing")]
    assert policy["metadata"]["ownerReferences"][0]["name"] == "qwen2-7b-routed"
    assert policy["spec"]["podSelector"]["matchLabels"] == {
        "pdfleet.io/deployment": "qwen2-0-5b",
        "pdfleet.io/role": "router",
    }
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [
        {"podSelector": {"matchLabels": {"pdfleet.io/deployment": "qwen2-7b-routed", "pdfleet.io/role": "router"}}}
    ]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]


def test_without_routing_there_is_no_route_and_no_policy():
    objs = rendered("qwen2-0-5b")
    args = objs[("Deployment", "qwen2-0-5b-router")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(a.startswith("--route") for a in args)
    assert ("NetworkPolicy", "qwen2-0-5b-routing") not in objs
    # the heartbeat interval reaches the workers too
    worker = next(o for k, o in objs.items() if k[0] == "Deployment" and k[1] != "qwen2-0-5b-router")
    wargs = worker["spec"]["template"]["spec"]["containers"][0]["args"]
    assert wargs[wargs.index("--heartbeat-interval") + 1] == "10s"
