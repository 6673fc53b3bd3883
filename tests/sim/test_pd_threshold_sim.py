"""The simulator routes PD requests as the router does: prompts under the deployment's threshold
(decide/pd_threshold.py) skip the prefill pool and are prefilled by a decode replica."""

from __future__ import annotations

import numpy as np

from pdfleet_operator import trace as tr
from pdfleet_operator.decide import pd_threshold
from pdfleet_operator.sim import engine as eng
from pdfleet_operator.sim import simulator
from tests.sim.support import small


def test_short_prompts_are_prefilled_by_decode_replicas_and_long_ones_by_the_prefill_pool() -> None:
    fleet = small()
    policy = fleet.policy("static")
    (dep,) = policy.deployments
    threshold = pd_threshold.threshold(dep.spec, fleet.classes)
    assert threshold > 8
    n = 40
    prompts = np.where(np.arange(n) % 2 == 0, threshold - 1, 500)  # every other request under the threshold
    trace = tr.Trace("mixed", np.arange(n) * 2.0, prompts, np.full(n, 20), n * 2.0)
    sim = simulator.Simulator(fleet, policy, trace).run()
    assert np.all(np.asarray(sim.reqs.status) == eng.DONE)
    (d,) = sim.deps
    assert d.short_prompts == n // 2
    by_role = {"prefill": 0, "decode": 0}
    for r in sim.all_replicas:
        by_role[r.role] += r.prompt_tokens
    assert by_role == {"prefill": 500 * (n // 2), "decode": (threshold - 1) * (n // 2)}
