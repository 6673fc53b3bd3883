"""What a plan costs: $/h per pool and per deployment, and $ per 1M tokens (pure).

The reconcile path puts the plan's numbers in status (and its Events), and what runs (`running_cost`: the
pods bound to nodes) in the operator's metrics (`pdfleet_pool_cost_per_hour`), which dashboards divide by
token rates: a Pending pod holds no accelerator and costs nothing; an old pool kept serving during a
hand-over, or a surge pod during a rollout, holds one and is billed. The router runs on plain CPU
and is priced per core at the cheapest `vendor: cpu` AcceleratorClass, or at zero without one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pdfleet_operator.api import AcceleratorClassSpec, parse_quantity
from pdfleet_operator.api.names import ROUTER_ROLE
from pdfleet_operator.decide.inventory import ACCELERATOR_LABEL, DEPLOYMENT_LABEL, ROLE_LABEL
from pdfleet_operator.decide.placement import FleetPlan, PlannedPool

# CPU cores a router replica is priced at when its resources do not request cpu.
DEFAULT_ROUTER_CORES = 1.0


@dataclass(frozen=True)
class PoolCost:
    role: str
    accelerator_class: str
    replicas: int
    cost_per_hour: float


@dataclass(frozen=True)
class PlanCost:
    pools: tuple[PoolCost, ...]
    router_per_hour: float

    @property
    def pools_per_hour(self) -> float:
        return sum(p.cost_per_hour for p in self.pools)

    @property
    def total_per_hour(self) -> float:
        return self.pools_per_hour + self.router_per_hour

    def of(self, role: str, accelerator_class: str) -> float:
        return sum(p.cost_per_hour for p in self.pools if (p.role, p.accelerator_class) == (role, accelerator_class))


def pool_cost(pool: PlannedPool, cls: AcceleratorClassSpec) -> float:
    """replicas x units per replica x price per unit-hour."""
    return pool.replicas * cls.count * cls.cost_per_hour


def cpu_core_price(classes: Mapping[str, AcceleratorClassSpec]) -> float:
    """Price of one CPU core-hour: the cheapest cpu class's unit price (0 without one)."""
    prices = [c.cost_per_hour for c in classes.values() if c.vendor == "cpu"]
    return min(prices) if prices else 0.0


def router_cores(requests: Mapping[str, object]) -> float:
    cpu = requests.get("cpu")
    return parse_quantity(cpu) if cpu is not None else DEFAULT_ROUTER_CORES  # type: ignore[arg-type]


def plan_cost(
    plan: FleetPlan,
    classes: Mapping[str, AcceleratorClassSpec],
    *,
    router_replicas: int = 0,
    router_cpu: float = DEFAULT_ROUTER_CORES,
) -> PlanCost:
    """$/h of every pool of the plan plus the router; ValueError for a pool on an unknown class."""
    pools = []
    for pool in plan.pools:
        cls = classes.get(pool.accelerator_class)
        if cls is None:
            raise ValueError(
                f"pool {pool.role}/{pool.accelerator_class}: no such AcceleratorClass (known: {sorted(classes)})"
            )
        pools.append(PoolCost(pool.role, pool.accelerator_class, pool.replicas, pool_cost(pool, cls)))
    return PlanCost(tuple(pools), router_replicas * router_cpu * cpu_core_price(classes))


def running_cost(
    pods: Iterable[Mapping[str, Any]],
    namespace: str,
    deployment: str,
    classes: Mapping[str, AcceleratorClassSpec],
    *,
    router_cpu: float = DEFAULT_ROUTER_CORES,
) -> PlanCost:
    """$/h of what runs: this deployment's pods bound to a node (inventory.pod_view shapes), per (role, class),
    and its router pods. A pod of a class no longer defined is counted at $0."""
    counts: dict[tuple[str, str], int] = {}
    routers = 0
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if meta.get("namespace") != namespace or labels.get(DEPLOYMENT_LABEL) != deployment:
            continue
        if not (pod.get("spec") or {}).get("nodeName"):
            continue  # Pending: holds nothing yet
        role, acc = labels.get(ROLE_LABEL), labels.get(ACCELERATOR_LABEL)
        if role == ROUTER_ROLE:
            routers += 1
        elif role and acc:
            counts[(role, acc)] = counts.get((role, acc), 0) + 1
    pools = tuple(
        PoolCost(role, acc, n, n * classes[acc].count * classes[acc].cost_per_hour if acc in classes else 0.0)
        for (role, acc), n in sorted(counts.items())
    )
    return PlanCost(pools, routers * router_cpu * cpu_core_price(classes))


def per_million_tokens(cost_per_hour: float, tokens_per_second: float) -> float | None:
    """$ per 1M tokens at a token rate; None when nothing is served (never a division by zero)."""
    if cost_per_hour < 0 or tokens_per_second < 0:
        raise ValueError(f"negative cost {cost_per_hour} or rate {tokens_per_second}")
    if tokens_per_second == 0:
        return None
    return cost_per_hour / (tokens_per_second * 3600 / 1e6)
