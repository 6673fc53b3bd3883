"""The cost levers of issue 21 in one run: int8 weights (batch-1 decode speed, held-out perplexity) and tiered KV
offload (bench/levers_offload.py); run by hand or CI.

python bench/levers.py [--quick] [--only int8|offload] [--model DIR] [--reps 5] [--threads 2]

int8: four engines on one trained model directory, all in this process: fp32, bf16, and each with
engine.quantization int8 (weights quantized at load from the same checkpoint). Every repetition decodes
one request at batch 1 (32-token prompt, --bs1-tokens tokens; time between the first and the last token)
on each engine in a rotating order, and runs a small mixed batch; a ratio is the median of the
per-repetition ratios. `int8_bs1_vs_fp32` compares the int8 engine with dtype float32 to the fp32
engine, `int8_bs1_vs_bf16` the int8 engine with dtype bfloat16 to the bf16 engine (only the
quantization differs in each pair). Quality: held-out perplexity of the same models on text they were
not trained on (model_train.py: the standard library's sources, every 10th file held out);
`int8_ppl_increase` = ppl(int8, fp32 dtype) / ppl(fp32) - 1. A profile of a few decode steps of each
int8 engine says where its time goes.

The model (default $TMPDIR/pdfleet-levers-small) is created with `pdfleet model init --preset small`
and trained for --train-minutes if it has not been trained yet (the same as
`pdfleet model init DIR --preset small --train-minutes N`; train longer that way for better figures).

offload: bench/levers_offload.py's run(model_dir, args) (another lever, its own doc); missing, the run
stops at once with an error naming it rather than printing numbers it did not measure.

Progress goes to stderr, a table and then one JSON line to stdout.
"""

from __future__ import annotations

import _sys_path  # noqa: F401  -- first: keeps bench/operator.py from shadowing the stdlib (see it)

# isort: split
import argparse
import importlib.util
import json
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TMP = os.environ.get("TMPDIR", "/tmp")
ENGINES = (("float32", "none"), ("bfloat16", "none"), ("float32", "int8"), ("bfloat16", "int8"))
SHORT = {"float32": "fp32", "bfloat16": "bf16"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default=None,
        help="trained HF model directory (default $TMPDIR/pdfleet-levers-small, --quick: "
        "$TMPDIR/pdfleet-levers-tiny); created and trained if missing",
    )
    p.add_argument(
        "--only",
        choices=("int8", "offload", "kernels"),
        default=None,
        help="run one section (default: int8, kernels and offload); kernels: the linears alone per kernel",
    )
    p.add_argument("--threads", type=int, default=2, help="compute threads of every engine")
    p.add_argument("--reps", type=int, default=5, help="repetitions of every speed measurement (medians reported)")
    p.add_argument("--bs1-tokens", type=int, default=64, help="tokens decoded at batch 1 (32-token prompt)")
    p.add_argument(
        "--requests", type=int, default=16, help="mixed batch: requests (prompts U[32, 128], 32 tokens each)"
    )
    p.add_argument("--train-minutes", type=float, default=5.0, help="training of a model that has none yet")
    p.add_argument("--eval-seqs", type=int, default=32, help="held-out windows of 128 tokens scored for perplexity")
    p.add_argument("--prefix", type=int, default=None, help="offload: tokens of the reused prefix (its default)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a check, not a measurement: tiny preset trained 6 steps, 1 repetition, short decodes",
    )
    a = p.parse_args(argv)
    a.preset = "tiny" if a.quick else "small"
    if a.model is None:
        a.model = os.path.join(TMP, f"pdfleet-levers-{a.preset}")
    if a.quick:
        a.reps, a.bs1_tokens, a.requests, a.eval_seqs = 1, 8, 4, 4
    return a


