"""engine.preemption swap in the simulator: a preempted sequence parks its KV in the bounded swap space and rejoins
without recomputing; one that does not fit is recomputed and counted, as the engine does."""

from __future__ import annotations

import numpy as np
import pytest

from pdfleet_operator.sim import engine as eng
from tests.sim.support import small
from tests.sim.test_simulator import run, surge


def _sim(preemption: str, swap_space: str = "1Gi"):
    # A KV pool of about 10k tokens on the h100: a 10 req/s surge of long conversations overflows it.
    f = small(
        deployment={
            "spec": {"engine": {"kvCacheMemoryFraction": 0.03, "preemption": preemption, "swapSpace": swap_space}}
        }
    )
    return run("colocated", surge(duration=300.0, low=2.0, high=10.0), fleet=f)


@pytest.mark.parametrize("swap_space, fallbacks", [("8Gi", False), ("64Mi", True)])
def test_swap_preemption_parks_kv_and_falls_back_when_the_swap_space_is_full(swap_space: str, fallbacks: bool) -> None:
    sim = _sim("swap", swap_space)
    reps = sim.all_replicas
    assert sum(r.preempted for r in reps) > 0
    assert (sum(r.swap_fallbacks for r in reps) > 0) == fallbacks
    assert all(r.swapped_tokens == 0 and not r.swapped for r in reps)  # every parked sequence came back
    status = np.asarray(sim.reqs.status)
    done = status == eng.DONE
    assert done.mean() > 0.95
    assert np.array_equal(np.asarray(sim.reqs.gen)[done], np.asarray(sim.reqs.output)[done])


def test_recompute_never_touches_swap_space() -> None:
    sim = _sim("recompute")
    assert sum(r.preempted for r in sim.all_replicas) > 0
    assert all(r.swap_fallbacks == 0 and not r.swapped for r in sim.all_replicas)
    assert all(r.perf.swap_space_tokens == 0 for r in sim.all_replicas)


def test_simulate_says_kv_offload_is_not_modelled(tmp_path, capsys) -> None:
    import yaml

    from pdfleet_operator.sim import cli
    from tests.sim.support import doc

    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(doc(deployment={"spec": {"engine": {"kvOffload": {"hostMemory": "8Gi"}}}})))
    code = cli.main(
        [
            "simulate",
            "--fleet",
            str(fleet),
            "--trace",
            "conversation",
            "--policy",
            "static",
            "--duration",
            "3m",
            "--warmup",
            "1m",
            "--rate",
            "1",
            "--out",
            str(tmp_path / "out"),
            "--no-plots",
            "--quiet",
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "note: static/llama-8b: spec.engine.kvOffload is not modelled" in printed
