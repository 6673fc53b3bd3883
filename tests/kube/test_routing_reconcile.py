"""The operator reconciles a routed pair (examples/qwen2-7b-routing.yaml): the big deployment's router flags name the
small deployment's router Service, and its NetworkPolicy lets its routers reach the small one's."""

from __future__ import annotations

from tests.kube.cluster import EXAMPLES
from tests.kube.harness import children, prepare_cluster, running_operator, wait_reconciled


def test_a_routed_pair_reconciles_with_the_route_and_its_network_policy(kube) -> None:
    prepare_cluster(kube)
    with running_operator(kube):
        kube.apply(EXAMPLES / "qwen2-7b-routing.yaml")
        wait_reconciled(kube, "qwen2-0-5b", namespace="default")
        wait_reconciled(kube, "qwen2-7b-routed", namespace="default")
        objs = children(kube, "qwen2-7b-routed", "default")
    args = objs["Deployment/qwen2-7b-routed-router"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--route-to") + 1] == "http://qwen2-0-5b.default.svc:80"
    policy = objs["NetworkPolicy/qwen2-7b-routed-routing"]["spec"]
    assert policy["podSelector"]["matchLabels"] == {"pdfleet.io/deployment": "qwen2-0-5b", "pdfleet.io/role": "router"}
