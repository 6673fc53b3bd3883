"""`pdfleet up` with engine.kvOffload / preemption swap: the worker's command line and engine file carry them (the
disk tier under the run directory), and the worker parses them into its engine config."""

from __future__ import annotations

import argparse
import json

from pdfleet_operator.local import machine
from pdfleet_operator.local import spec as specs
from pdfleet_operator.local import supervisor as sv
from tests.local.conftest import ROOT, write_spec
from tests.support.components import free_port


def test_up_passes_the_tiers_and_swap_to_its_workers(tmp_path, model_dir):
    from pdfleet_worker.server import worker_config

    local = specs.load(
        write_spec(
            tmp_path,
            model_dir,
            **{
                "engine.kvOffload": {"hostMemory": "64Mi", "disk": "128Mi"},
                "engine.preemption": "swap",
                "engine.swapSpace": "32Mi",
            },
        ),
        ROOT / "examples" / "acceleratorclasses.yaml",
    )
    sup = sv.Supervisor(local, tmp_path / "run", free_port(), threads=2, machine=machine.Machine(2, 0))
    (tmp_path / "run").mkdir(exist_ok=True)
    sup.write_files()
    engine = json.loads((tmp_path / "run" / "engine.json").read_text())
    assert engine["kv_offload"]["host_memory_bytes"] == 64 << 20 and engine["preemption"] == "swap"
    argv = sup._worker_argv(sv.Replica("prefill-0", "prefill", "cpu", 9003))
    assert argv[argv.index("--kv-offload-disk-path") + 1] == str(tmp_path / "run" / "kv-offload")
    p = argparse.ArgumentParser()
    worker_config.add_arguments(p)
    args = p.parse_args(argv[argv.index("worker") + 1 :] + ["--num-kv-blocks", "32"])
    cfg = worker_config.from_args(args).engine
    assert (cfg.kv_offload_host_bytes, cfg.kv_offload_disk_bytes) == (64 << 20, 128 << 20)
    assert cfg.kv_offload_disk_dir == str(tmp_path / "run" / "kv-offload")
    assert (cfg.preemption, cfg.swap_space_bytes) == ("swap", 32 << 20)
