"""`pdfleet model init --train-steps`: a trained checkpoint that loads like any other, a held-out perplexity that
falls, and the scoring forward (model_train.forward_logits) equal to the engine's own logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from pdfleet_worker.model import model_train  # noqa: E402
from pdfleet_worker.model.loader import load_model  # noqa: E402
from tests.worker.oracle import run_and_capture  # noqa: E402


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("trained") / "tiny"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdfleet_operator.cli",
            "model",
            "init",
            str(d),
            "--preset",
            "tiny",
            "--train-steps",
            "4",
            "--train-batch",
            "4",
            "--train-seq-len",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:] + result.stdout[-2000:]
    return str(d), result.stdout


def test_training_is_reported_and_recorded_and_lowers_held_out_perplexity(trained):
    d, out = trained
    assert "step 1:" in out and "step 4:" in out and "held-out perplexity" in out
    with open(os.path.join(d, "tokenizer_config.json")) as f:
        record = json.load(f)["pdfleet_init"]["trained"]
    assert record["steps"] == 4 and record["tokens"] == 4 * 4 * 64 and record["held_out_every"] == 10
    before = float(out.split("held-out perplexity ")[-1].split(" -> ")[0])
    assert record["held_out_ppl"] < before
    # bf16 autocast only where bf16 matmuls are native (an AVX2-only CPU runs them ~30x slower than fp32), and the
    # run says which
    assert record["autocast"] == ("bfloat16" if model_train.fast_bf16() else "off")
    assert ("autocast to bf16" if model_train.fast_bf16() else "training in fp32: this CPU has no fast bf16") in out


def test_the_scoring_forward_is_the_engines_network(trained, make_engine):
    d, _ = trained
    prompt = list(range(5, 45))
    eng = make_engine(d, max_num_batched_tokens=64)
    from pdfleet_worker.sampling_params import SamplingParams

    _, rows, _ = run_and_capture(eng, [prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    model = load_model(d)
    with torch.inference_mode():
        logits = model_train.forward_logits(model, torch.tensor([prompt]))[0, -1]
    assert float((logits - rows[0][0]).abs().max()) < 1e-3 * float(logits.abs().max())


def test_int8_perplexity_of_the_trained_model_is_close_to_fp32(trained):
    d, _ = trained
    _, held = model_train.corpus_tokens(d, 1_000_000)
    windows = model_train.held_out_batches(held, 64, 4)
    fp = model_train.perplexity(load_model(d), windows)
    q8 = model_train.perplexity(load_model(d, quantization="int8"), windows)
    assert q8 != fp and abs(q8 / fp - 1) < 0.05


def test_training_needs_a_bound(trained):
    with pytest.raises(ValueError, match="minutes or steps"):
        model_train.train(trained[0])
