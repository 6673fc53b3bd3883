"""Make-before-break (pure): what an inventory change, a better class or a scale-down does to pools that serve."""

from __future__ import annotations

from pdfleet_operator.api import AcceleratorClassSpec
from pdfleet_operator.decide import inventory, transition
from pdfleet_operator.decide.transition import LivePool
from tests.kube.cluster import node


def gpu_class(product: str, price: float, resource: str = "nvidia.com/gpu") -> AcceleratorClassSpec:
    return AcceleratorClassSpec.model_validate(
        {
            "vendor": "nvidia",
            "resourceName": resource,
            "memoryGiB": 80,
            "peakTflops": 989,
            "memoryBandwidthGBps": 3350,
            "costPerHour": price,
            "nodeSelector": {"nvidia.com/gpu.product": product},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        }
    )


# Two classes on the same H100 nodes (say a list price and a committed-use price): one hardware, two names.
CLASSES = {
    "h100": gpu_class("NVIDIA-H100-80GB-HBM3", 2.99),
    "h100-cud": gpu_class("NVIDIA-H100-80GB-HBM3", 1.99),
    "a100": gpu_class("NVIDIA-A100-SXM4-80GB", 1.79),
}


def free(*nodes: dict) -> inventory.Inventory:
    return inventory.build(list(nodes), [])


def pool(cls: str, replicas: int, ready: int | None = None, **kw) -> LivePool:
    return LivePool(f"m-decode-{cls}", "decode", cls, replicas, replicas if ready is None else ready, **kw)


def step(live, ideal, free_now, *, target=1, minimum=1, ranking=("h100", "a100"), **kw) -> transition.Step:
    return transition.step(
        {"decode": target},
        {"decode": minimum},
        {("decode", c): n for c, n in ideal.items()},
        {"decode": ranking},
        live,
        free_now,
        CLASSES,
        **kw,
    )


def test_a_cordoned_node_with_no_room_elsewhere_keeps_the_pool_serving_and_says_why() -> None:
    # The only replica sits on a cordoned node; placement from scratch finds nowhere for it.
    got = step([pool("h100", 1, displaced=1, displaced_why=(transition.NODE_CORDONED,))], {}, free())
    assert got.of("decode") == {"h100": 1}
    assert [d.reason for d in got.drift] == [transition.NODE_CORDONED]
    assert "cordoned" in got.drift[0].message
    assert got.stuck and "no free capacity" in got.stuck[0]


def test_a_cordoned_replica_gets_its_replacement_first_and_the_pool_shrinks_back_once_it_is_gone() -> None:
    cordoned = pool("h100", 1, displaced=1, displaced_why=(transition.NODE_CORDONED,))
    room = free(node("h100-1", "h100", 8))
    assert step([cordoned], {"h100": 1}, room).of("decode") == {"h100": 2}, "a surge replica on a healthy node"
    # Both run (the surge is ready, the old pod is still on the cordoned node): nothing shrinks yet.
    both = pool("h100", 2, ready=2, displaced=1, displaced_why=(transition.NODE_CORDONED,))
    assert step([both], {"h100": 1}, room).of("decode") == {"h100": 2}
    # The drain evicted the old pod; its ReplicaSet replaced it elsewhere: back to the target.
    assert step([pool("h100", 2, ready=2)], {"h100": 1}, room).of("decode") == {"h100": 1}


def test_a_not_ready_node_blip_surges_and_recovery_shrinks_back() -> None:
    blip = pool("h100", 2, ready=1, displaced=1, displaced_why=(transition.NODE_NOT_READY,))
    room = free(node("h100-1", "h100", 8))
    got = step([blip], {"h100": 2}, room, target=2)
    assert got.of("decode") == {"h100": 3}
    assert got.drift[0].reason == transition.NODE_NOT_READY
    assert step([pool("h100", 3, ready=3)], {"h100": 2}, room, target=2).of("decode") == {"h100": 2}


def test_a_deleted_class_hands_over_to_another_class_only_once_the_replacement_serves() -> None:
    unusable = {"h100": (transition.CLASS_DELETED, "AcceleratorClass h100 is being deleted")}
    room = free(node("a100-0", "a100", 8))
    got = step([pool("h100", 2)], {"a100": 2}, room, target=2, unusable=unusable)
    assert got.of("decode") == {"h100": 2, "a100": 2}
    assert [d.reason for d in got.drift] == [transition.CLASS_DELETED]
    assert got.moving and "until the replacements serve" in got.moving[0]
    one_ready = [pool("h100", 2), pool("a100", 2, ready=1)]
    assert step(one_ready, {"a100": 2}, room, target=2, unusable=unusable).of("decode") == {"h100": 1, "a100": 2}
    serving = [pool("h100", 1), pool("a100", 2)]
    assert step(serving, {"a100": 2}, room, target=2, unusable=unusable).of("decode") == {"h100": 0, "a100": 2}


