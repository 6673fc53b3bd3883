"""engine.kvOffload and engine.preemption from the spec to the pods: the worker's engine file and flags, the disk
tier's emptyDir, the memory the pod asks for; vLLM pools get its own offload flag or a refusal naming the field."""

from __future__ import annotations

import argparse
import json
import subprocess

import pytest

from pdfleet_operator import engine_args
from pdfleet_operator.api import InferenceDeploymentSpec
from pdfleet_operator.decide import runtimes
from pdfleet_operator.kube import render
from tests.kube.cluster import classes, example_deployments, spec_of
from tests.kube.test_render_engines import container, objects
from tests.support import vllm

CLASSES = classes()
EXAMPLES = example_deployments()


def with_engine(name: str, **engine) -> InferenceDeploymentSpec:
    spec = spec_of(EXAMPLES[name])
    wire = spec.wire()
    wire["engine"] = {**wire["engine"], **engine}
    return InferenceDeploymentSpec.model_validate(wire)


def test_nothing_changes_without_the_fields() -> None:
    cfg = engine_args.engine_config(spec_of(EXAMPLES["qwen2-7b"]))
    assert "kv_offload" not in cfg and "preemption" not in cfg and "swap_space_bytes" not in cfg


def test_the_pdfleet_pod_gets_the_tiers_swap_space_and_their_memory() -> None:
    plain = container(objects("qwen2-7b"), "qwen2-7b-colocated-l40s-48gb")
    spec = with_engine("qwen2-7b", kvOffload={"hostMemory": "8Gi", "disk": "32Gi"}, preemption="swap", swapSpace="2Gi")
    objs = objects("qwen2-7b", spec=spec)
    c = container(objs, "qwen2-7b-colocated-l40s-48gb")
    gib = lambda q: int(q.removesuffix("Gi"))  # noqa: E731
    assert gib(c["resources"]["requests"]["memory"]) == gib(plain["resources"]["requests"]["memory"]) + 10
    assert {"name": "kv-offload", "mountPath": "/var/cache/pdfleet/kv"} in c["volumeMounts"]
    pod = objs[("Deployment", "qwen2-7b-colocated-l40s-48gb")]["spec"]["template"]["spec"]
    assert {"name": "kv-offload", "emptyDir": {"sizeLimit": "32Gi"}} in pod["volumes"]
    cfg = json.loads(objs[("ConfigMap", render.config_name("qwen2-7b"))]["data"][render.CONFIG_KEY])
    assert cfg["kv_offload"] == {
        "host_memory_bytes": 8 << 30,
        "disk_bytes": 32 << 30,
        "disk_path": "/var/cache/pdfleet/kv",
    }
    assert cfg["preemption"] == "swap" and cfg["swap_space_bytes"] == 2 << 30


def test_cpu_pools_add_the_host_tier_to_their_memory() -> None:
    spec = with_engine("local-tiny", kvOffload={"hostMemory": "2Gi"})
    c = container(objects("local-tiny", spec=spec), "local-tiny-prefill-cpu")
    assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"] == "10Gi"  # 8Gi + 2Gi
    assert all(m["name"] != "kv-offload" for m in c["volumeMounts"])  # no disk tier


def test_the_worker_reads_the_rendered_file_into_its_engine_config(tmp_path) -> None:
    from pdfleet_worker.server import worker_config

    spec = with_engine(
        "local-tiny",
        kvOffload={"hostMemory": "512Mi", "disk": "1Gi", "diskPath": "/var/kv"},
        preemption="swap",
        swapSpace="256Mi",
    )
    path = tmp_path / "engine.json"
    path.write_text(engine_args.config_text(spec))
    p = argparse.ArgumentParser()
    worker_config.add_arguments(p)
    from pdfleet_worker.model.model_init import init_model

    model = str(tmp_path / "model")  # its own (a fresh clone has no models/tiny: `make demo` makes that one)
    init_model(model, "tiny")
    args = p.parse_args(
        [
            "--model",
            model,
            "--engine-config",
            str(path),
            "--num-kv-blocks",
            "64",
            "--kv-offload-disk-path",
            str(tmp_path / "kv"),
        ]
    )
    cfg = worker_config.from_args(args).engine
    assert (cfg.kv_offload_host_bytes, cfg.kv_offload_disk_bytes, cfg.kv_offload_disk_dir) == (
        512 << 20,
        1 << 30,
        str(tmp_path / "kv"),
    )
    assert (cfg.preemption, cfg.swap_space_bytes) == ("swap", 256 << 20)
    with pytest.raises(ValueError, match="kv_offload_host_memory: not a size"):
        worker_config.from_args(
            p.parse_args(["--model", model, "--num-kv-blocks", "8", "--kv-offload-host-memory", "lots"])
        )


