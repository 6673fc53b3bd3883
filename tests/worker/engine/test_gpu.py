"""The CUDA paths (FlexAttention compiled; Triton paged decode with CUDA graphs) against transformers on the GPU.
Opt-in: needs a CUDA GPU."""

from __future__ import annotations

import pytest
import torch

from tests.worker.oracle import MAX_NEW, compare, random_prompts, run_and_capture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("budget", [4, 64])
def test_cuda_flex_matches_transformers(tiny, make_engine, budget):
    """Same oracle as on CPU (the oracle itself runs on CPU in fp32). Never run on the machines
    this was written on: they have no GPU."""
    prompts = random_prompts(5, 1, 40, seed=21)
    # NOTE: flex is asked for: auto picks the paged backend where triton is installed.
    eng = make_engine(tiny.path, device="cuda", max_num_batched_tokens=budget, block_size=16, attention_backend="flex")
    assert eng.model_runner.backend == "flex" and eng.model_runner.linear_backend == "torch"
    tokens, logits, _ = run_and_capture(eng, prompts)
    logits = [[row.cpu() for row in rows] for rows in logits]
    assert compare(tiny, prompts, tokens, logits, MAX_NEW).near_ties <= 1


@pytest.mark.parametrize("graphs", ["1", "0"])
def test_cuda_paged_backend_matches_transformers(tiny, make_engine, monkeypatch, graphs):
    """auto on CUDA with triton: the paged backend (Triton decode kernel over device block tables);
    warm_up captures the decode CUDA graphs, and replayed steps stay exact. Written without a GPU:
    the kernel's math is checked on CPU by Triton's interpreter (test_triton_attention.py)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("PDFLEET_CUDA_GRAPHS", graphs)
    prompts = random_prompts(5, 1, 40, seed=22)
    eng = make_engine(tiny.path, device="cuda", max_num_batched_tokens=16, block_size=16, max_num_seqs=8)
    assert eng.model_runner.backend == "paged"
    eng.warm_up()
    assert (eng.model_runner.graphs is not None) == (graphs == "1")
    tokens, logits, _ = run_and_capture(eng, prompts)
    logits = [[row.cpu() for row in rows] for rows in logits]
    assert compare(tiny, prompts, tokens, logits, MAX_NEW).near_ties <= 1
