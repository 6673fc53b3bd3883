"""The prompt length below which PD requests skip the prefill pool, against the cost model worked by hand."""

from __future__ import annotations

import math

import pydantic
import pytest

from pdfleet_operator.api import InferenceDeploymentSpec, parse_duration
from pdfleet_operator.decide import pd_threshold, perf
from tests.kube.cluster import classes, example_deployments


def llama() -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate(example_deployments()["llama31-8b"]["spec"])


def test_same_class_on_both_sides_goes_local_up_to_what_the_itl_slo_absorbs() -> None:
    spec, h100 = llama(), classes()["h100-80gb"]
    per_token = 2 * spec.model.architecture.parameters_billions * 1e9 / (h100.peak_tflops * 1e12 * perf.PREFILL_MFU)
    # same class: the local path never loses on TTFT (no transfer), so the ITL slack decides
    slack = parse_duration(spec.slo.itl) - perf.itl_seconds(spec, h100)
    want = min(math.floor(slack / per_token), spec.engine.max_num_batched_tokens)
    assert pd_threshold.pair_threshold(spec, h100, h100) == want > 0


def test_a_slower_decode_class_goes_local_only_while_that_beats_the_hand_off() -> None:
    spec, h100 = llama(), classes()["h100-80gb"]
    slow = h100.model_copy(update={"peak_tflops": h100.peak_tflops / 4})
    params = 2 * spec.model.architecture.parameters_billions * 1e9
    p_p = params / (h100.peak_tflops * 1e12 * perf.PREFILL_MFU)
    p_d = 4 * p_p
    x = perf.kv_bytes_per_token(spec) / (h100.network_gbps * 1e9)
    ttft_bound = pd_threshold.HANDOFF_S / (p_d - p_p - x)
    itl_bound = (parse_duration(spec.slo.itl) - perf.itl_seconds(spec, slow)) / p_d
    assert ttft_bound < itl_bound
    assert pd_threshold.pair_threshold(spec, h100, slow) == math.floor(ttft_bound)
    # both orders over the classes the roles list: the smallest pair wins
    two = spec.model_copy(
        update={"decode": spec.decode.model_copy(update={"accelerator_classes": ["h100-80gb", "slow"]})}
    )
    assert pd_threshold.default_threshold(two, {**classes(), "slow": slow}) == math.floor(ttft_bound)


def test_no_architecture_colocated_and_explicit_values() -> None:
    spec, all_classes = llama(), classes()
    bare = spec.model_copy(update={"model": spec.model.model_copy(update={"architecture": None})})
    assert pd_threshold.threshold(bare, all_classes) == 0  # nothing to estimate with: every request through prefill
    colocated = InferenceDeploymentSpec.model_validate(example_deployments()["qwen2-7b"]["spec"])
    assert pd_threshold.threshold(colocated, all_classes) == 0
    pinned = spec.model_copy(update={"router": spec.router.model_copy(update={"pd_min_prompt_tokens": 7})})
    assert pd_threshold.threshold(pinned, all_classes) == 7
    tight = spec.model_copy(update={"slo": spec.slo.model_copy(update={"itl": "1ms"})})
    assert pd_threshold.threshold(tight, all_classes) == 0  # the decode step alone misses the ITL SLO: never local


def test_the_field_is_refused_on_a_colocated_deployment() -> None:
    doc = example_deployments()["qwen2-7b"]["spec"]
    with pytest.raises(pydantic.ValidationError, match="pdMinPromptTokens applies to disaggregated deployments"):
        InferenceDeploymentSpec.model_validate({**doc, "router": {"pdMinPromptTokens": 10}})
    # 0 skips nothing: accepted on any spec (a colocated copy of a PD example keeps it)
    InferenceDeploymentSpec.model_validate({**doc, "router": {"pdMinPromptTokens": 0}})
