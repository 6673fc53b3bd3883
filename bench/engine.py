"""Engine throughput and latency against transformers on the same random weights (issue 3); run by hand or CI.

python bench/engine.py [--quick] [--model DIR] [--threads 2] [--reps 3] [--tiny-model DIR] [--tiny-threads 1]
Prints a table, then one JSON line with the ratios. The last rows time a lone decode of the tiny preset (what each
`make demo` worker runs) with the linear kernels the start-up probe picks against plain F.linear, the two
engines stepped in turn (issue 28). `--prefill-only` runs just the prefill-attention rows: the TTFT of a lone
fresh prompt (--prefill-tokens) with cpu_kernels' prefill attention against SDPA, fp32 and bf16, the two engines
in turn; they are part of the full run too. `--decode-attention-only` runs just the paged decode kernel's rows:
the small preset's batch-32 decode step (contexts U[64, 768], blocks in order as fresh requests get them) read
through cpu_kernels' paged_decode_attention, against a plain read of as many bytes with the same threads,
alternating; they are part of the full run too.
"""

from __future__ import annotations

import _sys_path  # noqa: F401  -- first: keeps bench/operator.py from shadowing the stdlib (see it)

# isort: split
import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import time

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "pdfleet-bench-small"),
        help="model directory; created with `pdfleet model init --preset small` if missing",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--requests", type=int, default=32, help="mixed workload size")
    p.add_argument(
        "--seq-requests",
        type=int,
        default=8,
        help="how many of the mixed requests the one-at-a-time HF baseline runs (a rate, so a prefix of the same draw)",
    )
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--bs1-tokens", type=int, default=128)
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--budget", type=int, default=512, help="engine max_num_batched_tokens")
    p.add_argument(
        "--tiny-model",
        default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "pdfleet-bench-tiny"),
        help="tiny-preset model directory for the batch-1 kernel rows; created if missing",
    )
    p.add_argument(
        "--tiny-threads", type=int, default=1, help="torch threads of the tiny rows (pdfleet up's per worker)"
    )
    p.add_argument("--tiny-tokens", type=int, default=256, help="decode tokens timed per tiny repetition")
    p.add_argument("--quick", action="store_true", help="a smoke run: 8 requests, lengths U[16, 64], 1 rep")
    p.add_argument(
        "--sampler-only",
        action="store_true",
        help="only the batch-64 sampler rows: the batched sampler against --sampler-baseline's, alternating",
    )
    p.add_argument("--sampler-baseline", default=SAMPLER_BASELINE_REV, help="git revision of the baseline sampler")
    p.add_argument("--sampler-tokens", type=int, default=32, help="decode tokens per batch-64 measurement")
    p.add_argument(
        "--prefill-only",
        action="store_true",
        help="only the prefill-attention rows: TTFT with the C++ prefill kernel against SDPA, alternating",
    )
    p.add_argument("--prefill-tokens", type=int, default=512, help="prompt length of the prefill-attention rows")
    p.add_argument(
        "--decode-attention-only",
        action="store_true",
        help="only the paged-decode rows: the kernel's KV read rate against a plain read of as many bytes",
    )
    a = p.parse_args()
    if a.quick:
        a.reps, a.requests, a.seq_requests, a.max_len, a.bs1_tokens, a.prefix = 1, 8, 2, 64, 32, 256
        a.tiny_tokens = 64
    return a


_BW_BUFFER: list = []


