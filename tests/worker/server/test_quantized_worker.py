"""A real `pdfleet worker` given `quantization: int8` in its engine config file (what pods and `pdfleet up` write)
serves the int8 engine: the same greedy tokens as an in-process int8 engine, and not the float engine's."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.worker.processes import MODEL, start_all, worker

torch = pytest.importorskip("torch")


def _engine_tokens(model_dir: str, prompt: list[int], n: int, quantization: str) -> list[int]:
    from pdfleet_worker.config import EngineConfig
    from pdfleet_worker.engine.llm_engine import LLMEngine
    from pdfleet_worker.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(model=model_dir, quantization=quantization, num_kv_blocks=256), load_tokenizer=False)
    eng.add_request("r", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    out: list[int] = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            out += o.new_token_ids
    return out


def test_an_int8_worker_serves_the_int8_engines_tokens(logdir, model_dir, tmp_path):
    cfg = tmp_path / "engine.json"
    cfg.write_text(json.dumps({"quantization": "int8", "dtype": "float32"}))
    w = worker(logdir, model_dir, "both", "--engine-config", str(cfg), name="int8-worker")
    start_all(w)
    try:
        # a prompt whose greedy tokens tell the int8 engine from the float one, so the check is not vacuous
        prompt = next(
            (
                p
                for p in (list(range(s, s + 32)) for s in range(20, 620, 60))
                if _engine_tokens(model_dir, p, 24, "int8") != _engine_tokens(model_dir, p, 24, "none")
            ),
            None,
        )
        assert prompt is not None, "no prompt of ten tells int8 from fp32 apart"
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        r = httpx.post(f"{w.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        got = choice.get("token_ids")
        want = _engine_tokens(model_dir, prompt, 24, "int8")
        if got is None:  # the text is what those tokens decode to
            from pdfleet_worker.model.tokenizer import Tokenizer

            assert choice["text"] == Tokenizer(model_dir).decode(want)
        else:
            assert got == want
    finally:
        w.stop()
