"""Scoring prompts through the router (issue 27): a model trained by `pdfleet model init --train-minutes` behind a
router and a prefill/decode pair; its held-out perplexity, computed from echoed prompt logprobs, equals the figure
training recorded offline; lm-evaluation-harness scores a local loglikelihood task against the router
(bench/lm_eval_router.py) and its loglikelihoods equal the sums transformers gives on the same weights."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.support.components import missing
from tests.worker.processes import CHILD_ENV, MODEL, PDFLEET, router, start_all, worker

REPO = Path(__file__).resolve().parents[3]
LMEVAL_PYTHON = REPO / ".venv-lmeval" / "bin" / "python"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("trained") / MODEL
    # NOTE: a short run is enough: the figure to match is whatever the training measured at its end.
    subprocess.run(
        PDFLEET + ["model", "init", str(path), "--preset", "tiny", "--train-minutes", "0.5", "--train-steps", "30"],
        check=True,
        capture_output=True,
        env=dict(os.environ, **CHILD_ENV),
        timeout=600,
    )
    return str(path)


@pytest.fixture(scope="module")
def served(trained, logdir):
    p = worker(logdir, trained, "prefill", name="scoring-prefill")
    d = worker(logdir, trained, "decode", "--kv-peers", "127.0.0.1", name="scoring-decode")
    start_all(p, d)
    r = router(logdir, "--prefill", p.url, "--decode", d.url, name="scoring-router")
    try:
        start_all(r)
        yield r
    finally:
        for proc in (r, p, d):
            proc.stop()


def test_held_out_perplexity_through_the_router_equals_the_offline_figure(trained, served):
    from pdfleet_worker.model import model_train

    with open(os.path.join(trained, "tokenizer_config.json")) as f:
        record = json.load(f)["pdfleet_init"]["trained"]
    _, held = model_train.corpus_tokens(trained, 12_000_000)
    windows = model_train.held_out_batches(held, record["seq_len"], 32).tolist()
    nll, count = 0.0, 0
    with openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=300) as c:
        for start in range(0, len(windows), 8):
            batch = windows[start : start + 8]
            answer = c.completions.create(model=MODEL, prompt=batch, echo=True, logprobs=0, max_tokens=0)
            for choice, window in zip(sorted(answer.choices, key=lambda ch: ch.index), batch):
                scored = choice.logprobs.token_logprobs
                assert scored[0] is None and len(scored) == len(window)
                nll -= sum(scored[1:])
                count += len(window) - 1
    ppl = math.exp(nll / count)
    assert ppl == pytest.approx(record["held_out_ppl"], rel=1e-4), (ppl, record)
    assert ppl < 0.9 * 4096, "the trained model beats a uniform guess over the vocabulary"


def test_lm_eval_scores_a_local_task_against_the_router(trained, served):
    if not os.access(LMEVAL_PYTHON, os.X_OK):
        missing(
            f"lm-evaluation-harness's virtualenv {LMEVAL_PYTHON.parent.parent} (`python3 bench/lm_eval_router.py "
            f"--install`)"
        )
    run = subprocess.run(
        [
            str(LMEVAL_PYTHON),
            str(REPO / "bench" / "lm_eval_router.py"),
            "--url",
            served.url,
            "--model",
            MODEL,
            "--tokenizer",
            trained,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(report["samples"]) == 20
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(trained)
    hf = transformers.AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32).eval()
    docs = [json.loads(line) for line in (REPO / "bench" / "lm_eval_task" / "pdfleet_python_mc.jsonl").open()]
    correct = 0
    for sample in report["samples"]:
        doc = docs[sample["doc_id"]]
        want = []
        for choice in doc["choices"]:
            # lm_eval's own split: trailing blanks of the context go to the continuation; the whole is encoded
            # and the context's tokens cut off its front
            context = doc["context"].rstrip()
            whole = tok.encode(context + doc["context"][len(context) :] + choice, add_special_tokens=False)
            ctx = tok.encode(context, add_special_tokens=False)
            cont = whole[len(ctx) :]
            ids = torch.tensor([ctx + cont])
            with torch.no_grad():
                logp = torch.log_softmax(hf(ids).logits[0].float(), -1)
            want.append(sum(float(logp[len(ctx) - 1 + k, t]) for k, t in enumerate(cont)))
        assert sample["loglikelihoods"] == pytest.approx(want, abs=2e-3), (sample, want)
        correct += max(range(len(want)), key=want.__getitem__) == doc["answer"]
    assert report["acc"] == pytest.approx(correct / len(report["samples"]))
    print(f"lm_eval acc {report['acc']:.2f} on {len(report['samples'])} documents", file=sys.stderr)
