"""Cost of a plan: $/h per pool and deployment, the router's share, $ per 1M tokens."""

from __future__ import annotations

import pytest

from pdfleet_operator.decide import cost
from pdfleet_operator.decide.placement import FleetPlan, PlannedPool
from tests.kube.cluster import classes

CLASSES = classes()


def test_pool_and_plan_cost() -> None:
    plan = FleetPlan(
        pools=(
            PlannedPool("prefill", "h100-80gb", 2),
            PlannedPool("decode", "h100-mig-3g-40gb", 3),
            PlannedPool("decode", "kunlunxin-r200", 1),
        ),
        targets={"prefill": 2, "decode": 4},
    )
    c = cost.plan_cost(plan, CLASSES, router_replicas=2, router_cpu=1.0)
    assert [p.cost_per_hour for p in c.pools] == pytest.approx([2 * 2.99, 3 * 1.28, 0.55])
    assert c.of("decode", "h100-mig-3g-40gb") == pytest.approx(3.84)
    assert c.router_per_hour == pytest.approx(2 * 1.0 * 0.10)  # the cpu class prices a core at 0.10
    assert c.total_per_hour == pytest.approx(5.98 + 3.84 + 0.55 + 0.2)


def test_count_multiplies_price_and_no_cpu_class_means_free_router() -> None:
    pair = CLASSES["ascend-910b"].model_copy(update={"count": 2})
    plan = FleetPlan(pools=(PlannedPool("colocated", "ascend-x2", 3),), targets={"colocated": 3})
    c = cost.plan_cost(plan, {"ascend-x2": pair}, router_replicas=1)
    assert c.pools_per_hour == pytest.approx(3 * 2 * 1.20)
    assert c.router_per_hour == 0.0


def test_router_cores_from_requests() -> None:
    assert cost.router_cores({"cpu": "500m"}) == 0.5
    assert cost.router_cores({}) == cost.DEFAULT_ROUTER_CORES


def test_unknown_class_is_a_wrong_call() -> None:
    plan = FleetPlan(pools=(PlannedPool("decode", "gone", 1),))
    with pytest.raises(ValueError, match="pool decode/gone: no such AcceleratorClass"):
        cost.plan_cost(plan, CLASSES)


def test_per_million_tokens() -> None:
    assert cost.per_million_tokens(3.6, 1000) == pytest.approx(1.0)  # 3.6 M tokens/h for $3.60
    assert cost.per_million_tokens(3.6, 0) is None
    with pytest.raises(ValueError):
        cost.per_million_tokens(-1, 10)