def read_bandwidth_gbs() -> float:
    """Streaming read of 1 GiB with the configured threads (what a decode step does with weights);
    the median of three passes."""
    if not _BW_BUFFER:
        _BW_BUFFER.append(torch.ones(256 * 1024 * 1024, dtype=torch.float32))
    x = _BW_BUFFER[0]
    times = []
    for _ in range(3):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(times) / 1e9


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
    from pdfleet_worker.sampling_params import SamplingParams

    t = time.perf_counter()
    for i, (prompt, n) in enumerate(work):
        engine.add_request(
            f"m{i}-{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        )
    produced = 0
    while engine.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    wall = time.perf_counter() - t
    assert produced == sum(n for _, n in work), "every requested token is produced"
    return produced / wall


def engine_decode_s_per_token(engine, prompt: list[int], n: int) -> float:
    from pdfleet_worker.sampling_params import SamplingParams

    engine.add_request(
        f"d{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=n + 1, temperature=0, ignore_eos=True)
    )
    stamps = []
    while engine.has_unfinished_requests():
        if engine.step():
            stamps.append(time.perf_counter())
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def engine_ttft(engine, prompt: list[int]) -> float:
    from pdfleet_worker.sampling_params import SamplingParams

    t = time.perf_counter()
    engine.add_request(f"p{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    ttft = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.new_token_ids and ttft is None:
                ttft = time.perf_counter() - t
    return ttft


def paired_decode_steps(engines: dict, prompt: list[int], n: int) -> dict[str, float]:
    """One lone request per engine, decoded step by step in turn (A, B, A, B, ...), so both see the
    machine's load of the same moments; the median step time of each (seconds per token)."""
    from pdfleet_worker.sampling_params import SamplingParams

    for name, eng in engines.items():
        eng.add_request(
            f"{name}-{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=n + 1, temperature=0, ignore_eos=True)
        )
        eng.step()  # the prefill
    times: dict[str, list[float]] = {name: [] for name in engines}
    while any(e.has_unfinished_requests() for e in engines.values()):
        for name, eng in engines.items():
            if eng.has_unfinished_requests():
                t = time.perf_counter()
                eng.step()
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


@contextlib.contextmanager
def env_restored(name: str):
    """Leave $name as it was found, whatever the body sets it to."""
    saved = os.environ.get(name)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def tiny_kernel_rows(a: argparse.Namespace, prompt_len: int = 32) -> dict:
    """Seconds per token of a lone decode of the tiny preset, per dtype, with the probed linear kernels
    ("auto") and with plain F.linear everywhere ("plain"), the two stepped in turn in every repetition."""
    from pdfleet_worker.config import EngineConfig
    from pdfleet_worker.engine.llm_engine import LLMEngine
    from pdfleet_worker.layers import packed_linear
    from pdfleet_worker.model import model_init

    if not os.path.isfile(os.path.join(a.tiny_model, "model.safetensors")):
        print(f"creating {a.tiny_model} (pdfleet model init --preset tiny)", file=sys.stderr)
        model_init.init_model(a.tiny_model, "tiny", seed=0)
    saved_threads = torch.get_num_threads()
    prompt = [random.Random(2).randrange(8, 1000) for _ in range(prompt_len)]
    out: dict = {}
    with env_restored(packed_linear.ENV):
        try:
            for dtype in ("float32", "bfloat16"):
                engines = {}
                for name, setting in (("auto", "auto"), ("plain", "torch")):
                    os.environ[packed_linear.ENV] = setting
                    engines[name] = LLMEngine(
                        EngineConfig(
                            model=a.tiny_model,
                            dtype=dtype,
                            max_num_seqs=32,
                            max_num_batched_tokens=512,
                            kv_cache_memory_bytes=64 << 20,
                            num_threads=a.tiny_threads,
                        ),
                        load_tokenizer=False,
                    )
                paired_decode_steps(engines, prompt, 8)  # warm-up
                out[f"{dtype}_backend"] = engines["auto"].model_runner.linear_choice.describe()
                for rep in range(max(a.reps, 5)):
                    order = dict(sorted(engines.items(), reverse=rep % 2 == 1))  # who steps first alternates
                    for name, s_per_token in paired_decode_steps(order, prompt, a.tiny_tokens).items():
                        out.setdefault(f"{dtype}_{name}", []).append(s_per_token)
        finally:
            torch.set_num_threads(saved_threads)
    return out


def prefill_attention_rows(a: argparse.Namespace) -> dict:
    """TTFT of a lone fresh prompt per dtype with prefill chunks through cpu_kernels' prefill_attention
    ("kernel") and through SDPA ("sdpa"), the two engines taking turns in every repetition."""
    from pdfleet_worker.config import EngineConfig
    from pdfleet_worker.engine.llm_engine import LLMEngine
    from pdfleet_worker.layers import attention

    rng = random.Random(3)
    out: dict = {}
    with env_restored(attention.PREFILL_ENV):
        for dtype in ("float32", "bfloat16"):
            engines = {}
            for name in attention.PREFILL_KERNELS:
                os.environ[attention.PREFILL_ENV] = name
                engines[name] = LLMEngine(
                    EngineConfig(
                        model=a.model,
                        dtype=dtype,
                        max_num_seqs=64,
                        max_num_batched_tokens=max(a.budget, a.prefill_tokens),
                        kv_cache_memory_bytes=512 << 20,
                        num_threads=a.threads,
                    ),
                    load_tokenizer=False,
                )
            vocab = engines["sdpa"].model_config.vocab_size

            def prompt() -> list[int]:  # fresh every time: no prefix-cache hit
                return [rng.randrange(8, vocab) for _ in range(a.prefill_tokens)]

            for eng in engines.values():  # warm-up
                engine_ttft(eng, prompt())
            for rep in range(max(a.reps, 5)):
                for name in sorted(engines, reverse=rep % 2 == 1):  # who goes first alternates
                    out.setdefault(f"{dtype}_{name}", []).append(engine_ttft(engines[name], prompt()))
            out[f"{dtype}_probe"] = attention.choose_prefill(
                *(getattr(engines["sdpa"].model_config, k) for k in ("num_heads", "num_kv_heads", "head_dim")),
                engines["sdpa"].model_runner.dtype,
                setting="auto",
            ).describe()
    return out


def prefill_rows_and_keys(a: argparse.Namespace, pf: dict) -> tuple[list[tuple[str, str, str]], dict]:
    rows, keys = [], {}
    for dtype, suffix in (("float32", ""), ("bfloat16", "_bf16")):
        k, s = pf[f"{dtype}_kernel"], pf[f"{dtype}_sdpa"]
        r = [x / y for x, y in zip(k, s)]
        med = statistics.median
        rows += [
            (
                f"TTFT {a.prefill_tokens} tokens {dtype}, prefill kernel",
                f"{med(k) * 1e3:.1f} ms",
                "[" + ", ".join(f"{x * 1e3:.1f}" for x in k) + "]",
            ),
            (
                f"TTFT {a.prefill_tokens} tokens {dtype}, SDPA",
                f"{med(s) * 1e3:.1f} ms",
                "[" + ", ".join(f"{x * 1e3:.1f}" for x in s) + "]",
            ),
            (
                f"ratio prefill kernel / SDPA {dtype}",
                f"{med(r):.3f}",
                f"min {min(r):.3f} max {max(r):.3f}; {pf[dtype + '_probe']}",
            ),
        ]
        keys[f"prefill_ttft_kernel_vs_sdpa{suffix}"] = round(med(r), 3)
        keys[f"prefill_ttft_kernel_vs_sdpa{suffix}_range"] = [round(min(r), 3), round(max(r), 3)]
    return rows, keys


def decode_attention_rows(a: argparse.Namespace) -> tuple[list[tuple[str, str, str]], dict]:
    """The paged decode kernel's KV read rate (bytes of K and V over the kernel's time) against torch's sum over a
    contiguous fp32 buffer of the same size, fp32 and bf16 pools, all four taking turns in every repetition: the
    small preset's heads (12 query, 4 KV, head_dim 64), 32 sequences, contexts U[64, 768], 16-token blocks. A bf16
    pool is half the bytes, so its figure against the read is low by nature; its row to watch is bf16 / fp32."""
    from pdfleet_worker.layers import cpu_kernels

    if not cpu_kernels.load():
        raise SystemExit("cpu_kernels did not build here: no paged decode kernel to time")
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, D, BS = 32, 12, 4, 64, 16
    lens = torch.randint(64, 769, (B,), generator=g)
    W = int((lens.max() + BS - 1) // BS)
    tables = torch.arange(B * W).reshape(B, W)  # in order, as fresh requests get their blocks
    cases = {}
    for dtype in (torch.float32, torch.bfloat16):
        kv = torch.randn(2, Hkv, B * W, BS, D, generator=g).to(dtype)
        q = torch.randn(B, Hq, D, generator=g).to(dtype)
        nbytes = int(lens.sum()) * Hkv * D * kv.element_size() * 2
        plain = torch.ones(nbytes // 4, dtype=torch.float32)
        name = str(dtype).removeprefix("torch.")
        op = torch.ops.pdfleet.paged_decode_attention
        cases[f"kernel {name}"] = (
            nbytes,
            lambda q=q, kv=kv: op(torch.empty_like(q), q, kv, None, tables, lens, D**-0.5),
        )
        cases[f"read {name}"] = (nbytes, plain.sum)

    def rate(name: str, n: int = 20) -> float:
        nbytes, fn = cases[name]
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return nbytes * n / (time.perf_counter() - t) / 1e9

    for name in cases:  # warm-up
        rate(name, 3)
    gbs: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(max(a.reps, 5)):
        for name in cases if rep % 2 == 0 else reversed(list(cases)):
            gbs[name].append(rate(name))
    med = statistics.median

    def fmt(xs: list[float], digits: int = 1) -> str:
        return "[" + ", ".join(f"{x:.{digits}f}" for x in xs) + "]"

    rows, keys = [], {}
    for name, suffix in (("float32", ""), ("bfloat16", "_bf16")):
        k, r = gbs[f"kernel {name}"], gbs[f"read {name}"]
        ratio = [x / y for x, y in zip(k, r)]
        target = "target >= 0.8" if name == "float32" else "no target (half the bytes)"
        rows += [
            (
                f"paged decode attention {name}",
                f"{med(k):.1f} GB/s",
                f"{cases['kernel ' + name][0] / 1e6:.0f} MB {fmt(k)}",
            ),
            (f"plain read, same bytes ({name})", f"{med(r):.1f} GB/s", fmt(r)),
            (f"ratio decode attention / read {name}", f"{med(ratio):.2f}", f"{target} {fmt(ratio, 2)}"),
        ]
        keys[f"decode_attention_gbs{suffix}"] = round(med(k), 2)
        keys[f"decode_attention_vs_read{suffix}"] = round(med(ratio), 3)
        keys[f"decode_attention_vs_read{suffix}_range"] = [round(min(ratio), 3), round(max(ratio), 3)]
    # the same step's time, fp32 over bf16: how much a bf16 pool speeds the kernel up
    speed = [
        (cases["kernel float32"][0] / x) / (cases["kernel bfloat16"][0] / y)
        for x, y in zip(gbs["kernel float32"], gbs["kernel bfloat16"])
    ]
    rows.append(("ratio decode attention bf16 / fp32 speed", f"{med(speed):.2f}", f"target >= 1.0 {fmt(speed, 2)}"))
    keys["decode_attention_bf16_vs_fp32"] = round(med(speed), 3)
    return rows, keys


def decode_attention_main(a: argparse.Namespace) -> int:
    torch.set_num_threads(a.threads)
    rows, keys = decode_attention_rows(a)
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>10}  {note}")
    print(json.dumps({**keys, "threads": a.threads, "reps": max(a.reps, 5)}))
    return 0


def prefill_main(a: argparse.Namespace) -> int:
    from pdfleet_worker.model import model_init

    torch.set_num_threads(a.threads)
    if not os.path.isfile(os.path.join(a.model, "model.safetensors")):
        print(f"creating {a.model} (pdfleet model init --preset small)", file=sys.stderr)
        model_init.init_model(a.model, "small", seed=0)
    rows, keys = prefill_rows_and_keys(a, prefill_attention_rows(a))
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>10}  {note}")
    model = os.path.basename(os.path.normpath(a.model))
    reps = max(a.reps, 5)
    print(json.dumps({**keys, "model": model, "threads": a.threads, "reps": reps, "tokens": a.prefill_tokens}))
    return 0


# -- transformers -------------------------------------------------------------------------------
def hf_generate(hf, prompts: list[list[int]], max_new: int) -> None:
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as batched generation requires
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.inference_mode():
        out = hf.generate(
            ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, pad_token_id=0
        )
    assert out.shape[1] == width + max_new


def hf_static(hf, work, batch: int) -> float:
    """Static padded batches in arrival order; each runs to its longest request. Only the tokens
    each request asked for count."""
    t = time.perf_counter()
    for i in range(0, len(work), batch):
        group = work[i : i + batch]
        hf_generate(hf, [p for p, _ in group], max(n for _, n in group))
    return sum(n for _, n in work) / (time.perf_counter() - t)


def hf_decode_s_per_token(hf, prompt: list[int], n: int) -> float:
    t = time.perf_counter()
    hf_generate(hf, [prompt], 1)
    t1 = time.perf_counter()
    hf_generate(hf, [prompt], n + 1)
    t2 = time.perf_counter()
    return ((t2 - t1) - (t1 - t)) / n


# -- the sampler at batch 64 (issue 27) -------------------------------------------------------------
SAMPLER_BASELINE_REV = "1aa3279^"  # the per-row sampler, before issue 27's batched one


def baseline_sampler(rev: str):
    """The Sampler of git revision `rev`, wrapped to what the engine now calls (add, prompts, steps); None
    without git or the revision."""
    import importlib.util
    import subprocess
    import tempfile

    # NOTE: the sampler lived in engine/ until issue 25 moved it to layers/, and SamplingParams to the package
    # root: an older revision's file is found at its old path and its import pointed at the new one.
    for path in ("layers/sampler.py", "engine/sampler.py"):
        shown = subprocess.run(
            [
                "git",
                "-C",
                os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                "show",
                f"{rev}:workers/pdfleet_worker/{path}",
            ],
            capture_output=True,
            text=True,
        )
        if shown.returncode == 0:
            break
    if shown.returncode != 0:
        print(f"no baseline sampler ({rev}): {shown.stderr.strip()}", file=sys.stderr)
        return None
    with tempfile.NamedTemporaryFile("w", suffix="_sampler_baseline.py", delete=False) as f:
        f.write(shown.stdout.replace("pdfleet_worker.engine.sampling_params", "pdfleet_worker.sampling_params"))
    spec = importlib.util.spec_from_file_location("sampler_baseline", f.name)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    os.unlink(f.name)

    class Baseline(mod.Sampler):
        def __init__(self):
            super().__init__()
            self.prompts, self.eos_token_ids = {}, ()

        def add(self, *args, **kwargs) -> None:
            pass

        def __call__(self, logits, request_ids, params, steps=None):
            return super().__call__(logits, request_ids, params)

    return Baseline


def batch_decode_tok_s(engine, prompts: list[list[int]], n: int, params) -> float:
    """Decode tokens per second of len(prompts) requests decoding together (their prefill not counted)."""
    import dataclasses as dc

    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}-{time.monotonic_ns()}", p, dc.replace(params, max_tokens=n + 1, ignore_eos=True))
    started: set[str] = set()
    while len(started) < len(prompts):
        started |= {o.request_id for o in engine.step() if o.new_token_ids}
    t, produced = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return produced / (time.perf_counter() - t)


def sampler_rows(a: argparse.Namespace) -> tuple[list[tuple[str, str, str]], dict]:
    """Batch-64 decode throughput and the sampler's own time on [64, V] logits, the batched sampler against the one
    before it (SAMPLER_BASELINE_REV), alternating per repetition on one engine; ratio > 1: the new one is faster."""
    from pdfleet_worker.config import EngineConfig
    from pdfleet_worker.engine.llm_engine import LLMEngine
    from pdfleet_worker.layers.sampler import Sampler
    from pdfleet_worker.sampling_params import SamplingParams

    Baseline = baseline_sampler(a.sampler_baseline)
    if Baseline is None:
        return [], {}
    batch = 64
    eng = LLMEngine(
        EngineConfig(
            model=a.model,
            max_num_seqs=batch,
            max_num_batched_tokens=max(a.budget, batch * 16),
            kv_cache_memory_bytes=1 << 30,
            num_threads=a.threads,
        ),
        load_tokenizer=False,
    )
    vocab = eng.model_config.vocab_size
    rng = random.Random(7)
    prompts = [[rng.randrange(8, vocab) for _ in range(16)] for _ in range(batch)]
    kinds = {
        "greedy": SamplingParams(temperature=0),
        "sampled": SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
        "seeded": SamplingParams(temperature=0.8, top_p=0.95, seed=1),
    }
    impls = {"new": Sampler(), "old": Baseline()}

    def use(name: str) -> None:
        eng.model_runner.sampler = eng.sampler = impls[name]

    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0))
    ids = [f"s{i}" for i in range(batch)]
    m = {(k, i, w): [] for k in kinds for i in impls for w in ("engine", "sampler")}
    reps = max(a.reps, 5)
    batch_decode_tok_s(eng, prompts[:4], 2, kinds["greedy"])  # warm-up
    for rep in range(reps):
        print(
            f"[{time.strftime('%H:%M:%S')}] batch-{batch} sampler, repetition {rep + 1}/{reps}",
            file=sys.stderr,
            flush=True,
        )
        for kind, params in kinds.items():
            for name in ("new", "old") if rep % 2 == 0 else ("old", "new"):
                use(name)
                m[(kind, name, "engine")].append(batch_decode_tok_s(eng, prompts, a.sampler_tokens, params))
                steps = [0] * batch
                t = time.perf_counter()
                for k in range(20):
                    impls[name](logits, ids, [params] * batch, steps)
                m[(kind, name, "sampler")].append((time.perf_counter() - t) / 20)
    use("new")
    assert eng.is_idle_and_whole()
    rows, result = [], {}
    for kind in kinds:
        eng_r = [n / o for n, o in zip(m[(kind, "new", "engine")], m[(kind, "old", "engine")])]
        smp_r = [o / n for n, o in zip(m[(kind, "new", "sampler")], m[(kind, "old", "sampler")])]
        new_tok = statistics.median(m[(kind, "new", "engine")])
        old_tok = statistics.median(m[(kind, "old", "engine")])
        rows.append(
            (
                f"batch-{batch} decode, {kind}: new / old sampler",
                f"{statistics.median(eng_r):.3f}",
                f"{new_tok:.0f} vs {old_tok:.0f} tok/s, target >= 0.98 [{', '.join(f'{r:.3f}' for r in eng_r)}]",
            )
        )
        rows.append(
            (
                f"sampler alone [{batch}, {vocab}], {kind}: old / new time",
                f"{statistics.median(smp_r):.2f}",
                f"{statistics.median(m[(kind, 'new', 'sampler')]) * 1e3:.2f} vs "
                f"{statistics.median(m[(kind, 'old', 'sampler')]) * 1e3:.2f} ms "
                f"[{', '.join(f'{r:.2f}' for r in smp_r)}]",
            )
        )
        result[f"batch{batch}_{kind}_new_vs_old_sampler"] = round(statistics.median(eng_r), 3)
        result[f"batch{batch}_{kind}_new_vs_old_sampler_spread"] = [round(min(eng_r), 3), round(max(eng_r), 3)]
        result[f"sampler_{kind}_speedup"] = round(statistics.median(smp_r), 2)
    return rows, result


