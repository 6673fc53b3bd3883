"""Placement and inventory over table-driven clusters: whole GPUs, MIG slices, domestic accelerators, full and mixed."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest

from pdfleet_operator.decide import inventory, placement
from tests.kube.cluster import classes, example_deployments, node, pod, spec_of

CLASSES = classes()
EXAMPLES = example_deployments()

SMALL_MODEL = {"parametersBillions": 1.2, "layers": 16, "kvHeads": 8, "headDim": 64}
BIG_MODEL = {"parametersBillions": 70.6, "layers": 80, "kvHeads": 8, "headDim": 128}


# chat-cost's decode classes as these cases were written: placement plans capacity whatever engine a class
# runs (the example no longer lists kunlunxin-r200, which the pdfleet worker cannot run: decide.runtimes).
DOMESTIC_DECODE = ["ascend-910b", "hygon-dcu-k100", "kunlunxin-r200"]


def chat_cost(**changes: Any) -> Any:
    changes.setdefault("decode__acceleratorClasses", DOMESTIC_DECODE)
    return deployment("chat-cost", **changes)


def deployment(base: str, **changes: Any) -> Any:
    """An example's spec with dotted-path changes (`prefill.acceleratorClasses=[...]`)."""
    doc = copy.deepcopy(EXAMPLES[base])
    for path, value in changes.items():
        target = doc["spec"]
        *head, leaf = path.split("__")
        for part in head:
            target = target.setdefault(part, {})
        target[leaf] = value
    return spec_of(doc)


@dataclass
class Case:
    id: str
    spec: Any
    nodes: list[dict]
    pods: list[dict] = field(default_factory=list)
    desired: dict[str, int] | None = None
    pools: list[tuple[str, str, int]] = field(default_factory=list)
    shortfalls: list[tuple[str, str | None, int, str]] = field(default_factory=list)
    capacity: dict[str, int] = field(default_factory=dict)
    reason_has: tuple[str, ...] = ()


