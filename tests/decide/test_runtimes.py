"""Which engine each pool runs, and the combinations that cannot work (decide.runtimes, pure)."""

from __future__ import annotations

import pytest

from pdfleet_operator.api import AcceleratorClassSpec
from pdfleet_operator.api.names import DEFAULT_WORKER_IMAGE
from pdfleet_operator.decide import runtimes
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
    assert ("ASCEND_RT_VISIBLE_DEVICES", "0") in ascend.env and ascend.image == DEFAULT_WORKER_IMAGE, "the operator's default"


def test_no_bridge_no_pdfleet_worker_unless_the_class_names_a_device() -> None:
    s = spec()
    with pytest.raises(runtimes.RuntimeProblem, match="no PyTorch bridge for kunlunxin"):
        runtimes.for_pool(s, "decode", "kunlunxin-r200", CLASSES["kunlunxin-r200"])
    cls = CLASSES["kunlunxin-r200"].model_copy(
        update={"runtimes": CLASSES["kunlunxin-r200"].runtimes.model_copy(
            update={"pdfleet": CLASSES["kunlunxin-r200"].runtimes.pdfleet.model_copy(update={"device": "xpu"})})})
    assert runtimes.for_pool(s, "decode", "kunlunxin-r200", cls).device == "xpu"


def test_prefill_and_decode_on_two_engines_is_refused_naming_the_field() -> None:
    # The H100 class runs vLLM by default, the MIG slices the pdfleet worker.
    h100 = CLASSES["h100-80gb"]
    classes = with_class("h100-80gb", runtimes=h100.runtimes.model_copy(update={"default": "vllm"}))
    problems = runtimes.check(spec(), classes)
    assert fields(problems) == ["spec.engine.runtime"]
    assert "prefill on h100-80gb: vllm" in problems[0].message and "decode on h100-mig-3g-40gb: pdfleet" in problems[0].message
    # Choosing one engine for both resolves it: both classes offer vLLM.
    assert runtimes.check(spec(runtime="vllm"), classes) == []


def test_vllm_where_the_class_offers_none_is_refused_unless_the_deployment_names_an_image() -> None:
    s = spec_of(EXAMPLES["chat-cost"])
    s = s.model_copy(update={"engine": s.engine.model_copy(update={"runtime": "vllm"})}, deep=True)
    problems = runtimes.check(s, CLASSES)
    assert {p.field for p in problems} == {"spec.engine.runtime"}
    assert any("hygon-dcu-k100" in p.message and "offers no vllm" in p.message for p in problems)
    from pdfleet_operator.api.inference_deployment import VllmEngineSpec
    s2 = s.model_copy(update={"engine": s.engine.model_copy(update={"vllm": VllmEngineSpec(image="registry/dtk-vllm:1",
                                                                                         kv_connector="MooncakeConnectorV1")})})
    assert runtimes.check(s2, CLASSES) == []
    rt = runtimes.for_pool(s2, "decode", "hygon-dcu-k100", CLASSES["hygon-dcu-k100"])
    assert (rt.name, rt.image, rt.kv_connector) == ("vllm", "registry/dtk-vllm:1", "MooncakeConnectorV1")


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
    s = spec_of(EXAMPLES["llama31-8b-mixed"])  # H100 prefill, Ascend decode, the deployment names Mooncake
    assert runtimes.check(s, CLASSES) == []
    s = s.model_copy(update={"engine": s.engine.model_copy(update={"vllm": None})}, deep=True)
    problems = runtimes.check(s, CLASSES)
    assert fields(problems) == ["spec.engine.vllm.kvConnector"]
    assert "NixlConnector" in problems[0].message and "MooncakeConnectorV1" in problems[0].message


def test_one_role_runs_one_engine() -> None:
    s = spec_of(EXAMPLES["chat-latency"])  # prefill [h100, h200], decode [h200, h100]
    h200 = CLASSES["h200-141gb"]
    classes = with_class("h200-141gb", runtimes=h200.runtimes.model_copy(update={"default": "vllm"}))
    problems = runtimes.check(s, classes)
    assert "spec.prefill.acceleratorClasses" in fields(problems) and "spec.decode.acceleratorClasses" in fields(problems)


# --- hostPath models (decide.guardrails) ------------------------------------------------------------------

def _host_path(path: str):
    from pdfleet_operator.api.inference_deployment import HostPathSource, ModelSource
    s = spec_of(EXAMPLES["qwen2-7b"])
    return s.model_copy(update={"model": s.model.model_copy(update={"source": ModelSource(host_path=HostPathSource(path=path))})})


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
    s = s.model_copy(update={"engine": s.engine.model_copy(update={"runtime": "vllm"}),
                             "colocated": s.colocated.model_copy(update={"accelerator_classes": ["h100-80gb"]})})
    assert runtimes.check(s, CLASSES) == []


def test_vllm_on_the_cpu_class_takes_its_block_size_and_no_tensor_parallelism() -> None:
    s = spec_of(EXAMPLES["local-vllm"])
    rt = runtimes.for_pool(s, "colocated", "cpu", CLASSES["cpu"])
    assert (rt.name, rt.tensor_parallel) == ("vllm", 1)  # the cpu class's count of 2 is cores
    s = s.model_copy(update={"engine": s.engine.model_copy(update={"block_size": 16})})
    problems = runtimes.check(s, CLASSES)
    assert [p.field for p in problems] == ["spec.engine.blockSize"] and "multiple of 32" in problems[0].message
