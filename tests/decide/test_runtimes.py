"""Which engine each pool runs, and the combinations that cannot work (decide.runtimes, pure)."""

from __future__ import annotations

import pytest

from pdfleet_operator.api import AcceleratorClassSpec
from pdfleet_operator.decide import runtimes, worker_images
from tests.kube.cluster import classes, example_deployments, spec_of

EXAMPLES = example_deployments()

CLASSES = classes()


def spec(**engine):
    s = spec_of(EXAMPLES["llama31-8b"])  # prefill on h100-80gb, decode on h100-mig-3g-40gb
    return s.model_copy(update={"engine": s.engine.model_copy(update=engine)}, deep=True)


def with_class(name: str, **update) -> dict[str, AcceleratorClassSpec]:
    return {**CLASSES, name: CLASSES[name].model_copy(update=update, deep=True)}


def fields(problems) -> list[str]:
    return [p.field for p in problems]


def test_every_example_runs_as_written() -> None:
    for name, doc in EXAMPLES.items():
        assert runtimes.check(spec_of(doc), CLASSES) == [], name


def test_the_pdfleet_worker_gets_the_device_of_its_vendor() -> None:
    s = spec()
    assert runtimes.for_pool(s, "prefill", "h100-80gb", CLASSES["h100-80gb"]).device == "cuda"
    assert runtimes.for_pool(s, "prefill", "ascend-910b", CLASSES["ascend-910b"]).device == "npu"
    assert runtimes.for_pool(s, "prefill", "hygon-dcu-k100", CLASSES["hygon-dcu-k100"]).device == "cuda"
    assert runtimes.for_pool(s, "prefill", "cambricon-mlu370", CLASSES["cambricon-mlu370"]).device == "mlu"
    assert runtimes.for_pool(s, "prefill", "cpu", CLASSES["cpu"]).device == "cpu"
    ascend = runtimes.for_pool(s, "decode", "ascend-910b", CLASSES["ascend-910b"])
    assert ascend.image == worker_images.DEFAULTS.get("npu"), "the operator's default for the class's platform"
    assert not any(k.endswith("_VISIBLE_DEVICES") for k, _ in ascend.env), "the device plugin's, not ours"
    assert ascend.pod_ip_env == ("HCCL_IF_IP",)


def test_no_bridge_no_pdfleet_worker_unless_the_class_names_a_device() -> None:
    s = spec()
    with pytest.raises(runtimes.RuntimeProblem, match="no PyTorch bridge for kunlunxin"):
        runtimes.for_pool(s, "decode", "kunlunxin-r200", CLASSES["kunlunxin-r200"])
    cls = CLASSES["kunlunxin-r200"].model_copy(
        update={
            "runtimes": CLASSES["kunlunxin-r200"].runtimes.model_copy(
                update={"pdfleet": CLASSES["kunlunxin-r200"].runtimes.pdfleet.model_copy(update={"device": "xpu"})}
            )
        }
    )
    with pytest.raises(runtimes.RuntimeProblem, match="needs a pdfleet worker built for kunlunxin"):
        runtimes.for_pool(s, "decode", "kunlunxin-r200", cls)  # a device, but no image that drives it
    cls = cls.model_copy(
        update={
            "runtimes": cls.runtimes.model_copy(
                update={"pdfleet": cls.runtimes.pdfleet.model_copy(update={"image": "reg/kunlun-worker:1"})}
            )
        }
    )
    assert runtimes.for_pool(s, "decode", "kunlunxin-r200", cls).device == "xpu"


def test_prefill_and_decode_on_two_engines_is_refused_naming_the_field() -> None:
    # The H100 class runs vLLM by default, the MIG slices the pdfleet worker.
    h100 = CLASSES["h100-80gb"]
    classes = with_class("h100-80gb", runtimes=h100.runtimes.model_copy(update={"default": "vllm"}))
    problems = runtimes.check(spec(), classes)
    assert fields(problems) == ["spec.engine.runtime"]
    assert (
        "prefill on h100-80gb: vllm" in problems[0].message
        and "decode on h100-mig-3g-40gb: pdfleet" in problems[0].message
    )
    # Choosing one engine for both resolves it: both classes offer vLLM.
    assert runtimes.check(spec(runtime="vllm"), classes) == []