def progress(msg: str) -> None:
    print(f"[levers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load_offload():
    """bench/levers_offload.py's run(), or exit 2 naming what is missing."""
    if not os.path.isfile(os.path.join(HERE, "levers_offload.py")):
        raise SystemExit(
            "bench/levers.py: the offload section needs bench/levers_offload.py (run(model_dir, args) -> "
            "dict with offload_host_ttft_ratio, offload_disk_ttft_ratio), which is missing; "
            "run --only int8 for the int8 figures"
        )
    if HERE not in sys.path:
        sys.path.append(HERE)  # NOTE: appended, so bench/operator.py never shadows the stdlib's operator
    from levers_offload import run as run_offload

    return run_offload


def ensure_model(a: argparse.Namespace) -> dict:
    """Create and train a.model if needed; returns its training record (tokenizer_config.json pdfleet_init.trained)."""
    from pdfleet_worker.model import model_init, model_train

    if not os.path.isfile(os.path.join(a.model, "model.safetensors")):
        progress(f"creating {a.model} (pdfleet model init --preset {a.preset})")
        model_init.init_model(a.model, a.preset, seed=0)
    with open(os.path.join(a.model, "tokenizer_config.json")) as f:
        trained = json.load(f).get("pdfleet_init", {}).get("trained")
    if trained is None:
        how = "6 steps" if a.quick else f"{a.train_minutes:g} minutes"
        progress(f"training {a.model} for {how} (pdfleet model init --train-minutes; progress below)")
        model_train.train(
            a.model,
            steps=6 if a.quick else None,
            minutes=None if a.quick else a.train_minutes,
            batch=4 if a.quick else 8,
            eval_seqs=4 if a.quick else 32,
            max_corpus_bytes=1_000_000 if a.quick else 12_000_000,
            progress=progress,
        )
        with open(os.path.join(a.model, "tokenizer_config.json")) as f:
            trained = json.load(f)["pdfleet_init"]["trained"]
    return trained


def decode_s_per_token(engine, prompt: list[int], n: int) -> tuple[float, float]:
    """(wall, CPU) seconds per token of one request at batch 1, first token to last. CPU: this process's time
    on every core (the compute threads'), the figure that a machine shared with other jobs distorts least."""
    from pdfleet_worker.sampling_params import SamplingParams

    engine.add_request(
        f"d{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=n + 1, temperature=0, ignore_eos=True)
    )
    stamps, cpu = [], []
    while engine.has_unfinished_requests():
        if engine.step():
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1), (cpu[-1] - cpu[0]) / (len(cpu) - 1)


