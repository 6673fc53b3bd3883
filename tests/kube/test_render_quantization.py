"""engine.quantization from the spec to the worker: the rendered engine config (pods and `pdfleet up` both write
engine_args.config_text), what the worker reads from it, and vLLM pools refused naming the field."""

from __future__ import annotations

import json

import pytest

from pdfleet_operator import engine_args
from pdfleet_operator.api import AcceleratorClassSpec
from pdfleet_operator.decide import runtimes
from tests.kube.test_render_engines import CLASSES, EXAMPLES, objects, spec_of


def with_engine(name: str, **engine):
    spec = spec_of(EXAMPLES[name])
    return spec.model_copy(update={"engine": spec.engine.model_copy(update=engine)}, deep=True)


def rendered_engine_config(name: str, spec) -> dict:
    objs = objects(name, spec=spec)
    (cm,) = [o for (kind, _), o in objs.items() if kind == "ConfigMap" and "engine.json" in o.get("data", {})]
    return json.loads(cm["data"]["engine.json"])


def test_int8_reaches_the_rendered_engine_config_and_none_leaves_it_as_before() -> None:
    assert "quantization" not in rendered_engine_config("local-tiny", spec_of(EXAMPLES["local-tiny"]))
    assert (
        rendered_engine_config("local-tiny", with_engine("local-tiny", quantization="int8"))["quantization"] == "int8"
    )


def test_the_worker_loads_what_pdfleet_up_and_the_pods_are_given(tmp_path) -> None:
    from pdfleet_worker.server import worker_config

    path = tmp_path / "engine.json"
    path.write_text(engine_args.config_text(with_engine("local-tiny", quantization="int8")))
    assert worker_config.load_engine_file(str(path))["quantization"] == "int8"


def test_a_vllm_pool_is_refused_int8_weights_naming_the_field() -> None:
    spec = with_engine("qwen2-7b-vllm", quantization="int8")
    problems = runtimes.check(spec, CLASSES)
    assert problems and problems[0].field == "spec.engine.quantization", problems
    assert "vllm" in problems[0].message
    # a class whose default engine is vLLM (the spec names none): refused the same way
    spec = with_engine("qwen2-7b-vllm", quantization="int8", runtime=None)
    name = spec.colocated.accelerator_classes[0]
    raw = CLASSES[name].model_dump(by_alias=True, exclude_none=True)
    raw["runtimes"]["default"] = "vllm"
    with pytest.raises(runtimes.RuntimeProblem) as err:
        runtimes.for_pool(spec, "colocated", name, AcceleratorClassSpec.model_validate(raw))
    assert err.value.field == "spec.engine.quantization"
    with pytest.raises(ValueError, match=r"spec\.engine\.quantization"):
        objects("qwen2-7b-vllm", spec=with_engine("qwen2-7b-vllm", quantization="int8"))
