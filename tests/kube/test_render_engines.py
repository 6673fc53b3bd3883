"""Pools rendered per engine: the pdfleet worker with the device its class holds, vLLM with `vllm serve` flags
that vLLM's own argument parser accepts, and the router told which engine each role runs."""

from __future__ import annotations

import json
import subprocess

import pytest

from pdfleet_operator.decide import inventory, placement, worker_images
from pdfleet_operator.kube import render
from tests.kube.cluster import classes, example_deployments, spec_of, standard_nodes
from tests.support import vllm

CLASSES = classes()
EXAMPLES = example_deployments()


def objects(name: str, cls=CLASSES, spec=None) -> dict[tuple[str, str], dict]:
    spec = spec or spec_of(EXAMPLES[name])
    plan = placement.plan(spec, cls, inventory.build(standard_nodes(), []))
    owner = render.Owner(name, "team-a", "uid")
    return {(o["kind"], o["metadata"]["name"]): o for o in render.render(owner, spec, plan, cls, revision=1)}


def container(objs: dict, pool: str) -> dict:
    (c,) = objs[("Deployment", pool)]["spec"]["template"]["spec"]["containers"]
    return c


def test_a_vllm_pool_runs_vllm_serve_with_the_specs_engine_settings() -> None:
    objs = objects("qwen2-7b-vllm")
    c = container(objs, "qwen2-7b-vllm-colocated-h100-80gb")
    assert (c["name"], c["image"], c["command"]) == ("vllm", "vllm/vllm-openai:v0.32.0", ["vllm", "serve"])
    args = c["args"]
    assert args[0] == "/models/Qwen2-7B-Instruct"
    flags = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--") and not args[i + 1].startswith("--")}
    assert flags["--served-model-name"] == "qwen2-7b-instruct" and flags["--port"] == "8000"
    assert flags["--max-model-len"] == "8192" and flags["--block-size"] == "16"
    assert flags["--gpu-memory-utilization"] == "0.9" and flags["--tensor-parallel-size"] == "1"
    assert "--enable-prefix-caching" in args and "--kv-transfer-config" not in args  # colocated: no KV hand-off
    # vLLM serves /health and no /ready; no engine.json for it.
    assert c["readinessProbe"]["httpGet"]["path"] == "/health" and c["startupProbe"]["httpGet"]["path"] == "/health"
    assert all(m["name"] != "config" for m in c["volumeMounts"])
    pod = objs[("Deployment", "qwen2-7b-vllm-colocated-h100-80gb")]["spec"]["template"]
    assert pod["metadata"]["labels"]["pdfleet.io/engine"] == "vllm"
    assert "pdfleet.io/config-hash" not in pod["metadata"]["annotations"]
    router = container(objs, "qwen2-7b-vllm-router")
    assert router["args"][:3] == ["router", "--workers", "vllm@http://qwen2-7b-vllm-colocated.team-a.svc:8000"]


def ascend_vllm_spec():
    spec = spec_of(EXAMPLES["qwen2-7b-vllm"])
    return spec.model_copy(
        update={"colocated": spec.colocated.model_copy(update={"accelerator_classes": ["ascend-910b"]})}
    )


def test_the_mixed_example_runs_each_vendors_worker_build_and_pdfleets_own_kv_transfer() -> None:
    objs = objects("llama31-8b-mixed")
    prefill = container(objs, "llama31-8b-mixed-prefill-h100-80gb")
    decode = container(objs, "llama31-8b-mixed-decode-ascend-910b")
    assert prefill["image"].endswith("-cuda") and decode["image"].endswith("-npu")
    assert prefill["args"][prefill["args"].index("--device") + 1] == "cuda"
    assert decode["args"][decode["args"].index("--device") + 1] == "npu"
    assert (
        "--kv-peers" in decode["args"]
        and {"name": "kv", "containerPort": render.KV_PORT, "protocol": "TCP"} in prefill["ports"]
    )
    assert not any(e["name"].endswith("_VISIBLE_DEVICES") for c in (prefill, decode) for e in c["env"])
    assert "HCCL_IF_IP" in {e["name"] for e in decode["env"]} and "HCCL_IF_IP" not in {
        e["name"] for e in prefill["env"]
    }
    router = container(objs, "llama31-8b-mixed-router")
    assert router["args"][:5] == [
        "router",
        "--prefill",
        "http://llama31-8b-mixed-prefill.team-a.svc:8000",
        "--decode",
        "http://llama31-8b-mixed-decode.team-a.svc:8000",
    ]
    assert router["image"].endswith("-cpu"), "the router computes on no accelerator: the CPU build"


def test_a_vllm_ascend_pool_runs_on_128_token_blocks_with_the_drivers_userland() -> None:
    c = container(objects("qwen2-7b-vllm", spec=ascend_vllm_spec()), "qwen2-7b-vllm-colocated-ascend-910b")
    assert c["image"] == "quay.io/ascend/vllm-ascend:v0.23.0"
    assert c["args"][c["args"].index("--block-size") + 1] == "128"
    env = {e["name"]: e for e in c["env"]}
    assert env["HCCL_IF_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    for path in (
        "/usr/local/Ascend/driver/lib64",
        "/usr/local/Ascend/driver/version.info",
        "/usr/local/bin/npu-smi",
        "/usr/local/dcmi",
    ):
        assert mounts[path]["readOnly"] is True, path