def test_vllm_where_the_class_offers_none_is_refused_unless_the_deployment_names_an_image() -> None:
    s = spec_of(EXAMPLES["chat-cost"])
    s = s.model_copy(update={"engine": s.engine.model_copy(update={"runtime": "vllm"})}, deep=True)
    problems = runtimes.check(s, CLASSES)
    assert {p.field for p in problems} == {"spec.engine.runtime"}
    assert any("hygon-dcu-k100" in p.message and "offers no vllm" in p.message for p in problems)
    from pdfleet_operator.api.inference_deployment import VllmEngineSpec

    s2 = s.model_copy(
        update={
            "engine": s.engine.model_copy(update={"vllm": VllmEngineSpec(image="registry/dtk-vllm:1")}),
            "prefill": s.prefill.model_copy(update={"accelerator_classes": ["hygon-dcu-k100"]}),
            "decode": s.decode.model_copy(update={"accelerator_classes": ["hygon-dcu-k100"]}),
        }
    )
    assert runtimes.check(s2, CLASSES) == []
    rt = runtimes.for_pool(s2, "decode", "hygon-dcu-k100", CLASSES["hygon-dcu-k100"])
    assert (rt.name, rt.image, rt.kv_connector, rt.build) == (
        "vllm",
        "registry/dtk-vllm:1",
        "NixlConnector",
        "vllm-dcu",
    )
    # Ascend and Hygon in one role each: two vLLM builds that cannot exchange KV.
    s3 = s.model_copy(
        update={"engine": s.engine.model_copy(update={"vllm": VllmEngineSpec(image="registry/dtk-vllm:1")})}
    )
    assert any("cannot talk" in p.message for p in runtimes.check(s3, CLASSES))


def test_a_multi_device_class_needs_tensor_parallelism() -> None:
    x2 = CLASSES["h100-80gb"].model_copy(update={"count": 2})
    classes = {**CLASSES, "h100-80gb": x2}
    problems = runtimes.check(spec(), classes)
    assert fields(problems) == ["spec.prefill.acceleratorClasses[0]"]
    assert "no tensor parallelism" in problems[0].message
    vllm = runtimes.for_pool(spec(runtime="vllm"), "prefill", "h100-80gb", x2)
    assert (vllm.name, vllm.tensor_parallel, vllm.kv_connector) == ("vllm", 2, "NixlConnector")
    # The cpu class's count is cores, not devices: the pdfleet worker runs there.
    assert CLASSES["cpu"].count == 2 and runtimes.check(spec_of(EXAMPLES["local-tiny"]), CLASSES) == []


def test_vllm_prefill_and_decode_need_one_kv_connector() -> None:
    s = spec(runtime="vllm")  # H100 prefill, MIG decode: both upstream vLLM, NIXL by default
    assert runtimes.check(s, CLASSES) == []
    from pdfleet_operator.api.inference_deployment import VllmEngineSpec

    h100 = CLASSES["h100-80gb"]
    mooncake = with_class(
        "h100-80gb",
        runtimes=h100.runtimes.model_copy(
            update={"vllm": h100.runtimes.vllm.model_copy(update={"kv_connector": "NixlConnector"})}
        ),
    )
    assert runtimes.check(s, mooncake) == []
    s2 = s.model_copy(update={"engine": s.engine.model_copy(update={"vllm": VllmEngineSpec(kv_connector="LMCache")})})
    problems = runtimes.check(s2, CLASSES)
    assert set(fields(problems)) == {"spec.engine.vllm.kvConnector"}
    assert (
        "LMCache is not a KV connector of upstream vLLM (its connectors: NixlConnector, MooncakeConnector)"
        in problems[0].message
    )


def test_a_connector_the_router_cannot_drive_is_refused() -> None:
    """Upstream vLLM's MooncakeConnector: its prefill answers no kv_transfer_params (a proxy must assign them)."""
    from pdfleet_operator.api.inference_deployment import VllmEngineSpec

    s = spec(runtime="vllm")
    s = s.model_copy(
        update={"engine": s.engine.model_copy(update={"vllm": VllmEngineSpec(kv_connector="MooncakeConnector")})}
    )
    problems = runtimes.check(s, CLASSES)
    assert problems and all(p.field == "spec.engine.vllm.kvConnector" for p in problems)
    assert "answers no kv_transfer_params" in problems[0].message and "use NixlConnector" in problems[0].message


