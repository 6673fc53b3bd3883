"""AcceleratorClass status (nodes, allocatable, free units): pure numbers, then written by the running operator."""

from __future__ import annotations

import yaml

from pdfleet_operator.kube import class_status
from tests.kube.cluster import CLASSES_FILE, node, pod
from tests.kube.harness import prepare_cluster, running_operator, settle

CLASSES = [d for d in yaml.safe_load_all(CLASSES_FILE.read_text()) if d]


def by_name(status: dict[str, dict[str, int]], name: str) -> tuple[int, int, int]:
    s = status[name]
    return s["nodes"], s["allocatable"], s["free"]


def test_numbers_follow_nodes_selectors_taints_and_pods() -> None:
    nodes = [
        node("ascend-0", "ascend", 8),
        node("ascend-1", "ascend", 8),
        node("h100-0", "h100", 8),
        node("h200-0", "h200", 8),
        node("ascend-2", "ascend", 8, unschedulable=True),
    ]
    pods = [
        pod("a", "ascend-0", {"huawei.com/Ascend910": "3"}),
        pod("b", "h100-0", {"nvidia.com/gpu": "8"}),
        pod("done", "ascend-1", {"huawei.com/Ascend910": "8"}, phase="Succeeded"),
        pod("pending", None, {"huawei.com/Ascend910": "8"}),
    ]
    status = class_status.compute(CLASSES, nodes, pods)
    # The cordoned node is not offered to placement either; the Pending pod will take ascend-1's 8 cards.
    assert by_name(status, "ascend-910b") == (2, 16, 5)
    assert by_name(class_status.compute(CLASSES, nodes, pods[:-1]), "ascend-910b") == (2, 16, 13)
    # same resource name, told apart by the product label: H100's pod leaves H200 alone
    assert by_name(status, "h100-80gb") == (1, 8, 0)
    assert by_name(status, "h200-141gb") == (1, 8, 8)
    assert by_name(status, "hygon-dcu-k100") == (0, 0, 0)
    assert status["ascend-910b"].get("observedGeneration") is None  # the file's objects carry no generation
    # an object as the API returns it: generation is echoed
    listed = [{**CLASSES[0], "metadata": {**CLASSES[0]["metadata"], "generation": 3}}]
    assert class_status.compute(listed, nodes, pods)[CLASSES[0]["metadata"]["name"]]["observedGeneration"] == 3


def test_an_invalid_class_is_skipped() -> None:
    bad = {"metadata": {"name": "broken"}, "spec": {"vendor": "nvidia"}}
    assert "broken" not in class_status.compute([bad], [node("h100-0", "h100", 8)], [])


def status_of(kube, name: str) -> dict:
    return (kube.get("acc", name) or {}).get("status") or {}


def test_the_operator_writes_class_status_on_change_only_and_not_again_after_a_restart(kube) -> None:
    prepare_cluster(kube, nodes=[node("ascend-0", "ascend", 8), node("hygon-0", "hygon", 4)])
    with running_operator(kube, class_status_interval=0.3):
        kube.wait_for(lambda: status_of(kube, "ascend-910b").get("free") == 8, message="ascend-910b free 8")
        kube.wait_for(lambda: status_of(kube, "hygon-dcu-k100").get("free") == 4, message="hygon-dcu-k100 free 4")
        assert status_of(kube, "ascend-910b")["nodes"] == 1 and status_of(kube, "ascend-910b")["allocatable"] == 8
        assert (
            status_of(kube, "ascend-910b")["observedGeneration"]
            == kube.get("acc", "ascend-910b")["metadata"]["generation"]
        )
        settle(kube, quiet=1.0)

        kube.clear_requests()
        kube.apply(pod("job", "ascend-0", {"huawei.com/Ascend910": "3"}))
        kube.wait_for(lambda: status_of(kube, "ascend-910b").get("free") == 5, message="ascend-910b free 5")
        settle(kube, quiet=1.0)
        writes = [(w.resource, w.subresource, w.name) for w in kube.writes() if w.resource == "acceleratorclasses"]
        assert writes == [("acceleratorclasses", "status", "ascend-910b")], writes  # only the class that changed
        # printer column "Free" (kubectl get acc -o wide) reads .status.free
        crd = kube.get("crd", "acceleratorclasses.pdfleet.io")
        columns = {c["name"]: c["jsonPath"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]}
        assert columns["Free"] == ".status.free"

    kube.clear_requests()
    with running_operator(kube, class_status_interval=0.3):
        settle(kube, quiet=1.5)
    assert [w for w in kube.writes() if w.resource == "acceleratorclasses"] == []
    assert [r for r in kube.requests if r.resource == "acceleratorclasses" and r.verb == "list"]
