"""Tiered KV offload and swap preemption (issue 21): TTFT of a prefix reloaded from host RAM / disk against a cold
prefill, and tokens/s of a workload that forces preemption under recompute and swap. Ratios inside one run.

python bench/levers_offload.py [--model DIR] [--reps 3] [--prefix 2048] [--quick] [--threads N]

`run(model_dir, args)` is what bench/levers.py calls (args: an argparse.Namespace; optional attributes read with
getattr: quick, reps, prefix, threads). Alone it prints a table on stderr and one JSON line on stdout.

Offload: each repetition takes a fresh 2,048-token prefix P and 16-token suffixes. cold: P+S1 on an engine
that has never seen P (TTFT = the whole prefill). Then requests of fresh tokens fill the whole device pool,
so every block of P is evicted into the offload tier; then P+S2: TTFT = copying P's blocks back plus the
suffix's prefill. The host figure runs an engine with only a host tier, the disk figure one with only a
disk tier (a memory-mapped file in $TMPDIR); before the disk request the mapping's pages are pushed out
of RAM (madvise MADV_PAGEOUT), so the loads read the file (`disk_page_cache` says whether that worked;
without it the figure is the page cache's). `device` is the same request with P still in the device pool.

Preemption: 12 requests (384-token prompts, 96 greedy tokens) on a pool that admits a third of the prompts,
whose growth then preempts; under preemption recompute and swap (ample swap space), with the prefix cache
on (the default) and off; tokens/s of the whole run, the preemption counts, the prompt tokens computed, and
whether every run produced the same tokens (they must: greedy and exact).
"""

from __future__ import annotations

try:
    import _sys_path  # noqa: F401,I001  -- first: keeps bench/operator.py from shadowing the stdlib
except ModuleNotFoundError:  # imported by bench/levers.py with bench/ already off sys.path
    pass

import argparse
import ctypes
import json
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TMP = os.environ.get("TMPDIR", "/tmp")
MADV_PAGEOUT = 21
SUFFIX = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model",
        default=os.path.join(TMP, "pdfleet-bench-small"),
        help="HF model directory; created with `pdfleet model init --preset small` (600 MB fp32) if missing",
    )
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prefix", type=int, default=None, help="tokens of the reused prefix (default 2048; --quick 256)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="small sizes (tests; the numbers mean little)")
    return p.parse_args(argv)


def progress(msg: str) -> None:
    print(f"[levers_offload {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _engine(model_dir: str, **kw):
    from pdfleet_worker.config import EngineConfig
    from pdfleet_worker.engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=model_dir, **kw), load_tokenizer=False)
    eng.warm_up()
    return eng


def _ttft(eng, prompt: list[int]) -> float:
    from pdfleet_worker.sampling_params import SamplingParams

    t0 = time.perf_counter()
    eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    return time.perf_counter() - t0


