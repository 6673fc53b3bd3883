"""The CUDA path's Triton paged-decode kernel, run on CPU tensors by Triton's interpreter (TRITON_INTERPRET=1, in a
subprocess): against gather + SDPA, and the engine on the paged backend against transformers.

Triton comes with torch's CUDA wheels; beside the CPU torch it is unpacked into build/triton (`make triton`,
which `make test` runs) and put on the subprocess's path only, so nothing else in .venv sees it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.components import missing
from tests.worker.oracle import compare, random_prompts

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[3]
UNPACKED = REPO / "build" / "triton"


def _interpreted(code: str) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PDFLEET_CPU_BIND": "off"}
    if importlib.util.find_spec("triton") is None:
        if not (UNPACKED / "triton" / "__init__.py").is_file():
            missing("triton")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(UNPACKED), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600, cwd=REPO, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_paged_decode_kernel_matches_gather_and_sdpa():
    out = _interpreted("""
        import json, torch
        import torch.nn.functional as F
        from pdfleet_worker.layers import triton_attention
        from pdfleet_worker.layers.attention import KVCache, gather_kv
        torch.manual_seed(0)
        worst = {}
        for hq, hkv, d, bs in [(12, 4, 64, 16), (4, 1, 32, 4), (8, 8, 16, 8)]:
            nb, w = 30, 6
            kv = torch.randn(2, hkv, nb, bs, d)
            lens = torch.tensor([1, bs, bs + 1, w * bs, 3])
            tables = torch.stack([torch.randperm(nb)[:w] for _ in lens])
            q = torch.randn(len(lens), hq + 2 * hkv, d)[:, :hq]  # strided, as in the model
            out = torch.empty(len(lens), hq, d)
            triton_attention.paged_decode(out, q, kv, tables, lens, d ** -0.5)
            k, v = gather_kv(KVCache(kv), tables, torch.float32)
            mask = (torch.arange(k.shape[2])[None] < lens[:, None])[None, :, None, :]
            qd = q.reshape(len(lens), hkv, hq // hkv, d).transpose(0, 1)
            ref = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask).transpose(0, 1).reshape(len(lens), hq, d)
            worst[f"{hq}/{hkv}/{d}/{bs}"] = float((out - ref).abs().max())
        print(json.dumps(worst))
    """)
    assert all(err < 2e-6 for err in out.values()), out


def test_engine_on_the_paged_backend_matches_transformers(llama):
    """The CUDA path's attention (Triton decodes, SDPA prefills, block tables as device tensors),
    with the engine's scheduler, chunked prefill and scattered blocks; here on CPU, interpreted."""
    prompts = random_prompts(4, 1, 20, seed=51)
    out = _interpreted(f"""
        import json
        from pdfleet_worker.config import EngineConfig
        from pdfleet_worker.engine.llm_engine import LLMEngine
        from pdfleet_worker.sampling_params import SamplingParams
        eng = LLMEngine(EngineConfig(model={llama.path!r}, block_size=4, num_kv_blocks=64, max_num_batched_tokens=8))
        eng.model_runner.backend, eng.model_runner.decode_kernel = "paged", False
        rows = {{}}
        eng.model_runner.logits_hook = lambda ids, logits: [rows.setdefault(r, []).append(logits[i].tolist())
                                                            for i, r in enumerate(ids)]
        outs = eng.generate({prompts!r}, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        ids = [o.request_id for o in outs]
        print(json.dumps({{"tokens": [o.new_token_ids for o in outs], "logits": [rows[r] for r in ids]}}))
    """)
    import torch

    logits = [[torch.tensor(row) for row in rows] for rows in out["logits"]]
    assert compare(llama, prompts, out["tokens"], logits, max_new=6).near_ties <= 1