def test_vllm_colocated_gpu_pools_get_vllms_native_offload_flag() -> None:
    spec = with_engine("qwen2-7b-vllm", kvOffload={"hostMemory": "16Gi"})
    c = container(objects("qwen2-7b-vllm", spec=spec), "qwen2-7b-vllm-colocated-h100-80gb")
    args = c["args"]
    assert args[args.index("--kv-offloading-size") + 1] == "16" and "--kv-offloading-backend" in args
    plain = container(objects("qwen2-7b-vllm"), "qwen2-7b-vllm-colocated-h100-80gb")
    # vLLM's offload buffer is pinned host memory in the pod: on top of request and limit (HEAD left it out, so
    # 64 GiB of offload sat under a 38 GiB limit: an OOMKill).
    gib = {
        k: int(v.removesuffix("Gi"))
        for k, v in (("request", c["resources"]["requests"]["memory"]), ("limit", c["resources"]["limits"]["memory"]))
    }
    base = {
        k: int(v.removesuffix("Gi"))
        for k, v in (
            ("request", plain["resources"]["requests"]["memory"]),
            ("limit", plain["resources"]["limits"]["memory"]),
        )
    }
    assert gib == {"request": base["request"] + 16, "limit": base["limit"] + 16}


@pytest.mark.parametrize(
    "engine, field",
    [
        ({"preemption": "swap"}, "spec.engine.preemption"),
        ({"kvOffload": {"disk": "8Gi"}}, "spec.engine.kvOffload.disk"),
    ],
)
def test_vllm_pools_refuse_what_vllm_cannot_do(engine, field) -> None:
    wire = spec_of(EXAMPLES["qwen2-7b-vllm"]).wire()
    wire["engine"] = {**wire["engine"], **engine}
    wire["engine"].pop("runtime", None)  # the class's default decides: runtimes refuses, not the CRD rule
    spec = InferenceDeploymentSpec.model_validate(wire)
    h100 = CLASSES["h100-80gb"]
    vllm_default = {
        **CLASSES,
        "h100-80gb": h100.model_copy(update={"runtimes": h100.runtimes.model_copy(update={"default": "vllm"})}),
    }
    assert runtimes.check(spec, {**CLASSES, "h100-80gb": _default(h100, "pdfleet")}) == []
    problems = runtimes.check(spec, vllm_default)
    assert [p.field for p in problems] == [field], problems


def _default(cls, engine: str):
    return cls.model_copy(update={"runtimes": cls.runtimes.model_copy(update={"default": engine})})


def test_vllm_offload_is_refused_on_cpu_and_next_to_a_pd_connector() -> None:
    spec = with_engine("llama31-8b", runtime="vllm", kvOffload={"hostMemory": "8Gi"})
    with pytest.raises(ValueError, match=r"spec\.engine\.kvOffload\.hostMemory.*PD connector"):
        objects("llama31-8b", spec=spec)
    cpu = CLASSES["cpu"].model_copy(
        update={"runtimes": CLASSES["cpu"].runtimes.model_copy(update={"vllm": CLASSES["h100-80gb"].runtimes.vllm})}
    )
    with pytest.raises(runtimes.RuntimeProblem, match="CUDA and XPU only"):
        runtimes.for_pool(
            with_engine("qwen2-7b-vllm", blockSize=32, kvOffload={"hostMemory": "1Gi"}), "colocated", "cpu", cpu
        )


@pytest.mark.parametrize(
    "engine, message",
    [
        ({"runtime": "vllm", "preemption": "swap"}, "preemption swap is the pdfleet engine's"),
        ({"runtime": "vllm", "kvOffload": {"disk": "1Gi"}}, "the disk tier is the pdfleet engine's"),
        ({"kvOffload": {}}, "kvOffload needs hostMemory, disk or both"),
        ({"kvOffload": {"hostMemory": "1Gi"}, "enablePrefixCaching": False}, "needs enablePrefixCaching"),
        ({"kvOffload": {"disk": "1Gi", "diskPath": "/dev/shm"}}, "used by the pod itself"),
        ({"preemption": "sometimes"}, "'recompute' or 'swap'"),
    ],
)
def test_admission_refuses_bad_offload_and_preemption_settings(engine, message) -> None:
    wire = spec_of(EXAMPLES["qwen2-7b"]).wire()
    wire["engine"] = {**wire["engine"], **engine}
    with pytest.raises(ValueError, match=message):
        InferenceDeploymentSpec.model_validate(wire)


@pytest.mark.slow
def test_the_offload_flag_parses_with_vllms_own_parser() -> None:
    spec = with_engine("qwen2-7b-vllm", kvOffload={"hostMemory": "16Gi"})
    c = container(objects("qwen2-7b-vllm", spec=spec), "qwen2-7b-vllm-colocated-h100-80gb")
    code = (
        "import json, sys\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "a = make_arg_parser(FlexibleArgumentParser()).parse_args(json.loads(sys.stdin.read()))\n"
        "print(json.dumps([a.kv_offloading_size, a.kv_offloading_backend]))\n"
    )
    done = subprocess.run(
        [vllm.vllm_python(), "-c", code],
        input=json.dumps(["--model", *c["args"]]),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [16.0, "native"]