def test_vllm_prefill_and_decode_across_builds_cannot_talk() -> None:
    """The former mixed example: H100 on upstream vLLM, Ascend on vLLM-Ascend. HEAD rendered it with
    MooncakeConnectorV1 on both sides, a name upstream vLLM does not register, on 16- and 128-token blocks."""
    s = spec_of(EXAMPLES["llama31-8b-mixed"])
    s = s.model_copy(update={"engine": s.engine.model_copy(update={"runtime": "vllm"})}, deep=True)
    problems = runtimes.check(s, CLASSES)
    messages = " | ".join(str(p) for p in problems)
    assert set(fields(problems)) == {"spec.engine.blockSize", "spec.engine.vllm.kvConnector"}, messages
    assert "prefill on h100-80gb: 16" in messages and "decode on ascend-910b: 128" in messages
    assert "prefill on h100-80gb and decode on ascend-910b cannot talk" in messages
    assert "upstream vLLM's NixlConnector and vLLM-Ascend's MooncakeConnectorV1" in messages
    # Naming vLLM-Ascend's connector for both sides does not help: upstream vLLM has no such connector.
    from pdfleet_operator.api.inference_deployment import VllmEngineSpec

    s2 = s.model_copy(
        update={
            "engine": s.engine.model_copy(
                update={"vllm": VllmEngineSpec(kv_connector="MooncakeConnectorV1"), "block_size": 128}
            )
        }
    )
    problems = runtimes.check(s2, CLASSES)
    assert fields(problems) == ["spec.engine.vllm.kvConnector"]
    assert "MooncakeConnectorV1 is not a KV connector of upstream vLLM" in problems[0].message
    # As written (the pdfleet engine, its own TCP transfer) the pair runs: one block size, no connector.
    assert runtimes.check(spec_of(EXAMPLES["llama31-8b-mixed"]), CLASSES) == []


def test_vllm_ascend_takes_128_token_blocks_with_prefix_caching() -> None:
    s = spec_of(EXAMPLES["qwen2-7b-vllm"])
    s = s.model_copy(update={"colocated": s.colocated.model_copy(update={"accelerator_classes": ["ascend-910b"]})})
    rt = runtimes.for_pool(s, "colocated", "ascend-910b", CLASSES["ascend-910b"])
    assert (rt.build, rt.block_size, rt.pod_ip_env) == ("vllm-ascend", 128, ("HCCL_IF_IP",))
    off = s.model_copy(update={"engine": s.engine.model_copy(update={"enable_prefix_caching": False})})
    assert runtimes.for_pool(off, "colocated", "ascend-910b", CLASSES["ascend-910b"]).block_size == 16
    assert runtimes.for_pool(s, "colocated", "h100-80gb", CLASSES["h100-80gb"]).block_size == 16


# --- images per class (decide.worker_images) ---------------------------------------------------------------


def test_each_class_gets_the_image_of_its_platform() -> None:
    s = spec()
    images = {
        name: runtimes.for_pool(s, "prefill", name, CLASSES[name]).image
        for name in ("h100-80gb", "h100-mig-1g-10gb", "ascend-910b", "hygon-dcu-k100", "cambricon-mlu370", "cpu")
    }
    assert {n: worker_images.image_platform(i) for n, i in images.items()} == {
        "h100-80gb": "cuda",
        "h100-mig-1g-10gb": "cuda",
        "ascend-910b": "npu",
        "hygon-dcu-k100": "dtk",
        "cambricon-mlu370": "mlu",
        "cpu": "cpu",
    }, "HEAD: one --worker-image (a CPU build) for every class"