def _fill(eng, vocab: int, tokens: int, rng: random.Random) -> None:
    """Fresh requests that together take every block of the pool (max_tokens 1), evicting whatever is cached."""
    from pdfleet_worker.sampling_params import SamplingParams

    per = min(tokens, eng.max_model_len - 2)
    n = -(-tokens // per)
    eng.generate(
        [[rng.randrange(8, vocab) for _ in range(per)] for _ in range(n)],
        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
    )


def page_out(eng) -> bool:
    """Drop the disk tier's pages from RAM (written back first), so the next loads read the file."""
    raw = getattr(eng.model_runner, "disk_mapping", None)
    if raw is None:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(raw.data_ptr(), raw.numel(), MADV_PAGEOUT) == 0


def offload_ttft(model_dir: str, vocab: int, prefix_len: int, reps: int, threads: int | None) -> dict:
    bs = 16
    prefix_blocks = -(-prefix_len // bs)
    pool = prefix_blocks + prefix_blocks // 4 + 8  # room for P+S, not for P and the fill too
    common = dict(
        block_size=bs,
        num_kv_blocks=pool,
        max_num_batched_tokens=2048,
        max_num_seqs=8,
        max_model_len=max(prefix_len + 2 * SUFFIX + 8, 256),
        num_threads=threads,
    )
    import torch

    from pdfleet_worker.config import ModelConfig
    from pdfleet_worker.engine.model_runner import kv_bytes_per_block

    per_block = kv_bytes_per_block(ModelConfig.from_dir(model_dir), bs, "auto", torch.float32)
    tier_bytes = 2 * pool * per_block
    out = {"block_bytes": per_block, "prefix_bytes": prefix_blocks * per_block}
    for tier in ("host", "disk"):
        kw = (
            {"kv_offload_host_bytes": tier_bytes}
            if tier == "host"
            else {"kv_offload_disk_bytes": tier_bytes, "kv_offload_disk_dir": TMP}
        )
        progress(f"{tier}: engine with a {tier_bytes / 2**20:.0f} MiB {tier} tier, pool {pool} blocks")
        eng = _engine(model_dir, **common, **kw)
        cold, warm, device, paged = [], [], [], []
        for rep in range(reps):
            rng = random.Random(1000 * rep + (tier == "disk"))
            prefix = [rng.randrange(8, vocab) for _ in range(prefix_len)]
            sfx = [[rng.randrange(8, vocab) for _ in range(SUFFIX)] for _ in range(3)]
            cold.append(_ttft(eng, prefix + sfx[0]))
            device.append(_ttft(eng, prefix + sfx[1]))  # the prefix still in the device pool
            before = eng.stats().kv_offload[tier]
            _fill(eng, vocab, pool * bs, rng)
            if tier == "disk":
                paged.append(page_out(eng))
            warm.append(_ttft(eng, prefix + sfx[2]))
            after = eng.stats().kv_offload[tier]
            hits = after.hits - before.hits
            assert hits >= prefix_blocks - 1, f"{tier}: only {hits} of {prefix_blocks} prefix blocks came back"
            progress(
                f"{tier} rep {rep}: cold {cold[-1] * 1e3:.0f} ms, device hit {device[-1] * 1e3:.0f} ms, "
                f"{tier} hit {warm[-1] * 1e3:.0f} ms ({hits} blocks loaded)"
            )
        cost = eng.block_manager.offload.cost
        out[tier] = {
            "cold_ttft_s": statistics.median(cold),
            "hit_ttft_s": statistics.median(warm),
            "device_hit_ttft_s": statistics.median(device),
            "ratio": statistics.median(w / c for w, c in zip(warm, cold)),
            "device_ratio": statistics.median(d / c for d, c in zip(device, cold)),
            "measured_bytes_per_s": cost.bandwidth(tier),
            "measured_prefill_s_per_token": cost.prefill_s_per_token,
        }
        if tier == "disk":
            out["disk_page_cache"] = "paged out" if all(paged) else "warm (MADV_PAGEOUT refused)"
        del eng
    return out


def preemption(model_dir: str, vocab: int, quick: bool, threads: int | None) -> dict:
    """The same preempting workload under recompute and swap, with the prefix cache on (the default: a recomputed
    victim finds what is left of its own freed blocks) and off (every preemption recomputes its whole context)."""
    from pdfleet_worker.sampling_params import SamplingParams

    n, prompt_len, out_len = (6, 64, 24) if quick else (12, 384, 96)
    bs = 16
    blocks = -(-prompt_len // bs)
    pool = blocks * (n // 3) + 4  # admits n/3 prompts; their growth then preempts
    rng = random.Random(7)
    prompts = [[rng.randrange(8, vocab) for _ in range(prompt_len)] for _ in range(n)]
    params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
    res = {"requests": n, "prompt_tokens": prompt_len, "output_tokens": out_len, "pool_blocks": pool}
    tokens = {}
    per_seq = -(-(prompt_len + out_len) // bs)
    for caching in (True, False):
        key = "prefix_cache_on" if caching else "prefix_cache_off"
        res[key] = {}
        order = ("recompute", "swap") if caching else ("swap", "recompute")  # alternate which runs first
        for policy in order:
            eng = _engine(
                model_dir,
                block_size=bs,
                num_kv_blocks=pool,
                max_num_seqs=n,
                max_num_batched_tokens=2048,
                enable_prefix_caching=caching,
                preemption=policy,
                swap_space_bytes=2 * n * per_seq * eng_block_bytes(model_dir, bs),
                num_threads=threads,
            )
            t0 = time.perf_counter()
            outs = eng.generate(prompts, params)
            wall = time.perf_counter() - t0
            s = eng.stats()
            tokens[(key, policy)] = [o.new_token_ids for o in outs]
            res[key][policy] = {
                "tokens_per_s": n * out_len / wall,
                "wall_s": wall,
                "preemptions": s.num_preemptions_total,
                "swapped": s.swap.swapped_out,
                "swap_fallbacks": s.swap.fallbacks,
                "prompt_tokens_computed": s.prompt_tokens_total,
            }
            progress(
                f"preemption {policy} ({key}): {n * out_len / wall:.1f} tok/s, {s.num_preemptions_total} "
                f"preemptions, {s.prompt_tokens_total} prompt tokens computed"
            )
            del eng
        res[key]["swap_vs_recompute"] = res[key]["swap"]["tokens_per_s"] / res[key]["recompute"]["tokens_per_s"]
    res["swap_vs_recompute_tokens_per_s"] = res["prefix_cache_on"]["swap_vs_recompute"]
    res["swap_vs_recompute_no_prefix_cache"] = res["prefix_cache_off"]["swap_vs_recompute"]
    res["outputs_equal"] = len({tuple(map(tuple, t)) for t in tokens.values()}) == 1
    return res


def eng_block_bytes(model_dir: str, bs: int) -> int:
    import torch

    from pdfleet_worker.config import ModelConfig
    from pdfleet_worker.engine.model_runner import kv_bytes_per_block

    return kv_bytes_per_block(ModelConfig.from_dir(model_dir), bs, "auto", torch.float32)


def run(model_dir: str, args: argparse.Namespace) -> dict:
    """The figures bench/levers.py merges into its JSON line (offload_host_ttft_ratio, offload_disk_ttft_ratio,
    swap_vs_recompute_tokens_per_s, ...) plus the detail under `offload` and `preemption`."""
    import torch

    from pdfleet_worker.config import ModelConfig

    quick = getattr(args, "quick", False)
    reps = getattr(args, "reps", 3) or 3
    prefix = getattr(args, "prefix", None) or (256 if quick else 2048)
    threads = getattr(args, "threads", None)
    if threads:
        torch.set_num_threads(threads)
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        from pdfleet_worker.model import model_init

        progress(f"creating {model_dir} (pdfleet model init --preset small)")
        model_init.init_model(model_dir, "small", seed=0)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    began = time.perf_counter()
    off = offload_ttft(model_dir, vocab, prefix, 1 if quick else reps, threads)
    pre = preemption(model_dir, vocab, quick, threads)
    return {
        "offload_host_ttft_ratio": round(off["host"]["ratio"], 4),
        "offload_disk_ttft_ratio": round(off["disk"]["ratio"], 4),
        "offload_device_hit_ttft_ratio": round(off["host"]["device_ratio"], 4),
        "offload_disk_page_cache": off["disk_page_cache"],
        "offload_prefix_tokens": prefix,
        "swap_vs_recompute_tokens_per_s": round(pre["swap_vs_recompute_tokens_per_s"], 4),
        "swap_vs_recompute_no_prefix_cache": round(pre["swap_vs_recompute_no_prefix_cache"], 4),
        "preemption_recompute_tokens_per_s": round(pre["prefix_cache_on"]["recompute"]["tokens_per_s"], 2),
        "preemption_swap_tokens_per_s": round(pre["prefix_cache_on"]["swap"]["tokens_per_s"], 2),
        "preemption_outputs_equal": pre["outputs_equal"],
        "offload": off,
        "preemption": pre,
        "offload_bench_s": round(time.perf_counter() - began, 1),
    }


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.quick and a.model == parse_args([]).model:
        a.model = os.path.join(os.path.dirname(HERE), "models", "tiny")
    out = run(a.model, a)
    off, pre = out["offload"], out["preemption"]
    for tier in ("host", "disk"):
        t = off[tier]
        print(
            f"{tier:5} prefix {out['offload_prefix_tokens']} tokens ({off['prefix_bytes'] / 2**20:.0f} MiB): "
            f"cold {t['cold_ttft_s'] * 1e3:.0f} ms, {tier} hit {t['hit_ttft_s'] * 1e3:.0f} ms "
            f"(x{t['ratio']:.3f}), device hit {t['device_hit_ttft_s'] * 1e3:.0f} ms (x{t['device_ratio']:.3f})",
            file=sys.stderr,
        )
    for key in ("prefix_cache_on", "prefix_cache_off"):
        r, w = pre[key]["recompute"], pre[key]["swap"]
        print(
            f"preemption ({key}): recompute {r['tokens_per_s']:.1f} tok/s ({r['preemptions']} preemptions, "
            f"{r['prompt_tokens_computed']} prompt tokens computed), swap {w['tokens_per_s']:.1f} tok/s "
            f"({w['swapped']} swapped, {w['swap_fallbacks']} fallbacks, {w['prompt_tokens_computed']} prompt tokens): "
            f"x{pre[key]['swap_vs_recompute']:.3f}",
            file=sys.stderr,
        )
    print(f"outputs equal under every policy: {pre['outputs_equal']}", file=sys.stderr)
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
