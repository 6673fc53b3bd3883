"""The engine's partial prefill auto in the simulator: on a pdfleet pool a prompt the token budget would cut waits whole
for the next step when the step-time model says the cut would lengthen the step by DEFER_SHARE or more; a vLLM
pool always cuts (vLLM's chunked prefill)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pdfleet_operator.sim import engine as eng
from tests.sim.support import small
from tests.sim.test_simulator import Checked, surge


class Cutting(Checked):
    """pdfleet pools that cut every prompt as vLLM does (the same efficiencies, only the rule off)."""

    def _deployment(self, idx, d):  # noqa: ANN001, ANN202
        state = super()._deployment(idx, d)
        state.perfs = {k: replace(v, defers_partial_prefill=False) for k, v in state.perfs.items()}
        return state


def _colocated(runtime: str | None = None, cut: bool = False):
    # vLLM: both roles on NVIDIA classes (vLLM-Ascend cannot exchange KV with upstream vLLM)
    spec = {"engine": {"runtime": runtime}, "decode": {"acceleratorClasses": ["h100-mig-3g-40gb"]}} if runtime else {}
    f = small(deployment={"spec": spec})
    return (Cutting if cut else Checked)(f, f.policy("colocated"), surge(duration=300.0, low=2.0, high=10.0)).run()


def _ttfts(sim) -> np.ndarray:  # noqa: ANN001
    done = np.asarray(sim.reqs.status) == eng.DONE
    return (np.asarray(sim.reqs.t_first) - np.asarray(sim.reqs.arrival))[done]


def test_the_simulator_defers_by_the_engines_rule() -> None:
    from pdfleet_worker.engine import scheduler

    assert eng.DEFER_SHARE == scheduler.DEFER_SHARE


def test_pdfleet_pools_leave_cut_prompts_whole_and_gain_first_tokens() -> None:
    auto = _colocated()
    assert sum(r.deferred_prefills for r in auto.all_replicas) > 0
    assert all(r.perf.defers_partial_prefill for r in auto.all_replicas)
    done = np.asarray(auto.reqs.status) == eng.DONE
    assert done.mean() > 0.95
    assert np.array_equal(np.asarray(auto.reqs.gen)[done], np.asarray(auto.reqs.output)[done])
    fill = _colocated(cut=True)
    assert sum(r.deferred_prefills for r in fill.all_replicas) == 0
    a, f = _ttfts(auto), _ttfts(fill)
    # NOTE: an 8B model on H100-class pools at this load: most prompts fit their step, so the gain is small
    # (mean 79.1 against 81.6 ms); the trace is seeded, so the comparison is exact, not a sample
    assert np.median(a) <= np.median(f) and a.mean() < f.mean()


def test_vllm_pools_always_cut() -> None:
    sim = _colocated("vllm")
    assert sim.all_replicas and not any(r.perf.defers_partial_prefill for r in sim.all_replicas)
    assert sum(r.deferred_prefills for r in sim.all_replicas) == 0