def test_a_class_whose_platform_has_no_image_is_refused_naming_what_to_build() -> None:
    """The chart's default (what `make images` builds): cpu and cuda only. An Ascend pool is refused, never
    rendered to crash-loop in DeviceUnavailable."""
    built = worker_images.WorkerImages.of({"cpu": "reg/pdfleet-worker:1-cpu", "cuda": "reg/pdfleet-worker:1-cuda"})
    s = spec_of(EXAMPLES["chat-cost"])  # Ascend and Hygon, the pdfleet worker
    problems = runtimes.check(s, CLASSES, built)
    assert problems and {p.field for p in problems} <= {
        "spec.prefill.acceleratorClasses[0]",
        "spec.prefill.acceleratorClasses[1]",
        "spec.decode.acceleratorClasses[0]",
        "spec.decode.acceleratorClasses[1]",
    }
    text = " | ".join(p.message for p in problems)
    assert "needs a pdfleet worker built for npu" in text and "needs a pdfleet worker built for dtk" in text
    assert "its images: cpu, cuda" in text and "spec.runtimes.pdfleet.image" in text
    assert runtimes.check(spec(), CLASSES, built) == [], "H100 and MIG run the cuda build"
    # The class's own image wins, as the admin names it.
    ascend = CLASSES["ascend-910b"]
    named = with_class(
        "ascend-910b",
        runtimes=ascend.runtimes.model_copy(
            update={"pdfleet": ascend.runtimes.pdfleet.model_copy(update={"image": "reg/pdfleet-worker:1-npu"})}
        ),
    )
    assert (
        runtimes.for_pool(s, "decode", "ascend-910b", named["ascend-910b"], images=built).image
        == "reg/pdfleet-worker:1-npu"
    )


def test_an_image_built_for_another_platform_is_refused() -> None:
    """The README's old install: one --worker-image, the CPU build, for NVIDIA pools that render --device cuda."""
    cpu_only = worker_images.WorkerImages.of({"cpu": "reg/pdfleet-worker:1-cpu", "cuda": "reg/pdfleet-worker:1-cuda"})
    s = spec(image="reg/pdfleet-worker:1-cpu")
    problems = runtimes.check(s, CLASSES, cpu_only)
    assert problems and "is built for cpu and cannot drive it" in problems[0].message
    assert "spec.engine.image" in problems[0].message
    with pytest.raises(ValueError, match="tagged for cpu"):
        worker_images.WorkerImages.of({"cuda": "reg/pdfleet-worker:1-cpu"})
    assert runtimes.check(spec(image="reg/my-own-build:7"), CLASSES, cpu_only) == [], "an untagged image is trusted"


def test_worker_image_flags_parse_by_platform() -> None:
    parsed = worker_images.WorkerImages.parse(["cuda=reg/w:2", "reg/pdfleet-worker:2-cpu"])
    assert parsed.images == (("cpu", "reg/pdfleet-worker:2-cpu"), ("cuda", "reg/w:2"))
    assert parsed.describe() == "cpu=reg/pdfleet-worker:2-cpu, cuda=reg/w:2"
    with pytest.raises(ValueError, match="name the platform"):
        worker_images.WorkerImages.parse(["reg/w:2"])
    with pytest.raises(ValueError, match="two worker images for cuda"):
        worker_images.WorkerImages.parse(["cuda=a", "cuda=b"])
    assert worker_images.image_platform("reg:5000/x/pdfleet-worker:0.1.0-npu@sha256:" + "0" * 64) == "npu"
    assert worker_images.image_platform("reg:5000/x/pdfleet-worker:0.1.0") is None


# --- class volumes (decide.guardrails) ---------------------------------------------------------------------


def _volumes(*pairs):
    from pdfleet_operator.api.accelerator_class import ClassVolume, ClassVolumeMount, HostPathSource

    vols = [ClassVolume(name=f"v{i}", host_path=HostPathSource(path=h)) for i, (h, _) in enumerate(pairs)]
    mounts = [ClassVolumeMount(name=f"v{i}", mount_path=m) for i, (_, m) in enumerate(pairs)]
    return with_class("ascend-910b", volumes=vols, volume_mounts=mounts)["ascend-910b"]