def mixed_tok_s(engine, work) -> float:
    from pdfleet_worker.sampling_params import SamplingParams

    t = time.perf_counter()
    for i, (prompt, n) in enumerate(work):
        engine.add_request(
            f"m{i}-{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        )
    produced = 0
    while engine.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    assert produced == sum(n for _, n in work), "every requested token is produced"
    return produced / (time.perf_counter() - t)


def profile_decode(engine, prompt: list[int], steps: int) -> list[tuple[str, float]]:
    """Self CPU time per operator over `steps` batch-1 decode steps, largest first: (name, share)."""
    from torch.profiler import ProfilerActivity, profile

    from pdfleet_worker.sampling_params import SamplingParams

    engine.add_request(
        f"p{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    )
    engine.step()  # the prefill, outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while engine.has_unfinished_requests():
            engine.step()
    rows = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
    total = sum(t for _, t in rows) or 1.0
    return sorted(((k, t / total) for k, t in rows), key=lambda r: -r[1])


def load_engine_bench():
    """bench/engine.py as a module: its bandwidth reading."""
    spec = importlib.util.spec_from_file_location("pdfleet_bench_engine", os.path.join(HERE, "engine.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_kernels(a: argparse.Namespace, rows: list) -> dict:
    """Where an int8 decode step's time goes: the model's linear layers at batch 1, every layer's own weights
    (out of cache, as in a decode step), through each kernel: fp32 / bf16 oneDNN (the float engines),
    torch's int8 GEMV with bf16 and with fp32 activations, and torch's int4 GEMV (groups of 128), which the
    engine does not offer. Milliseconds per token, median of 7 interleaved passes."""
    import torch

    from pdfleet_worker.config import ModelConfig
    from pdfleet_worker.layers import packed_linear, quantized_linear

    torch.set_num_threads(a.threads)
    ensure_model(a)
    cfg = ModelConfig.from_dir(a.model)
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = [((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h), (h, cfg.num_heads * d), (2 * i, h), (h, i)]
    shapes = shapes * cfg.num_layers + [(cfg.vocab_size, h)]
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g) * 0.02 for n, k in shapes]
    xs = {k: torch.randn(1, k, generator=g) for _, k in shapes}
    qs = [quantized_linear.quantize_rows(w) for w in ws]
    group = 128

    def int4(w):
        n, k = w.shape
        wg = w.view(n, k // group, group)
        lo, hi = wg.amin(-1), wg.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
        zero = lo + scale * 8
        return (
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1),
            torch.stack([scale, zero], -1).transpose(0, 1).contiguous().bfloat16(),
        )

    kernels = {}
    # oneDNN packs bf16 weights only on CPUs with AVX512-BW/VL/DQ or AVX-NE-CONVERT (not an AVX2-only EPYC):
    # the same start-up check as the engine's, and a kernel the CPU lacks is left out, said so
    for name, dtype in (("fp32_onednn", torch.float32), ("bf16_onednn", torch.bfloat16)):
        if packed_linear.onednn_available(dtype):
            kernels[name] = (
                [torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), None) for w in ws],
                lambda p, x, n, dtype=dtype: torch.ops.mkldnn._linear_pointwise(x.to(dtype), p, None, "none", [], ""),
            )
        else:
            progress(f"{name} unavailable: this torch build or CPU has no oneDNN linear in {dtype}")
    kernels |= {
        "int8_bf16_act": (
            [(q, s.bfloat16()) for q, s in qs],
            lambda p, x, n: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), p[0], p[1]),
        ),
        "int8_fp32_act": (qs, lambda p, x, n: torch.ops.aten._weight_int8pack_mm(x, p[0], p[1])),
    }
    try:
        kernels["int4_g128_bf16_act"] = (
            [int4(w) for w in ws],
            lambda p, x, n: torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), p[0], group, p[1]),
        )
    except (RuntimeError, AttributeError) as e:
        progress(f"int4 kernel unavailable: {e}")

    def once(name: str) -> float:
        packed, call = kernels[name]
        t = time.perf_counter()
        for (n, k), p in zip(shapes, packed):
            call(p, xs[k], n)
        return time.perf_counter() - t

    times: dict[str, list[float]] = {name: [] for name in kernels}
    for name in kernels:
        once(name)  # warm-up
    for rep in range(7):  # every kernel once per pass, so a change in the machine's load hits them alike
        for name in kernels:
            times[name].append(once(name))
    out = {name: round(statistics.median(t) * 1e3, 2) for name, t in times.items()}
    progress("linears per token (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in out.items()))
    rows.append(("linears at batch 1 (ms/token)", "", ", ".join(f"{k} {v:.2f}" for k, v in out.items())))
    return {"kernel_ms": out}


def run_int8(a: argparse.Namespace, rows: list) -> dict:
    import torch

    from pdfleet_worker.config import EngineConfig
    from pdfleet_worker.engine.llm_engine import LLMEngine
    from pdfleet_worker.layers import quantized_linear
    from pdfleet_worker.model import model_train

    trained = ensure_model(a)
    torch.set_num_threads(a.threads)
    engines = {}
    for dtype, quant in ENGINES:
        t = time.perf_counter()
        eng = LLMEngine(
            EngineConfig(
                model=a.model,
                dtype=dtype,
                quantization=quant,
                num_threads=a.threads,
                kv_cache_memory_bytes=256 << 20,
                max_model_len=1024,
                max_num_seqs=64,
            ),
            load_tokenizer=False,
        )
        eng.warm_up()
        engines[(dtype, quant)] = eng
        progress(
            f"engine {dtype} {quant}: loaded in {time.perf_counter() - t:.1f} s, weights "
            f"{quantized_linear.weight_bytes(eng.model_runner.model) / 1e6:.0f} MB"
        )
    cfg = engines[ENGINES[0]].model_config
    weights = {k: quantized_linear.weight_bytes(e.model_runner.model) for k, e in engines.items()}
    # bytes one decode step reads: all but the embedding table (one row of it)
    emb = cfg.vocab_size * cfg.hidden_size
    read = {k: w - emb * (4 if k[0] == "float32" else 2) for k, w in weights.items()}
    rng = random.Random(1)
    prompt = [rng.randrange(8, cfg.vocab_size) for _ in range(32)]
    work = [([rng.randrange(8, cfg.vocab_size) for _ in range(rng.randint(32, 128))], 32) for _ in range(a.requests)]
    eb = load_engine_bench()
    dec = {k: [] for k in engines}
    dec_cpu = {k: [] for k in engines}
    mixed = {k: [] for k in engines}
    bw = []
    keys = list(engines)
    for rep in range(a.reps):
        order = keys[rep % len(keys) :] + keys[: rep % len(keys)]
        bw.append(eb.read_bandwidth_gbs())
        for k in order:
            wall, cpu = decode_s_per_token(engines[k], prompt, a.bs1_tokens)
            dec[k].append(wall)
            dec_cpu[k].append(cpu)
        for k in order:
            mixed[k].append(mixed_tok_s(engines[k], work))
        progress(
            f"repetition {rep + 1}/{a.reps}: batch-1 ms/token "
            + ", ".join(f"{SHORT[d]}{'+int8' if q == 'int8' else ''} {dec[(d, q)][-1] * 1e3:.2f}" for d, q in keys)
            + " (CPU ms/token "
            + ", ".join(f"{dec_cpu[k][-1] * 1e3:.2f}" for k in keys)
            + f"); read bandwidth {bw[-1]:.1f} GB/s; load average {os.getloadavg()[0]:.1f}"
        )
    for eng in engines.values():
        assert eng.is_idle_and_whole(), "every engine ends idle with every block free"

    progress("profiling 16 batch-1 decode steps of each engine")
    profiles = {k: profile_decode(engines[k], prompt, 4 if a.quick else 16) for k in keys}

    progress(
        f"held-out perplexity over {a.eval_seqs} windows of 128 tokens (trained {trained.get('steps')} steps, "
        f"{trained.get('tokens')} tokens)"
    )
    _, held = model_train.corpus_tokens(a.model, 1_000_000 if a.quick else 12_000_000)
    windows = model_train.held_out_batches(held, 128, a.eval_seqs)
    ppl = {}
    for k in keys:
        t = time.perf_counter()
        ppl[k] = model_train.perplexity(engines[k].model_runner.model, windows)
        progress(f"perplexity {k[0]} {k[1]}: {ppl[k]:.4f} ({time.perf_counter() - t:.0f} s)")

    med = statistics.median

    def ratio(num, den, times=dec):  # speed of num over den from per-repetition times
        return [d / n for n, d in zip(times[num], times[den])]

    def fmt(xs, scale=1.0, digits=2):
        return "[" + ", ".join(f"{x * scale:.{digits}f}" for x in xs) + "]"

    f32, b16, i8f, i8b = keys
    r_f32, r_b16, r_cross = ratio(i8f, f32), ratio(i8b, b16), ratio(i8b, f32)
    r_i8f_b16 = ratio(i8f, b16)
    c_f32, c_b16 = ratio(i8f, f32, dec_cpu), ratio(i8b, b16, dec_cpu)
    m_f32 = [x / y for x, y in zip(mixed[i8f], mixed[f32])]
    m_b16 = [x / y for x, y in zip(mixed[i8b], mixed[b16])]

    def linear_share(prof):
        names = ("aten::_weight_int8pack_mm", "mkldnn::_linear_pointwise", "aten::linear", "aten::mm", "aten::addmm")
        return sum(s for n, s in prof if n in names)

    result = {
        "int8_bs1_vs_fp32": round(med(r_f32), 3),
        "int8_bs1_vs_bf16": round(med(r_b16), 3),
        "int8_ppl_increase": round(ppl[i8f] / ppl[f32] - 1, 5),
        "int8_bf16_ppl_increase": round(ppl[i8b] / ppl[b16] - 1, 5),
        "int8_bf16_bs1_vs_fp32": round(med(r_cross), 3),
        "int8_fp32_bs1_vs_bf16": round(med(r_i8f_b16), 3),
        "int8_bs1_cpu_vs_fp32": round(med(c_f32), 3),
        "int8_bs1_cpu_vs_bf16": round(med(c_b16), 3),
        "int8_mixed_vs_fp32": round(med(m_f32), 3),
        "int8_mixed_vs_bf16": round(med(m_b16), 3),
        "ppl_fp32": round(ppl[f32], 4),
        "ppl_int8": round(ppl[i8f], 4),
        "ppl_bf16": round(ppl[b16], 4),
        "ppl_int8_bf16": round(ppl[i8b], 4),
        "bs1_ms": {f"{SHORT[d]}{'_int8' if q == 'int8' else ''}": round(med(dec[(d, q)]) * 1e3, 2) for d, q in keys},
        "weights_mb": {f"{SHORT[d]}{'_int8' if q == 'int8' else ''}": round(weights[(d, q)] / 1e6, 1) for d, q in keys},
        "int8_read_gbs": round(read[i8f] / med(dec[i8f]) / 1e9, 1),
        "read_gbs": round(med(bw), 1),
        "bs1_cpu_ms": {
            f"{SHORT[d]}{'_int8' if q == 'int8' else ''}": round(med(dec_cpu[(d, q)]) * 1e3, 2) for d, q in keys
        },
        "load_average": round(os.getloadavg()[0], 1),
        "int8_linear_share": round(linear_share(profiles[i8f]), 3),
        "trained_tokens": trained.get("tokens"),
        "eval_tokens": int(windows[:, 1:].numel()),
    }
    rows += [
        (
            f"bs1 decode {SHORT[d]}{' int8' if q == 'int8' else ''}",
            f"{med(dec[(d, q)]) * 1e3:.2f} ms/tok",
            f"weights {weights[(d, q)] / 1e6:.0f} MB {fmt(dec[(d, q)], 1e3)}",
        )
        for d, q in keys
    ]
    rows += [
        ("int8 / fp32 bs1 decode speed", f"{med(r_f32):.2f}", f"target >= 1.6 {fmt(r_f32)}"),
        ("int8 / bf16 bs1 decode speed", f"{med(r_b16):.2f}", f"target >= 1.1 (int8 engine in bf16) {fmt(r_b16)}"),
        ("int8 / fp32 bs1, CPU time per token", f"{med(c_f32):.2f}", fmt(c_f32)),
        ("int8 / bf16 bs1, CPU time per token", f"{med(c_b16):.2f}", fmt(c_b16)),
        ("int8 (bf16) / fp32 bs1 decode speed", f"{med(r_cross):.2f}", fmt(r_cross)),
        ("int8 (fp32) / bf16 bs1 decode speed", f"{med(r_i8f_b16):.2f}", fmt(r_i8f_b16)),
        ("int8 / fp32 mixed tok/s", f"{med(m_f32):.2f}", f"{a.requests} requests {fmt(m_f32)}"),
        ("int8 / bf16 mixed tok/s", f"{med(m_b16):.2f}", fmt(m_b16)),
        (
            "held-out ppl fp32 / int8",
            f"{ppl[f32]:.3f} / {ppl[i8f]:.3f}",
            f"increase {100 * (ppl[i8f] / ppl[f32] - 1):+.3f}% (target <= +2%)",
        ),
        (
            "held-out ppl bf16 / int8 (bf16)",
            f"{ppl[b16]:.3f} / {ppl[i8b]:.3f}",
            f"increase {100 * (ppl[i8b] / ppl[b16] - 1):+.3f}%",
        ),
        (
            "int8 weights read per token",
            f"{result['int8_read_gbs']:.1f} GB/s",
            f"{read[i8f] / 1e6:.0f} MB / bs1 time; sum() reads {med(bw):.1f} GB/s",
        ),
    ]
    for k in (i8f, i8b, f32, b16):
        top = ", ".join(f"{n} {100 * s:.0f}%" for n, s in profiles[k][:5])
        rows.append((f"profile {SHORT[k[0]]}{' int8' if k[1] == 'int8' else ''} (self CPU)", "", top))
    engines.clear()
    return result


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    sections = [a.only] if a.only else ["int8", "kernels", "offload"]
    run_offload = load_offload() if "offload" in sections else None  # fails before anything is measured
    began = time.perf_counter()
    result: dict = {}
    rows: list = []
    if "int8" in sections:
        result.update(run_int8(a, rows))
    if "kernels" in sections:
        result.update(run_kernels(a, rows))
    if run_offload is not None:
        if "int8" not in sections and "kernels" not in sections:
            ensure_model(a)
        progress("offload section: bench/levers_offload.py")
        off = run_offload(a.model, a)
        missing = [k for k in ("offload_host_ttft_ratio", "offload_disk_ttft_ratio") if k not in off]
        if missing:
            raise SystemExit(f"bench/levers.py: bench/levers_offload.py's run() returned no {missing}")
        result.update(off)
        rows += [
            ("offload host TTFT / cold", f"{off['offload_host_ttft_ratio']:.3f}", "target <= 0.35"),
            ("offload disk TTFT / cold", f"{off['offload_disk_ttft_ratio']:.3f}", "target <= 0.6"),
        ]
    result.update(
        model=os.path.basename(os.path.normpath(a.model)),
        threads=a.threads,
        reps=a.reps,
        sections=sections,
        wall_s=round(time.perf_counter() - began, 1),
    )
    if rows:
        width = max(len(r[0]) for r in rows)
        for name, value, note in rows:
            print(f"{name:<{width}}  {value:>22}  {note}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