def test_replicas_that_do_not_serve_go_at_once() -> None:
    # Moving away from h100: its two Pending replicas hold nothing and serve nothing.
    got = step([pool("h100", 3, ready=1), pool("a100", 1)], {"a100": 2}, free(node("a100-0", "a100", 8)), target=2)
    assert got.of("decode") == {"h100": 1, "a100": 2}


def test_on_the_same_full_hardware_replicas_move_one_at_a_time_above_the_minimum() -> None:
    full = free(node("h100-0", "h100", 0))  # every unit is held by the old pool
    ranking = ("h100-cud", "h100")
    got = step([pool("h100", 2)], {"h100-cud": 2}, full, target=2, ranking=ranking)
    # One released, its replacement asked for in the same step: it waits Pending for exactly those units.
    assert got.of("decode") == {"h100-cud": 1, "h100": 1}
    assert got.released == (("decode", "h100"),)
    # The replacement is starting: nothing else moves meanwhile.
    waiting = step([pool("h100", 1), pool("h100-cud", 1, ready=0)], {"h100-cud": 2}, full, target=2, ranking=ranking)
    assert waiting.of("decode") == {"h100-cud": 1, "h100": 1} and not waiting.released
    # It serves: the next one moves.
    nxt = step([pool("h100", 1), pool("h100-cud", 1)], {"h100-cud": 2}, full, target=2, ranking=ranking)
    assert nxt.of("decode") == {"h100-cud": 2, "h100": 0}


def test_a_single_replica_at_its_minimum_is_never_moved_by_breaking_it() -> None:
    got = step([pool("h100", 1)], {"h100-cud": 1}, free(node("h100-0", "h100", 0)), ranking=("h100-cud", "h100"))
    assert got.of("decode") == {"h100": 1}
    assert got.stuck and "minimum" in got.stuck[0]
    assert [d.reason for d in got.drift] == [transition.BETTER_PLACEMENT]


def test_the_autoscaler_lowering_the_target_removes_serving_replicas() -> None:
    got = step([pool("h100", 3)], {"h100": 1}, free(node("h100-0", "h100", 8)), target=1)
    assert got.of("decode") == {"h100": 1}
    assert not got.drift


def test_a_rollout_in_progress_keeps_serving_surplus() -> None:
    live = [pool("h100", 2), pool("a100", 1)]
    room = free(node("h100-0", "h100", 8))
    assert step(live, {"h100": 2}, room, target=2).of("decode") == {"h100": 2, "a100": 0}
    assert step(live, {"h100": 2}, room, target=2, holding=frozenset({"decode"})).of("decode") == {"h100": 2, "a100": 1}


def test_a_pool_whose_class_is_gone_stays_whole_until_it_can_go_whole() -> None:
    classes = {k: v for k, v in CLASSES.items() if k != "a100"}
    live = [pool("a100", 2), pool("h100", 1)]
    got = transition.step(
        {"decode": 2},
        {"decode": 1},
        {("decode", "h100"): 2},
        {"decode": ("h100",)},
        live,
        free(node("h100-0", "h100", 8)),
        classes,
    )
    assert got.of("decode") == {"h100": 2, "a100": 2}
    assert got.drift[0].reason == transition.CLASS_MISSING
    ready = [pool("a100", 2), pool("h100", 2)]
    got = transition.step(
        {"decode": 2},
        {"decode": 1},
        {("decode", "h100"): 2},
        {"decode": ("h100",)},
        ready,
        free(node("h100-0", "h100", 8)),
        classes,
    )
    assert got.of("decode") == {"h100": 2, "a100": 0}


def test_node_state_reads_cordon_readiness_and_absence() -> None:
    assert transition.node_state(node("n", "h100", 1)) is None
    assert transition.node_state(node("n", "h100", 1, unschedulable=True)) == transition.NODE_CORDONED
    assert transition.node_state(node("n", "h100", 1, ready=False)) == transition.NODE_NOT_READY
    assert transition.node_state(None) == transition.NODE_GONE


def test_a_pending_replacement_the_ideal_has_no_room_for_is_kept_not_shed() -> None:
    # A NotReady node's pod was evicted; its ReplicaSet's replacement is Pending and nothing has room for it.
    evicted = pool("h100", 1, ready=0)
    got = step([evicted], {}, free(node("h100-0", "h100", 0)))
    assert got.of("decode") == {"h100": 1}, "the role's only replica (to be) is not shed"
    # Above the target the Pending surplus still goes.
    assert step([pool("h100", 3, ready=1)], {}, free(node("h100-0", "h100", 0))).of("decode") == {"h100": 1}