def test_class_host_paths_stay_off_the_nodes_sensitive_paths() -> None:
    from pdfleet_operator.decide import guardrails

    assert guardrails.class_volume_problems(CLASSES["ascend-910b"]) == [], "the example's driver mounts"
    for host in (
        "/",
        "/var/run/containerd",
        "/var/lib/kubelet/pods",
        "/etc/kubernetes",
        "/var",
        "/usr/local/../../etc",
        "/root/.ssh",
        "/dev",
        "/var/run/docker.sock",
    ):
        problems = guardrails.class_volume_problems(_volumes((host, "/opt/x")))
        assert problems and problems[0].field == "spec.volumes[0].hostPath.path", host
    for mount in ("/", "/usr", "/tmp", "/etc/pdfleet", "/var/run/pdfleet/auth", "/models", "/home/pdfleet/x"):
        problems = guardrails.class_volume_problems(_volumes(("/opt/hyhal", mount)))
        assert problems and problems[0].field == "spec.volumeMounts[0].mountPath", mount
    s = spec()
    with pytest.raises(runtimes.RuntimeProblem, match=r"AcceleratorClass ascend-910b spec.volumes\[0\].hostPath.path"):
        runtimes.for_pool(s, "decode", "ascend-910b", _volumes(("/var/lib/kubelet", "/opt/x")))


def test_one_role_runs_one_engine() -> None:
    s = spec_of(EXAMPLES["chat-latency"])  # prefill [h100, h200], decode [h200, h100]
    h200 = CLASSES["h200-141gb"]
    classes = with_class("h200-141gb", runtimes=h200.runtimes.model_copy(update={"default": "vllm"}))
    problems = runtimes.check(s, classes)
    assert "spec.prefill.acceleratorClasses" in fields(problems) and "spec.decode.acceleratorClasses" in fields(
        problems
    )


# --- hostPath models (decide.guardrails) ------------------------------------------------------------------


def _host_path(path: str):
    from pdfleet_operator.api.inference_deployment import HostPathSource, ModelSource

    s = spec_of(EXAMPLES["qwen2-7b"])
    return s.model_copy(
        update={"model": s.model.model_copy(update={"source": ModelSource(host_path=HostPathSource(path=path))})}
    )


def test_host_path_models_only_where_the_admin_allows() -> None:
    from pdfleet_operator.decide import guardrails

    assert guardrails.host_path_problem(spec_of(EXAMPLES["qwen2-7b"]), "team-a", (), ()) is None  # a PVC
    refused = guardrails.host_path_problem(_host_path("/"), "team-a", (), ())
    assert refused.startswith("spec.model.source.hostPath.path: '/' is not under a host path the cluster admin allows")
    allowed = ("/srv/models",)
    assert guardrails.host_path_problem(_host_path("/srv/models/qwen"), "team-a", allowed, ()) is None
    assert guardrails.host_path_problem(_host_path("/srv/models"), "team-a", allowed, ()) is None
    for attack in ("/srv/models2", "/srv/models/../../etc", "/etc", "/srv//models/x", "/srv/models/./x"):
        assert guardrails.host_path_problem(_host_path(attack), "team-a", allowed, ()) is not None, attack
    assert guardrails.host_path_problem(_host_path("/etc"), "ml-admin", allowed, ("ml-admin",)) is None
    assert guardrails.normalize_prefix("/srv/models/") == "/srv/models"
    with pytest.raises(ValueError, match="absolute"):
        guardrails.normalize_prefix("models")


def test_float16_is_refused_for_the_pdfleet_worker_and_served_by_vllm() -> None:
    s = spec_of(EXAMPLES["qwen2-7b"])
    s = s.model_copy(update={"model": s.model.model_copy(update={"dtype": "float16"})})
    problems = runtimes.check(s, CLASSES)
    assert [p.field for p in problems] == ["spec.model.dtype"] and "float16 needs vllm" in problems[0].message
    s = s.model_copy(
        update={
            "engine": s.engine.model_copy(update={"runtime": "vllm"}),
            "colocated": s.colocated.model_copy(update={"accelerator_classes": ["h100-80gb"]}),
        }
    )
    assert runtimes.check(s, CLASSES) == []


def test_vllm_on_the_cpu_class_takes_its_block_size_and_no_tensor_parallelism() -> None:
    s = spec_of(EXAMPLES["local-vllm"])
    rt = runtimes.for_pool(s, "colocated", "cpu", CLASSES["cpu"])
    assert (rt.name, rt.tensor_parallel) == ("vllm", 1)  # the cpu class's count of 2 is cores
    s = s.model_copy(update={"engine": s.engine.model_copy(update={"block_size": 16})})
    problems = runtimes.check(s, CLASSES)
    assert [p.field for p in problems] == ["spec.engine.blockSize"] and "multiple of 32" in problems[0].message