CASES = [
    Case(
        "h100-prefill-mig3g-decode",
        deployment("llama31-8b"),
        [node("h100-0", "h100", 8), node("mig-0", "h100-mig", 2)],
        pools=[("prefill", "h100-80gb", 1), ("decode", "h100-mig-3g-40gb", 2)],
        capacity={"prefill": 4, "decode": 2},
    ),
    Case(
        "mig-1g-too-small-for-8b",
        deployment("llama31-8b", decode__acceleratorClasses=["h100-mig-1g-10gb", "h100-mig-3g-40gb"]),
        [node("h100-0", "h100", 8), node("mig-0", "h100-mig", 4, extra={"nvidia.com/mig-1g.10gb": "7"})],
        pools=[("prefill", "h100-80gb", 1), ("decode", "h100-mig-3g-40gb", 2)],
        reason_has=("decode: h100-mig-1g-10gb skipped: weights 15.0 GiB do not fit 10 GiB",),
    ),
    Case(
        "mig-1g-fits-a-1b-model",
        deployment(
            "llama31-8b",
            model__architecture=SMALL_MODEL,
            model__maxModelLen=4096,
            decode__acceleratorClasses=["h100-mig-3g-40gb", "h100-mig-1g-10gb"],
        ),
        [node("h100-0", "h100", 8), node("mig-0", "h100-mig", 4, extra={"nvidia.com/mig-1g.10gb": "7"})],
        # cost tier: 1g gives 974 GB/s per $/h, 3g 1309; 3g first, 1g is the spill-over
        desired={"decode": 6},
        pools=[("prefill", "h100-80gb", 1), ("decode", "h100-mig-3g-40gb", 4), ("decode", "h100-mig-1g-10gb", 2)],
    ),
    Case(
        "latency-tier-takes-faster-h100-over-preferred-a100",
        deployment(
            "chat-latency",
            prefill__acceleratorClasses=["a100-80gb", "h100-80gb"],
            decode__acceleratorClasses=["a100-80gb", "h100-80gb"],
        ),
        [node("a100-0", "a100", 8), node("h100-0", "h100", 8)],
        pools=[("prefill", "h100-80gb", 1), ("decode", "h100-80gb", 1)],
    ),
    Case(
        "cost-tier-tie-goes-to-user-order",
        # decode GB/s per $/h: a100 1139, h100 1120 (within 2%): the user's order decides
        deployment("llama31-8b", decode__acceleratorClasses=["a100-80gb", "h100-80gb"]),
        [node("a100-0", "a100", 8), node("h100-0", "h100", 8)],
        pools=[("prefill", "h100-80gb", 1), ("decode", "a100-80gb", 2)],
        reason_has=("decode: order a100-80gb, h100-80gb (cost tier, by GB/s per $/h)",),
    ),
    Case(
        "l40s-colocated",
        deployment("qwen2-7b"),
        [node("l40s-0", "l40s", 4)],
        desired={"colocated": 3},
        pools=[("colocated", "l40s-48gb", 3)],
        capacity={"colocated": 4},
    ),
    Case(
        "ascend-prefill-hygon-decode",
        chat_cost(),
        [node("ascend-0", "ascend", 8), node("hygon-0", "hygon", 8), node("kunlunxin-0", "kunlunxin", 8)],
        pools=[("prefill", "ascend-910b", 1), ("decode", "hygon-dcu-k100", 2)],
    ),
    Case(
        "hygon-full-decode-spills-to-ascend-then-kunlunxin",
        chat_cost(),
        [node("ascend-0", "ascend", 2), node("hygon-0", "hygon", 1), node("kunlunxin-0", "kunlunxin", 8)],
        desired={"decode": 4},
        pools=[
            ("prefill", "ascend-910b", 1),
            ("decode", "hygon-dcu-k100", 1),
            ("decode", "ascend-910b", 1),
            ("decode", "kunlunxin-r200", 2),
        ],
    ),
    Case(
        "cambricon-prefill",
        chat_cost(prefill__acceleratorClasses=["cambricon-mlu370"]),
        [node("mlu-0", "cambricon", 4), node("hygon-0", "hygon", 4)],
        pools=[("prefill", "cambricon-mlu370", 1), ("decode", "hygon-dcu-k100", 2)],
    ),
    Case(
        "kunlunxin-only",
        chat_cost(prefill__acceleratorClasses=["kunlunxin-r200"], decode__acceleratorClasses=["kunlunxin-r200"]),
        [node("xpu-0", "kunlunxin", 2), node("xpu-1", "kunlunxin", 2)],
        pools=[("prefill", "kunlunxin-r200", 1), ("decode", "kunlunxin-r200", 2)],
        capacity={"prefill": 2, "decode": 3},
    ),
    Case(
        "mixed-nvidia-and-domestic",
        chat_cost(
            prefill__acceleratorClasses=["h100-80gb", "ascend-910b"],
            decode__acceleratorClasses=["ascend-910b", "l40s-48gb"],
        ),
        [node("h100-0", "h100", 1), node("ascend-0", "ascend", 8), node("l40s-0", "l40s", 4)],
        desired={"prefill": 2, "decode": 3},
        # prefill per $/h: h100 331 > ascend 261; decode: ascend 1333 > l40s 873
        pools=[("prefill", "h100-80gb", 1), ("prefill", "ascend-910b", 1), ("decode", "ascend-910b", 3)],
    ),
    Case(
        "full-cluster",
        deployment("llama31-8b"),
        [node("h100-0", "h100", 8), node("mig-0", "h100-mig", 2)],
        pods=[pod("other", "h100-0", {"nvidia.com/gpu": "8"}), pod("other2", "mig-0", {"nvidia.com/mig-3g.40gb": "2"})],
        shortfalls=[
            ("prefill", "h100-80gb", 1, "InsufficientCapacity"),
            ("decode", "h100-mig-3g-40gb", 2, "InsufficientCapacity"),
        ],
        capacity={"prefill": 0, "decode": 0},
    ),
    Case(
        "partly-full-places-what-fits",
        deployment("llama31-8b"),
        [node("h100-0", "h100", 8), node("mig-0", "h100-mig", 4)],
        pods=[
            pod("other", "mig-0", {"nvidia.com/mig-3g.40gb": "1"}),
            pod("done", "mig-0", {"nvidia.com/mig-3g.40gb": "1"}, phase="Succeeded"),
        ],
        desired={"decode": 5},
        pools=[("prefill", "h100-80gb", 1), ("decode", "h100-mig-3g-40gb", 3)],
        shortfalls=[("decode", "h100-mig-3g-40gb", 2, "InsufficientCapacity")],
    ),
    Case(
        "own-pods-count-as-free",
        deployment("llama31-8b"),
        [node("h100-0", "h100", 1), node("mig-0", "h100-mig", 2)],
        pods=[
            pod("mine", "h100-0", {"nvidia.com/gpu": "1"}, labels={"pdfleet.io/deployment": "llama31-8b"}),
            pod(
                "theirs",
                "mig-0",
                {"nvidia.com/mig-3g.40gb": "1"},
                namespace="other",
                labels={"pdfleet.io/deployment": "llama31-8b"},
            ),
        ],
        pools=[("prefill", "h100-80gb", 1), ("decode", "h100-mig-3g-40gb", 1)],
        shortfalls=[("decode", "h100-mig-3g-40gb", 1, "InsufficientCapacity")],
    ),
    Case(
        "fits-nowhere",
        deployment(
            "qwen2-7b", model__architecture=BIG_MODEL, colocated__acceleratorClasses=["l40s-48gb", "kunlunxin-r200"]
        ),
        [node("l40s-0", "l40s", 4), node("xpu-0", "kunlunxin", 8)],
        shortfalls=[("colocated", None, 1, "FitsNowhere")],
        capacity={"colocated": 0},
        reason_has=("colocated: l40s-48gb skipped: weights 131.5 GiB do not fit 48 GiB",),
    ),
    Case(
        "kv-does-not-fit",
        deployment("qwen2-7b", model__maxModelLen=1048576, colocated__acceleratorClasses=["l40s-48gb"]),
        [node("l40s-0", "l40s", 4)],
        shortfalls=[("colocated", None, 1, "FitsNowhere")],
        reason_has=("colocated: l40s-48gb skipped: KV for one 1048576-token sequence needs 56.0 GiB",),
    ),
    Case(
        "missing-class",
        deployment("qwen2-7b", colocated__acceleratorClasses=["tpu-v5"]),
        [node("l40s-0", "l40s", 4)],
        shortfalls=[("colocated", None, 1, "FitsNowhere")],
        reason_has=("colocated: AcceleratorClass tpu-v5 does not exist",),
    ),
    Case(
        "slo-unattainable-falls-back-to-fastest",
        chat_cost(slo={"ttft": "1ms", "itl": "1ms"}),
        [node("ascend-0", "ascend", 8), node("hygon-0", "hygon", 8), node("kunlunxin-0", "kunlunxin", 8)],
        pools=[("prefill", "ascend-910b", 1), ("decode", "hygon-dcu-k100", 2)],
        reason_has=(
            "decode: no class meets the SLO; using the fastest that fit",
            "decode: order hygon-dcu-k100, ascend-910b, kunlunxin-r200 (fastest (SLO fallback))",
        ),
    ),
    Case(
        "slo-excludes-slow-class",
        chat_cost(slo={"ttft": "3s", "itl": "20ms"}),
        [node("ascend-0", "ascend", 8), node("kunlunxin-0", "kunlunxin", 8)],
        pools=[("prefill", "ascend-910b", 1), ("decode", "ascend-910b", 2)],
        reason_has=("decode: kunlunxin-r200 misses the SLO: ITL ~42ms > 20ms",),
    ),
    Case(
        "taint-not-tolerated",
        chat_cost(),
        [
            node("ascend-0", "ascend", 8, taints=[{"key": "dedicated", "value": "training", "effect": "NoSchedule"}]),
            node("hygon-0", "hygon", 8),
        ],
        pools=[("prefill", "hygon-dcu-k100", 1), ("decode", "hygon-dcu-k100", 2)],
    ),
    Case(
        "prefer-no-schedule-taint-is-fine",
        chat_cost(),
        [node("ascend-0", "ascend", 8, taints=[{"key": "x", "effect": "PreferNoSchedule"}])],
        pools=[("prefill", "ascend-910b", 1), ("decode", "ascend-910b", 2)],
    ),
    Case(
        "cordoned-and-not-ready-nodes-are-skipped",
        deployment("qwen2-7b"),
        [
            node("l40s-0", "l40s", 4, unschedulable=True),
            node("l40s-1", "l40s", 4, ready=False),
            node("l40s-2", "l40s", 1),
        ],
        desired={"colocated": 2},
        pools=[("colocated", "l40s-48gb", 1)],
        shortfalls=[("colocated", "l40s-48gb", 1, "InsufficientCapacity")],
        reason_has=("node l40s-0 is cordoned", "node l40s-1 is not Ready"),
    ),
    Case(
        "minimums-first-on-shared-cpu",
        deployment("local-tiny"),
        [node("cpu-0", "cpu", 6)],  # 3 replicas of 2 cores
        desired={"prefill": 2, "decode": 2},
        pools=[("prefill", "cpu", 2), ("decode", "cpu", 1)],
        shortfalls=[("decode", "cpu", 2, "InsufficientCapacity")],
        capacity={"prefill": 2, "decode": 1},
    ),
    Case(
        "desired-clamped-to-max",
        deployment("qwen2-7b"),
        [node("l40s-0", "l40s", 8)],
        desired={"colocated": 9},
        pools=[("colocated", "l40s-48gb", 4)],
        reason_has=("colocated: 9 replicas asked, clamped to 4 (min 1, max 4)",),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_plan(case: Case) -> None:
    inv = inventory.build(case.nodes, case.pods, exclude_deployment=("default", "llama31-8b"))
    plan = placement.plan(case.spec, CLASSES, inv, case.desired)
    assert [(p.role, p.accelerator_class, p.replicas) for p in plan.pools] == case.pools, plan.reasons
    assert [(s.role, s.accelerator_class, s.missing_units, s.reason) for s in plan.shortfalls] == case.shortfalls
    for role, cap in case.capacity.items():
        assert plan.capacity(role) == cap, (role, plan.reasons)
    for text in case.reason_has:
        assert any(text in r for r in plan.reasons), (text, plan.reasons)
    # Never more than the free capacity, per resource and node.
    for s in plan.shortfalls:
        assert s.message


def test_never_plans_beyond_free_units() -> None:
    spec = chat_cost(decode__maxReplicas=16)
    nodes = [node("ascend-0", "ascend", 3), node("hygon-0", "hygon", 2), node("kunlunxin-0", "kunlunxin", 1)]
    inv = inventory.build(nodes, [])
    plan = placement.plan(spec, CLASSES, inv, {"prefill": 8, "decode": 16})
    used: dict[str, int] = {}
    for p in plan.pools:
        used[p.accelerator_class] = used.get(p.accelerator_class, 0) + p.replicas
    assert used == {"ascend-910b": 3, "hygon-dcu-k100": 2, "kunlunxin-r200": 1}
    assert plan.replicas("prefill") + plan.replicas("decode") == 6
    assert plan.capacity("prefill") == plan.replicas("prefill")


def test_shortfall_message_names_class_and_units() -> None:
    spec = deployment("llama31-8b")
    plan = placement.plan(spec, CLASSES, inventory.build([node("mig-0", "h100-mig", 1)], []), {"decode": 3})
    (pre, dec) = plan.shortfalls
    assert pre.message.startswith("prefill: 0/1 replicas placed; missing 1 x nvidia.com/gpu on h100-80gb")
    assert dec.message.startswith("decode: 1/3 replicas placed; missing 2 x nvidia.com/mig-3g.40gb on h100-mig-3g-40gb")


def test_count_per_replica_comes_from_one_node() -> None:
    cls = CLASSES["ascend-910b"].model_copy(update={"count": 2})
    spec = chat_cost(prefill__acceleratorClasses=["ascend-x2"], decode__acceleratorClasses=["ascend-x2"])
    nodes = [node("a", "ascend", 3), node("b", "ascend", 3)]  # 6 free cards but only 2 pairs
    plan = placement.plan(spec, {"ascend-x2": cls}, inventory.build(nodes, []), {"prefill": 1, "decode": 3})
    assert [(p.role, p.replicas) for p in plan.pools] == [("prefill", 1), ("decode", 1)]
    assert plan.shortfalls[0].missing_units == 4  # 2 replicas x 2 cards


def test_wrong_calls_raise() -> None:
    spec = deployment("qwen2-7b")
    inv = inventory.build([node("l40s-0", "l40s", 4)], [])
    with pytest.raises(ValueError, match=r"roles \['prefill'\] that the spec does not have"):
        placement.plan(spec, CLASSES, inv, {"prefill": 1})
    with pytest.raises(ValueError, match="must be >= 0, got -1"):
        placement.plan(spec, CLASSES, inv, {"colocated": -1})
    with pytest.raises(ValueError, match="cannot take -1"):
        inv.take(CLASSES["l40s-48gb"], -1)


def test_pod_requests_and_cpu_units() -> None:
    p = {
        "spec": {
            "containers": [
                {"resources": {"requests": {"cpu": "500m"}}},
                {"resources": {"limits": {"cpu": "1", "huawei.com/Ascend910": "2"}}},
            ],
            "initContainers": [{"resources": {"requests": {"cpu": "3"}}}],
            "overhead": {"cpu": "250m"},
        }
    }
    assert inventory.pod_requests(p) == {"cpu": 3.25, "huawei.com/Ascend910": 2.0}
    n = node("cpu-0", "cpu", "7500m")
    inv = inventory.build([n], [pod("x", "cpu-0", {"cpu": "1500m"})])
    assert inv.nodes[0].free["cpu"] == 6
    assert inv.slots(CLASSES["cpu"]) == 3
    # A Pending pod takes its cores as soon as the scheduler binds it: they are not free for a plan.
    inv = inventory.build([n], [pod("x", "cpu-0", {"cpu": "1500m"}), pod("pending", None, {"cpu": "4"})])
    assert inv.nodes[0].free["cpu"] == 2
    assert inv.slots(CLASSES["cpu"]) == 1


def test_plan_is_deterministic_and_pure() -> None:
    spec = chat_cost()
    nodes = [node("ascend-0", "ascend", 8), node("hygon-0", "hygon", 8)]
    inv = inventory.build(nodes, [])
    a = placement.plan(spec, CLASSES, inv, {"decode": 4})
    b = placement.plan(spec, CLASSES, inv, {"decode": 4})
    assert a == b
    assert inv.free_units(CLASSES["hygon-dcu-k100"]) == 8  # planning did not consume the caller's inventory


def test_surge_room_goes_to_pools_that_can_start_one_more_replica() -> None:
    spec = deployment("llama31-8b")  # prefill 1 x h100-80gb, decode 2 x h100-mig-3g-40gb
    roomy = inventory.build([node("g1", "h100", 8), node("m1", "h100-mig", 4)], [])
    plan = placement.plan(spec, CLASSES, roomy)
    assert placement.surge_room(plan, CLASSES, roomy) == {("prefill", "h100-80gb"), ("decode", "h100-mig-3g-40gb")}
    # Exactly the plan's size free: every pool must take a pod down to roll (a surge pod would stay Pending).
    tight = inventory.build([node("g1", "h100", 1), node("m1", "h100-mig", 2)], [])
    plan = placement.plan(spec, CLASSES, tight)
    assert [(p.role, p.replicas) for p in plan.pools] == [("prefill", 1), ("decode", 2)]
    assert placement.surge_room(plan, CLASSES, tight) == frozenset()
    # One spare slice: it goes to one pool only.
    one_spare = inventory.build([node("g1", "h100", 1), node("m1", "h100-mig", 3)], [])
    plan = placement.plan(spec, CLASSES, one_spare)
    assert placement.surge_room(plan, CLASSES, one_spare) == {("decode", "h100-mig-3g-40gb")}