def test_nixl_pools_declare_the_side_channel_and_a_multi_device_class_is_tensor_parallel() -> None:
    spec = spec_of(EXAMPLES["llama31-8b"])
    spec = spec.model_copy(update={"engine": spec.engine.model_copy(update={"runtime": "vllm"})}, deep=True)
    cls = {**CLASSES, "h100-80gb": CLASSES["h100-80gb"].model_copy(update={"count": 2})}
    objs = objects("llama31-8b", cls, spec)
    c = container(objs, "llama31-8b-prefill-h100-80gb")
    assert c["args"][c["args"].index("--tensor-parallel-size") + 1] == "2"
    assert json.loads(c["args"][c["args"].index("--kv-transfer-config") + 1]) == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
    }
    assert {"name": "kv", "containerPort": 5600, "protocol": "TCP"} in c["ports"]
    env = {e["name"]: e for e in c["env"]}
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == "5600"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert c["resources"]["requests"]["nvidia.com/gpu"] == "2" and c["resources"]["requests"]["cpu"] == "4"
    # UCX moves NIXL's blocks on ports it picks at run time: every port, but only between this deployment's pods.
    (workers,) = [o for (kind, n), o in objs.items() if kind == "NetworkPolicy" and n == "llama31-8b-workers"]
    assert workers["spec"]["ingress"][0] == {
        "from": [{"podSelector": {"matchLabels": {"pdfleet.io/deployment": "llama31-8b"}}}]
    }


def test_vllm_runs_as_the_pods_uid_with_a_home_a_user_and_writable_caches() -> None:
    """HEAD: HOME=/tmp, no USER: vLLM's torch.compile caches ask getpwuid() for uid 10001, which has no passwd entry."""
    objs = objects("qwen2-7b-vllm")
    c = container(objs, "qwen2-7b-vllm-colocated-h100-80gb")
    pod = objs[("Deployment", "qwen2-7b-vllm-colocated-h100-80gb")]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["USER"] == env["LOGNAME"] == "pdfleet" and env["HOME"] == render.HOME_MOUNT
    writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
    for var in (
        "HOME",
        "XDG_CACHE_HOME",
        "VLLM_CACHE_ROOT",
        "TORCHINDUCTOR_CACHE_DIR",
        "TRITON_CACHE_DIR",
        "HF_HOME",
        "NUMBA_CACHE_DIR",
        "TMPDIR",
    ):
        assert any(env[var] == w or env[var].startswith(w + "/") for w in writable), var
    assert c["securityContext"]["readOnlyRootFilesystem"] is True and pod["securityContext"]["runAsUser"] == 10001
    assert {v["name"] for v in pod["volumes"] if "emptyDir" in v} >= {"home", "cache", "tmp", "shm"}
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"


def test_what_cannot_run_is_refused_before_anything_is_rendered() -> None:
    spec = spec_of(EXAMPLES["llama31-8b"])
    cls = {**CLASSES, "h100-80gb": CLASSES["h100-80gb"].model_copy(update={"count": 2})}
    with pytest.raises(ValueError, match=r"spec\.prefill\.acceleratorClasses\[0\].*no tensor parallelism"):
        objects("llama31-8b", cls, spec)


def test_cpu_pools_ask_for_the_memory_their_kv_is_sized_from() -> None:
    objs = objects("local-tiny")
    c = container(objs, "local-tiny-prefill-cpu")
    assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"] == "8Gi"
    assert c["args"][c["args"].index("--device") + 1] == "cpu"


def test_a_role_resources_of_the_users_own_win_over_the_derived_ones() -> None:
    spec = spec_of(EXAMPLES["qwen2-7b"])
    rs = spec.colocated.model_copy(
        update={"resources": spec.colocated.resources.model_copy(update={"requests": {"memory": "64Gi"}})}
    )
    spec = spec.model_copy(update={"colocated": rs})
    res = container(objects("qwen2-7b", spec=spec), "qwen2-7b-colocated-l40s-48gb")["resources"]
    assert res["requests"]["memory"] == "64Gi" and "memory" not in res["limits"]  # no derived limit below it
    assert res["requests"]["cpu"] == "2"


