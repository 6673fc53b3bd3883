"""Engine throughput and latency against transformers on the same random weights (issue 3); run by hand or CI.

python bench/engine.py [--quick] [--model DIR] [--threads 2] [--reps 3]
Prints a table, then one JSON line with the ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "pdfleet-bench-small"),
                   help="model directory; created with `pdfleet model init --preset small` if missing")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--requests", type=int, default=32, help="mixed workload size")
    p.add_argument("--seq-requests", type=int, default=8,
                   help="how many of the mixed requests the one-at-a-time HF baseline runs (a rate, so a prefix of the same draw)")
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--bs1-tokens", type=int, default=128)
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--budget", type=int, default=512, help="engine max_num_batched_tokens")
    p.add_argument("--quick", action="store_true", help="a smoke run: 8 requests, lengths U[16, 64], 1 rep")
    a = p.parse_args()
    if a.quick:
        a.reps, a.requests, a.seq_requests, a.max_len, a.bs1_tokens, a.prefix = 1, 8, 2, 64, 32, 256
    return a


def median_of(reps: int, fn):
    results = [fn(i) for i in range(reps)]
    return statistics.median(results), results


def read_bandwidth_gbs(reps: int) -> float:
    """Streaming read of 1 GiB with the configured threads (what a decode step must do with weights)."""
    x = torch.ones(256 * 1024 * 1024, dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(max(reps, 3)):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / min(times) / 1e9


def weight_bytes_per_token(model_dir: str, dtype_bytes: int) -> int:
    """Bytes of weights one decode step reads: everything but the input embedding table (one row
    of it is read), unless it is tied to the LM head."""
    from pdfleet_worker.config import ModelConfig
    cfg = ModelConfig.from_dir(model_dir)
    n = cfg.num_params
    if not cfg.tie_word_embeddings:
        n -= cfg.vocab_size * cfg.hidden_size
    return n * dtype_bytes


def mixed_workload(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(8, vocab) for _ in range(rng.randint(lo, hi))], rng.randint(lo, hi)) for _ in range(n)]


# -- the engine ---------------------------------------------------------------------------------
def engine_mixed(engine, work) -> float:
    from pdfleet_worker.engine.sampling_params import SamplingParams
    t = time.perf_counter()
    for i, (prompt, n) in enumerate(work):
        engine.add_request(f"m{i}-{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    produced = 0
    while engine.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    wall = time.perf_counter() - t
    assert produced == sum(n for _, n in work), "every requested token is produced"
    return produced / wall


def engine_decode_s_per_token(engine, prompt: list[int], n: int) -> float:
    from pdfleet_worker.engine.sampling_params import SamplingParams
    engine.add_request(f"d{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=n + 1, temperature=0, ignore_eos=True))
    stamps = []
    while engine.has_unfinished_requests():
        if engine.step():
            stamps.append(time.perf_counter())
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def engine_ttft(engine, prompt: list[int]) -> float:
    from pdfleet_worker.engine.sampling_params import SamplingParams
    t = time.perf_counter()
    engine.add_request(f"p{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    ttft = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.new_token_ids and ttft is None:
                ttft = time.perf_counter() - t
    return ttft


# -- transformers -------------------------------------------------------------------------------
def hf_generate(hf, prompts: list[list[int]], max_new: int) -> None:
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as batched generation requires
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                          do_sample=False, pad_token_id=0)
    assert out.shape[1] == width + max_new


def hf_static(hf, work, batch: int) -> float:
    """Static padded batches in arrival order; each runs to its longest request. Only the tokens
    each request asked for count."""
    t = time.perf_counter()
    for i in range(0, len(work), batch):
        group = work[i:i + batch]
        hf_generate(hf, [p for p, _ in group], max(n for _, n in group))
    return sum(n for _, n in work) / (time.perf_counter() - t)


def hf_decode_s_per_token(hf, prompt: list[int], n: int) -> float:
    t = time.perf_counter()
    hf_generate(hf, [prompt], 1)
    t1 = time.perf_counter()
    hf_generate(hf, [prompt], n + 1)
    t2 = time.perf_counter()
    return ((t2 - t1) - (t1 - t)) / n


def main() -> int:
    a = parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM

    from pdfleet_worker import model_init
    from pdfleet_worker.config import EngineConfig, ModelConfig
    from pdfleet_worker.engine.llm_engine import LLMEngine

    if not os.path.isfile(os.path.join(a.model, "model.safetensors")):
        print(f"creating {a.model} (pdfleet model init --preset small)", file=sys.stderr)
        model_init.init_model(a.model, "small", seed=0)
    cfg = ModelConfig.from_dir(a.model)
    work = mixed_workload(a.requests, a.min_len, a.max_len, cfg.vocab_size)
    rng = random.Random(1)
    bs1_prompt = [rng.randrange(8, cfg.vocab_size) for _ in range(32)]
    rows: list[tuple[str, str, str]] = []

    def engine(dtype: str) -> LLMEngine:
        return LLMEngine(EngineConfig(model=a.model, dtype=dtype, max_num_seqs=max(64, a.requests),
                                      max_num_batched_tokens=a.budget, kv_cache_memory_bytes=2 << 30,
                                      num_threads=a.threads), load_tokenizer=False)

    bw = read_bandwidth_gbs(a.reps)
    rows.append(("memory read bandwidth", f"{bw:.1f} GB/s", f"{a.threads} threads, 1 GiB sum"))

    eng = engine("float32")
    engine_mixed(eng, work[:4])  # warm-up
    eng_tps, eng_all = median_of(a.reps, lambda i: engine_mixed(eng, work))
    rows.append(("engine mixed", f"{eng_tps:.1f} tok/s", f"{a.requests} requests, reps {[round(x, 1) for x in eng_all]}"))
    eng_dec, _ = median_of(a.reps, lambda i: engine_decode_s_per_token(eng, bs1_prompt, a.bs1_tokens))
    rows.append(("engine bs1 decode fp32", f"{eng_dec * 1e3:.2f} ms/token", f"linear backend {eng.model_runner.linear_backend}"))

    def prefix_pair(i: int) -> float:
        r = random.Random(100 + i)
        prefix = [r.randrange(8, cfg.vocab_size) for _ in range(a.prefix)]
        first = engine_ttft(eng, prefix + [r.randrange(8, cfg.vocab_size) for _ in range(16)])
        second = engine_ttft(eng, prefix + [r.randrange(8, cfg.vocab_size) for _ in range(16)])
        return second / first
    prefix_ratio, prefix_all = median_of(a.reps, prefix_pair)
    rows.append(("prefix TTFT second/first", f"{prefix_ratio:.3f}", f"{a.prefix}-token shared prefix, reps {[round(x, 3) for x in prefix_all]}"))
    assert eng.is_idle_and_whole()
    del eng

    eng16 = engine("bfloat16")
    engine_decode_s_per_token(eng16, bs1_prompt, 8)
    bf16_dec, _ = median_of(a.reps, lambda i: engine_decode_s_per_token(eng16, bs1_prompt, a.bs1_tokens))
    rows.append(("engine bs1 decode bf16", f"{bf16_dec * 1e3:.2f} ms/token", ""))
    del eng16

    hf = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    hf_generate(hf, [work[0][0]], 2)  # warm-up
    hf_dec, _ = median_of(a.reps, lambda i: hf_decode_s_per_token(hf, bs1_prompt, a.bs1_tokens))
    rows.append(("HF bs1 decode fp32", f"{hf_dec * 1e3:.2f} ms/token", ""))
    hf8, hf8_all = median_of(a.reps, lambda i: hf_static(hf, work, 8))
    rows.append(("HF static batches of 8", f"{hf8:.1f} tok/s", f"reps {[round(x, 1) for x in hf8_all]}"))
    seq_work = work[:a.seq_requests]
    hf1, hf1_all = median_of(a.reps, lambda i: hf_static(hf, seq_work, 1))
    rows.append(("HF one at a time", f"{hf1:.1f} tok/s", f"first {len(seq_work)} requests, reps {[round(x, 1) for x in hf1_all]}"))

    floor = weight_bytes_per_token(a.model, 4) / (bw * 1e9)
    rows.append(("bandwidth floor fp32", f"{floor * 1e3:.2f} ms/token", f"{weight_bytes_per_token(a.model, 4) / 1e6:.0f} MB read per token"))
    result = {
        "mixed_vs_hf_static8": round(eng_tps / hf8, 3),
        "mixed_vs_hf_sequential": round(eng_tps / hf1, 3),
        "bs1_vs_hf": round(hf_dec / eng_dec, 3),
        "bs1_mbu": round(floor / eng_dec, 3),
        "prefix_ttft_ratio": round(prefix_ratio, 3),
        "bf16_vs_fp32": round(eng_dec / bf16_dec, 3),
        "model": os.path.basename(os.path.normpath(a.model)),
        "model_params": cfg.num_params,
        "threads": a.threads,
        "requests": a.requests,
        "sequential_requests": len(seq_work),
        "reps": a.reps,
        "engine_tok_s": round(eng_tps, 1),
        "hf_static8_tok_s": round(hf8, 1),
        "hf_sequential_tok_s": round(hf1, 1),
        "read_gbs": round(bw, 1),
    }
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>16}  {note}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
