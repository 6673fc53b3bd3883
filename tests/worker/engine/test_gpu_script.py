"""bench/gpu.py (issue 29): its token comparison and byte counts at unit level, its calibration line read by the
simulator, and `--cpu-smoke` end to end (the CUDA path's code at toy sizes, Triton interpreted)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from bench import gpu
from pdfleet_worker.config import ModelConfig
from pdfleet_worker.layers.quantized_linear import replace_linears
from pdfleet_worker.model.llama import LlamaForCausalLM
from tests.support.components import missing

REPO = Path(__file__).resolve().parents[3]


def _logits(*rows: list[float]) -> list[torch.Tensor]:
    return [torch.tensor(r) for r in rows]


# Two sequences; the oracle's top-2 gap is 2.0 at every position but sequence 1's second, where it is 1e-5.
WANT = [[0, 2], [1, 0]]
WANT_LOGITS = [_logits([3.0, 1.0, 0.0], [0.0, 1.0, 3.0]), _logits([1.0, 3.0, 0.0], [2.0, 1.99999, 0.0])]


def test_equal_tokens_match_and_every_position_is_compared():
    a = gpu.compare_greedy(WANT, WANT_LOGITS, WANT, WANT_LOGITS, tie_abs=1e-4)
    assert a.tokens_match and (a.compared, a.near_ties, a.mismatches, a.max_logit_diff) == (4, 0, 0, 0.0)


def test_an_injected_wrong_token_is_a_mismatch():
    got = [[0, 1], [1, 0]]  # sequence 0, position 1: the oracle's gap there is 2.0, no tie
    a = gpu.compare_greedy(got, WANT_LOGITS, WANT, WANT_LOGITS, tie_abs=1e-4, tie_rel=0.1)
    assert not a.tokens_match and a.mismatches == 1 and a.near_ties == 0
    assert "sequence 0 position 1: 1 != 2" in a.first_mismatch


def test_a_difference_at_a_near_tie_is_counted_not_failed():
    got = [[0, 2], [1, 1]]  # sequence 1, position 1: top-2 within 1e-5
    a = gpu.compare_greedy(got, WANT_LOGITS, WANT, WANT_LOGITS, tie_abs=1e-4)
    assert a.tokens_match and a.near_ties == 1 and a.mismatches == 0
    # bf16's bound is relative to the logits' scale: 1e-5 <= 1e-4 x 2.0
    assert gpu.compare_greedy(got, WANT_LOGITS, WANT, WANT_LOGITS, tie_rel=1e-4).near_ties == 1
    # and no bound at all makes it a mismatch
    assert not gpu.compare_greedy(got, WANT_LOGITS, WANT, WANT_LOGITS).tokens_match


def test_missing_or_extra_tokens_and_an_empty_comparison_do_not_match():
    short = gpu.compare_greedy([[0], [1, 0]], WANT_LOGITS, WANT, WANT_LOGITS, tie_abs=1e-4)
    extra = gpu.compare_greedy([[0, 2, 5], [1, 0]], WANT_LOGITS, WANT, WANT_LOGITS, tie_abs=1e-4)
    assert short.mismatches == extra.mismatches == 1 and not short.tokens_match and not extra.tokens_match
    assert not gpu.compare_greedy([], [], [], []).tokens_match
    with pytest.raises(ValueError, match="1 engine sequences against 2"):
        gpu.compare_greedy([[0, 2]], WANT_LOGITS[:1], WANT, WANT_LOGITS)


def test_logit_differences_are_reported():
    off = [[row + 0.01 for row in rows] for rows in WANT_LOGITS]
    a = gpu.compare_greedy(WANT, off, WANT, WANT_LOGITS)
    assert a.tokens_match and a.max_logit_diff == pytest.approx(0.01, abs=1e-6)


def _toy_config(tied: bool) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=100,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        tie_word_embeddings=tied,
    )


@pytest.mark.parametrize("tied", [False, True])
def test_decode_weight_bytes_leave_out_the_embedding_table_unless_it_is_the_lm_head(tied):
    cfg = _toy_config(tied)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    table = cfg.vocab_size * cfg.hidden_size
    assert gpu.decode_weight_bytes(model) == 2 * (cfg.num_params - (0 if tied else table))
    q8 = LlamaForCausalLM(cfg).to(torch.bfloat16)
    linears = replace_linears(q8)
    # int8: 1 byte per linear weight + a bf16 scale per output row; the norms stay bf16; the table never read
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    per_layer = h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * h * i
    rows = cfg.num_layers * ((cfg.num_heads + 2 * cfg.num_kv_heads) * d + h + 2 * i + h) + cfg.vocab_size
    norms = (2 * cfg.num_layers + 1) * h
    assert linears == 4 * cfg.num_layers + 1
    assert gpu.decode_weight_bytes(q8) == cfg.num_layers * per_layer + table + 2 * rows + 2 * norms


def test_the_result_line_calibrates_the_simulator_on_a_gpu(tmp_path):
    """The calibration keys computed from the run's figures (the simulator's roofline: every parameter at 2 bytes
    per decode step, 2 FLOPs per prefill token), read back by `pdfleet simulate --calibration`; none from a smoke."""
    from pdfleet_operator.sim import calibration
    from tests.sim.support import small

    cfg = _toy_config(False)
    speed = types.SimpleNamespace(cfg=cfg, weight_bytes={"bf16": 1000})
    args = types.SimpleNamespace(cpu_smoke=False, peak_hbm_tbps=4.8, peak_tflops=989.0, class_name="h200-141gb")
    result = {"bs1_ms_per_token": 2e-5, "bs1_bytes_per_step": 1000 + 96, "prefill_tokens_per_s": 1e10}
    line = gpu.calibration(types.SimpleNamespace(a=args, speed=speed), result)
    assert line["decode_mbu"] == round((2 * cfg.num_params + 96) / 2e-8 / 4.8e12, 4) == 0.4577
    assert line["prefill_mfu"] == round(2 * cfg.num_params * 1e10 / 989e12, 4) == 0.4433
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({**result, **line}) + "\n")
    eff = calibration.load([path], small().classes)[("pdfleet", "h200-141gb")]
    assert (eff.decode_mbu, eff.prefill_mfu, eff.step_overhead_s) == (line["decode_mbu"], line["prefill_mfu"], 0.0)
    args.cpu_smoke = True
    assert gpu.calibration(types.SimpleNamespace(a=args, speed=speed), result) == {}


def test_unknown_sections_are_refused():
    with pytest.raises(SystemExit):
        gpu.parse_args(["--only", "bs1,warp"])
    assert gpu.parse_args(["--cpu-smoke", "--only", "bs1"]).sizes == gpu.SMOKE


@pytest.mark.slow
def test_cpu_smoke_runs_every_section_and_compares_real_tokens(tmp_path):
    """The whole script at toy sizes on CPU (~15 s of CPU time): every section runs without an error, the
    interface keys are set, and tokens_match comes from compared tokens of both models in both dtypes on the
    paged backend. Times nothing: the speed figures are only checked to be positive."""
    if (
        importlib.util.find_spec("triton") is None
        and not (REPO / "build" / "triton" / "triton" / "__init__.py").is_file()
    ):
        missing("triton")
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu.py"), "--cpu-smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == json.loads(out.read_text())
    assert result["errors"] == {} and result["smoke"] is True and "kind" not in result
    assert all(result[k] is not None for k in gpu.REQUIRED), {k: result[k] for k in gpu.REQUIRED}
    assert result["tokens_match"] is True
    configs = result["correctness"]
    assert set(configs) == {f"{m}/{d}/graphs-off" for m in ("llama", "qwen2") for d in ("float32", "bfloat16")}
    assert all(c["compared"] > 0 and c["backend"] == "paged" and c["mismatches"] == 0 for c in configs.values())
    assert result["tokens_compared"] == sum(c["compared"] for c in configs.values())
    paths = result["speed_model"]["engine_paths"]
    assert {p["backend"] for p in paths.values()} == {"paged"}
    for key in (
        "bs1_ms_per_token",
        "bs1_hbm_fraction",
        "b64_tokens_per_s",
        "prefill_tokens_per_s",
        "int8_bs1_vs_bf16",
        "b64_tokens_per_s_no_graphs",
        "hf_b64_tokens_per_s",
        "hf_prefill_tokens_per_s",
        "int8_b64_vs_bf16",
    ):
        assert result[key] > 0, key