@pytest.mark.slow
def test_rendered_vllm_flags_parse_with_vllms_own_parser() -> None:
    """Every vLLM container of every example, and the PD/TP variants, through vLLM 0.32's own `serve` parser."""
    spec = spec_of(EXAMPLES["llama31-8b"])
    spec = spec.model_copy(update={"engine": spec.engine.model_copy(update={"runtime": "vllm"})}, deep=True)
    cls = {**CLASSES, "h100-80gb": CLASSES["h100-80gb"].model_copy(update={"count": 2})}
    rendered = [
        objects("qwen2-7b-vllm"),
        objects("qwen2-7b-vllm", spec=ascend_vllm_spec()),
        objects("llama31-8b", cls, spec),
    ]
    argvs = [
        ["--model", *c["args"]]
        for objs in rendered
        for (kind, _), o in objs.items()
        if kind == "Deployment"
        for c in o["spec"]["template"]["spec"]["containers"]
        if c["name"] == "vllm"
    ]
    assert len(argvs) == 4
    code = (
        "import json, sys\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "out = []\n"
        "for argv in json.loads(sys.stdin.read()):\n"
        "    a = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)\n"
        "    t = a.kv_transfer_config\n"
        "    out.append([a.served_model_name, a.max_model_len, a.block_size, a.gpu_memory_utilization,\n"
        "                a.max_num_seqs, a.max_num_batched_tokens, a.enable_prefix_caching, a.tensor_parallel_size,\n"
        "                t.kv_connector if t else None, t.kv_role if t else None])\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run(
        [vllm.vllm_python(), "-c", code], input=json.dumps(argvs), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    assert parsed[0] == [["qwen2-7b-instruct"], 8192, 16, 0.9, 256, 2048, True, 1, None, None]
    assert parsed[1] == [["qwen2-7b-instruct"], 8192, 128, 0.9, 256, 2048, True, 1, None, None], "vLLM-Ascend's blocks"
    assert [p[7:] for p in parsed[2:]] == [[2, "NixlConnector", "kv_both"], [1, "NixlConnector", "kv_both"]]


# What the example classes offer: (class, engine) -> the image its pool runs, or the refusal's words.
OFFERED = {
    ("h100-80gb", "vllm"): "vllm/vllm-openai:v0.32.0",
    ("ascend-910b", "vllm"): "quay.io/ascend/vllm-ascend:v0.23.0",
    ("kunlunxin-r200", "pdfleet"): "no PyTorch bridge for kunlunxin",
    ("cambricon-mlu370", "vllm"): "offers no vllm",
    ("hygon-dcu-k100", "vllm"): "offers no vllm",
    ("kunlunxin-r200", "vllm"): "offers no vllm",
    ("cpu", "vllm"): "offers no vllm",
}


@pytest.mark.parametrize("engine", ["pdfleet", "vllm"])
@pytest.mark.parametrize("class_name", sorted(CLASSES))
def test_every_example_class_with_both_engines_renders_valid_objects_or_is_refused(
    class_name: str, engine: str
) -> None:
    import kubernetes_validate

    # A 1B model, so that it fits every class (the smallest is a 10 GiB MIG slice).
    model = {
        **EXAMPLES["qwen2-7b"]["spec"]["model"],
        "maxModelLen": 2048,
        "architecture": {"parametersBillions": 1.0, "layers": 16, "kvHeads": 8, "headDim": 64},
    }
    doc = {
        **EXAMPLES["qwen2-7b"],
        "spec": {
            **EXAMPLES["qwen2-7b"]["spec"],
            "engine": {"runtime": engine},
            "model": model,
            "colocated": {"acceleratorClasses": [class_name], "minReplicas": 1},
        },
    }
    spec = spec_of(doc)
    cls = CLASSES[class_name]
    expected = OFFERED.get((class_name, engine))
    if expected is None and engine == "vllm":
        expected = "vllm/vllm-openai:v0.32.0" if cls.vendor == "nvidia" else "offers no vllm"
    if expected is not None and "/" not in expected:
        with pytest.raises(ValueError, match=expected):
            objects("qwen2-7b", spec=spec)
        return
    nodes = [
        {
            "metadata": {"name": "n", "labels": dict(cls.node_selector)},
            "status": {"allocatable": {cls.resource_name: str(8 * cls.count), "cpu": "64", "memory": "512Gi"}},
        }
    ]
    plan = placement.plan(spec, CLASSES, inventory.build(nodes, []))
    assert plan.replicas("colocated") == 1, plan.reasons
    objs = render.render(render.Owner("qwen2-7b", "team-a", "uid"), spec, plan, CLASSES, revision=1, monitoring=False)
    for o in objs:
        kubernetes_validate.validate(o, "1.30.0", strict=True)
    pool = next(o for o in objs if o["metadata"]["name"] == f"qwen2-7b-colocated-{class_name}")
    (c,) = pool["spec"]["template"]["spec"]["containers"]
    assert pool["spec"]["template"]["metadata"]["labels"]["pdfleet.io/engine"] == engine
    assert c["resources"]["requests"][cls.resource_name] == str(cls.count)
    if engine == "vllm":
        assert c["image"] == expected and c["command"] == ["vllm", "serve"]
    else:
        platform = worker_images.class_platform(cls)
        assert c["image"] == worker_images.DEFAULTS.get(platform) and c["image"].endswith(f"-{platform}")
        assert (
            c["args"][c["args"].index("--device") + 1]
            == {"nvidia": "cuda", "hygon": "cuda", "huawei": "npu", "cambricon": "mlu", "cpu": "cpu"}[cls.vendor]
        )
    for var in cls.env:
        assert {"name": var.name, "value": var.value} in c["env"]