def sampler_main(a: argparse.Namespace) -> int:
    rows, result = sampler_rows(a)
    if not rows:
        return 1
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>8}  {note}")
    print(
        json.dumps(
            {
                **result,
                "model": os.path.basename(os.path.normpath(a.model)),
                "threads": a.threads,
                "reps": max(a.reps, 5),
                "decode_tokens": a.sampler_tokens,
                "baseline": a.sampler_baseline,
            }
        )
    )
    return 0


def main() -> int:
    a = parse_args()
    if a.sampler_only:
        return sampler_main(a)
    if a.prefill_only:
        return prefill_main(a)
    if a.decode_attention_only:
        return decode_attention_main(a)
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM

    from pdfleet_worker.config import EngineConfig, ModelConfig
    from pdfleet_worker.engine.llm_engine import LLMEngine
    from pdfleet_worker.model import model_init

    if not os.path.isfile(os.path.join(a.model, "model.safetensors")):
        print(f"creating {a.model} (pdfleet model init --preset small)", file=sys.stderr)
        model_init.init_model(a.model, "small", seed=0)
    cfg = ModelConfig.from_dir(a.model)
    work = mixed_workload(a.requests, a.min_len, a.max_len, cfg.vocab_size)
    seq_work = work[: a.seq_requests]
    rng = random.Random(1)
    bs1_prompt = [rng.randrange(8, cfg.vocab_size) for _ in range(32)]
    weight_bytes = weight_bytes_per_token(a.model, 4)

    def engine(dtype: str, kv_bytes: int) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model=a.model,
                dtype=dtype,
                max_num_seqs=max(64, a.requests),
                max_num_batched_tokens=a.budget,
                kv_cache_memory_bytes=kv_bytes,
                num_threads=a.threads,
            ),
            load_tokenizer=False,
        )

    eng, eng16 = engine("float32", 2 << 30), engine("bfloat16", 1 << 30)
    hf = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    engine_mixed(eng, work[:4])  # warm-ups
    engine_decode_s_per_token(eng16, bs1_prompt, 8)
    hf_generate(hf, [work[0][0]], 2)

    # NOTE: the machine is shared, so every repetition measures the engine and its baseline back
    # to back and the ratio is taken per repetition; the reported ratio is the median of those.
    m = {k: [] for k in ("eng", "hf8", "hf1", "bw", "dec32", "dec16", "hfdec", "prefix")}

    def progress(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    for rep in range(a.reps):
        progress(f"mixed workload, repetition {rep + 1}/{a.reps}")
        m["eng"].append(engine_mixed(eng, work))
        m["hf8"].append(hf_static(hf, work, 8))
        m["hf1"].append(hf_static(hf, seq_work, 1))
    for rep in range(max(a.reps, 5)):  # short runs: a few more repetitions
        progress(f"batch-1 decode, repetition {rep + 1}/{max(a.reps, 5)}")
        m["bw"].append(read_bandwidth_gbs())
        m["dec32"].append(engine_decode_s_per_token(eng, bs1_prompt, a.bs1_tokens))
        m["dec16"].append(engine_decode_s_per_token(eng16, bs1_prompt, a.bs1_tokens))
        m["hfdec"].append(hf_decode_s_per_token(hf, bs1_prompt, a.bs1_tokens))
    for rep in range(a.reps):
        r = random.Random(100 + rep)
        prefix = [r.randrange(8, cfg.vocab_size) for _ in range(a.prefix)]
        first = engine_ttft(eng, prefix + [r.randrange(8, cfg.vocab_size) for _ in range(16)])
        second = engine_ttft(eng, prefix + [r.randrange(8, cfg.vocab_size) for _ in range(16)])
        m["prefix"].append((first, second))
    assert eng.is_idle_and_whole() and eng16.is_idle_and_whole()
    progress(f"tiny preset, lone decode: probed linear kernels vs plain F.linear, {max(a.reps, 5)} repetitions")
    tiny = tiny_kernel_rows(a)
    progress(f"prefill attention: C++ kernel vs SDPA, TTFT of {a.prefill_tokens} tokens, {max(a.reps, 5)} repetitions")
    pf_rows, pf_keys = prefill_rows_and_keys(a, prefill_attention_rows(a))
    progress(f"paged decode attention: KV read rate vs a plain read, {max(a.reps, 5)} repetitions")
    da_rows, da_keys = decode_attention_rows(a)

    def med(xs):
        return statistics.median(xs)

    def ratios(num, den):
        return [x / y for x, y in zip(num, den)]

    floors = [weight_bytes / (bw * 1e9) for bw in m["bw"]]
    r_static8 = ratios(m["eng"], m["hf8"])
    r_seq = ratios(m["eng"], m["hf1"])
    r_bs1 = ratios(m["hfdec"], m["dec32"])
    r_mbu = ratios(floors, m["dec32"])
    r_bf16 = ratios(m["dec32"], m["dec16"])
    r_prefix = [second / first for first, second in m["prefix"]]
    r_tiny = ratios(tiny["float32_auto"], tiny["float32_plain"])
    r_tiny16 = ratios(tiny["bfloat16_auto"], tiny["bfloat16_plain"])

    def fmt(xs, scale=1.0, digits=1):
        return "[" + ", ".join(f"{x * scale:.{digits}f}" for x in xs) + "]"

    rows = [
        (
            "engine mixed (fp32)",
            f"{med(m['eng']):.1f} tok/s",
            f"{a.requests} requests, U[{a.min_len},{a.max_len}] {fmt(m['eng'])}",
        ),
        ("HF generate, static batches of 8", f"{med(m['hf8']):.1f} tok/s", fmt(m["hf8"])),
        ("HF generate, one at a time", f"{med(m['hf1']):.1f} tok/s", f"first {len(seq_work)} requests {fmt(m['hf1'])}"),
        (
            "engine bs1 decode fp32",
            f"{med(m['dec32']) * 1e3:.2f} ms/tok",
            f"linear backend {eng.model_runner.linear_backend} {fmt(m['dec32'], 1e3, 2)}",
        ),
        ("engine bs1 decode bf16", f"{med(m['dec16']) * 1e3:.2f} ms/tok", fmt(m["dec16"], 1e3, 2)),
        ("HF bs1 decode fp32", f"{med(m['hfdec']) * 1e3:.2f} ms/tok", fmt(m["hfdec"], 1e3, 2)),
        ("memory read bandwidth", f"{med(m['bw']):.1f} GB/s", f"{a.threads} threads, 1 GiB sum {fmt(m['bw'])}"),
        (
            "bandwidth floor fp32",
            f"{med(floors) * 1e3:.2f} ms/tok",
            f"{weight_bytes / 1e6:.0f} MB of weights read per token",
        ),
        (
            "TTFT first / second (shared prefix)",
            f"{med([f for f, _ in m['prefix']]) * 1e3:.0f} / {med([s for _, s in m['prefix']]) * 1e3:.0f} ms",
            f"{a.prefix}-token block-aligned prefix + 16 tokens",
        ),
        ("ratio mixed / HF static 8", f"{med(r_static8):.2f}", f"target >= 2   {fmt(r_static8, 1, 2)}"),
        ("ratio mixed / HF one at a time", f"{med(r_seq):.2f}", f"target >= 6   {fmt(r_seq, 1, 2)}"),
        ("ratio bs1 engine / HF", f"{med(r_bs1):.2f}", f"target >= 0.95 {fmt(r_bs1, 1, 2)}"),
        ("bs1 MBU (floor / engine)", f"{med(r_mbu):.2f}", f"target >= 0.70 {fmt(r_mbu, 1, 2)}"),
        ("prefix TTFT second / first", f"{med(r_prefix):.3f}", f"target <= 0.25 {fmt(r_prefix, 1, 3)}"),
        ("bf16 / fp32 bs1 decode speed", f"{med(r_bf16):.2f}", f"target >= 1.5 {fmt(r_bf16, 1, 2)}"),
        (
            f"tiny bs1 decode fp32, {a.tiny_threads} thread",
            f"{med(tiny['float32_auto']) * 1e3:.2f} ms/tok",
            f"probed kernels {fmt(tiny['float32_auto'], 1e3, 2)}",
        ),
        (
            "tiny bs1 decode fp32, plain F.linear",
            f"{med(tiny['float32_plain']) * 1e3:.2f} ms/tok",
            fmt(tiny["float32_plain"], 1e3, 2),
        ),
        (
            f"tiny bs1 decode bf16, {a.tiny_threads} thread",
            f"{med(tiny['bfloat16_auto']) * 1e3:.2f} ms/tok",
            f"probed kernels {fmt(tiny['bfloat16_auto'], 1e3, 2)}",
        ),
        (
            "tiny bs1 decode bf16, plain F.linear",
            f"{med(tiny['bfloat16_plain']) * 1e3:.2f} ms/tok",
            fmt(tiny["bfloat16_plain"], 1e3, 2),
        ),
        ("ratio tiny bs1 probed / plain fp32", f"{med(r_tiny):.2f}", f"target <= 1.05 {fmt(r_tiny, 1, 2)}"),
        ("ratio tiny bs1 probed / plain bf16", f"{med(r_tiny16):.2f}", f"target <= 1.05 {fmt(r_tiny16, 1, 2)}"),
        *pf_rows,
        *da_rows,
    ]
    result = {
        "mixed_vs_hf_static8": round(med(r_static8), 3),
        "mixed_vs_hf_sequential": round(med(r_seq), 3),
        "bs1_vs_hf": round(med(r_bs1), 3),
        "bs1_mbu": round(med(r_mbu), 3),
        "prefix_ttft_ratio": round(med(r_prefix), 3),
        "bf16_vs_fp32": round(med(r_bf16), 3),
        "model": os.path.basename(os.path.normpath(a.model)),
        "model_params": cfg.num_params,
        "threads": a.threads,
        "requests": a.requests,
        "sequential_requests": len(seq_work),
        "reps": a.reps,
        "engine_tok_s": round(med(m["eng"]), 1),
        "hf_static8_tok_s": round(med(m["hf8"]), 1),
        "hf_sequential_tok_s": round(med(m["hf1"]), 1),
        "read_gbs": round(med(m["bw"]), 1),
        "tiny_bs1_ms_per_token": round(med(tiny["float32_auto"]) * 1e3, 3),
        "tiny_bs1_plain_linear_ms_per_token": round(med(tiny["float32_plain"]) * 1e3, 3),
        "tiny_bs1_vs_plain_linear": round(med(r_tiny), 3),
        "tiny_bs1_ms_per_token_bf16": round(med(tiny["bfloat16_auto"]) * 1e3, 3),
        "tiny_bs1_vs_plain_linear_bf16": round(med(r_tiny16), 3),
        "tiny_threads": a.tiny_threads,
        **pf_keys,
        **da_keys,
    }
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>16}  {note}")
    for dtype in ("float32", "bfloat16"):
        print(f"tiny {dtype}: {tiny[dtype + '_backend']}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
