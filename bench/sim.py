"""`pdfleet simulate` speed on a day of the 100-accelerator fleet, and the `cpu` class calibration measured with the
engine.

python bench/sim.py [--policy static-nvidia ...] [--duration 1d]   # speed: prints a table and one JSON line
python bench/sim.py calibrate [--preset tiny] [--stat min|median] [--out cal.json]  # needs torch: engine + one HTTP hop
python bench/sim.py calibrate --engine vllm --preset small [--overhead-from cal.json]  # vLLM's CPU build (.venv-vllm)

The speed run is the CLI's own path (fleet file -> synthetic conversation trace -> Simulator ->
summary) timed per policy. `calibrate` times real engine steps of a `pdfleet model init` model:
prefill steps of several prompt lengths (a linear fit gives the per-step overhead and the seconds
per token, hence the prefill MFU against the `cpu` class's peak) and batch-1 decode steps (the
weight read beyond the overhead, hence the decode MBU against the class's bandwidth); then it starts one
real `pdfleet worker` and times HTTP requests to their first byte (the `http_hop_s` every hop of the
serving path costs: client -> router, router -> prefill, router -> decode). It writes the
JSON line that `pdfleet simulate --calibration FILE` reads. `--engine vllm` measures vLLM's CPU build the
same way through its offline `LLM` (in its own virtualenv; no HTTP hop): `sim/efficiency.py` holds the
numbers it gave.
"""

from __future__ import annotations

import _sys_path  # noqa: F401  -- first: keeps bench/operator.py from shadowing the stdlib (see it)

# isort: split
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "workers")]

from pdfleet_operator import trace as tr  # noqa: E402
from pdfleet_operator.sim import fleet as fleet_file  # noqa: E402
from pdfleet_operator.sim import report  # noqa: E402
from pdfleet_operator.sim.simulator import Simulator  # noqa: E402

FLEET = ROOT / "examples" / "sim" / "fleet-100.yaml"


def speed(a: argparse.Namespace) -> int:
    fl = fleet_file.load(a.fleet)
    duration = tr.parse_span(a.duration)
    warmup = 1800.0
    started = time.perf_counter()
    trace = tr.synthetic(
        "conversation",
        mean_rate=fl.trace.mean_rate,
        duration=duration + warmup,
        seed=a.seed,
        start_hour=fl.trace.start_hour - warmup / 3600,
    )
    gen_s = time.perf_counter() - started
    rows, result = (
        [],
        {
            "requests": len(trace),
            "simulated_h": round(duration / 3600, 2),
            "trace_s": round(gen_s, 2),
            "cores": os.cpu_count(),
            "policies": {},
        },
    )
    for name in a.policy or [next(iter(fl.policies))]:
        t0 = time.perf_counter()
        sim = Simulator(fl, fl.policy(name), trace, warmup_s=warmup, seed=a.seed).run()
        wall = time.perf_counter() - t0
        e = report.summarize(sim)
        rows.append(
            (
                name,
                f"{len(trace):,}",
                f"{wall:.1f} s",
                f"{len(trace) / wall:,.0f}",
                f"${e['cost_per_1m_tokens']:.4f}",
                f"{e['slo_attainment']:.2%}",
            )
        )
        result["policies"][name] = {
            "wall_s": round(wall, 2),
            "requests_per_wall_s": round(len(trace) / wall),
            "cost_per_1m_tokens": e["cost_per_1m_tokens"],
            "slo_attainment": e["slo_attainment"],
        }
    header = ("policy", "requests", "wall", "req/s simulated", "$/1M tok", "SLO att.")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(str(c).rjust(w) for c, w in zip(r, widths)))
    worst = max(p["wall_s"] for p in result["policies"].values())
    result["max_wall_s"] = worst
    result["under_2_min"] = worst < 120
    print(json.dumps(result))
    return 0


VLLM_CHILD = r"""
import json, statistics, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
a = json.loads(sys.argv[1])
llm = LLM(model=a["model"], dtype=a["dtype"], max_model_len=1024, max_num_batched_tokens=a["budget"], max_num_seqs=64,
          enable_prefix_caching=False, seed=0, enforce_eager=a["eager"])
vocab = a["vocab"]
def run(ids, max_tokens, copies=1):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=[(x + c) % (vocab - 8) + 8 for x in ids]) for c in range(copies)]
    t = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    return time.perf_counter() - t
stat = min if a["stat"] == "min" else statistics.median
prompt = lambda n, k: [(7 * i + n + k) % (vocab - 8) + 8 for i in range(n)]
for n in a["lengths"]:
    run(prompt(n, 0), 1, a["copies"])
# NOTE: `copies` prompts per call: one LLM.generate call costs tens of ms of its own (input processing,
# outputs) that a served request pays outside the engine step; per prompt that is amortized away.
prefill = {n: stat([run(prompt(n, k + 1), 1, a["copies"]) for k in range(a["reps"])]) / a["copies"]
           for n in a["lengths"]}
steps = 64
short = stat([run(prompt(4, k), 1) for k in range(a["reps"])])
long = stat([run(prompt(4, k), 1 + steps) for k in range(a["reps"])])
print(json.dumps({"prefill_s": prefill, "decode_step_s": (long - short) / steps}))
"""


def calibrate_vllm(a: argparse.Namespace, model: str, cfg, cpu) -> int:  # noqa: ANN001
    """The same measurement with vLLM's CPU build (in .venv-vllm, `make vllm`): prefill requests of several
    lengths (linear fit: overhead and MFU) and batch-1 decode steps (MBU), through vLLM's offline `LLM`."""
    import subprocess

    py = os.environ.get("PDFLEET_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not os.path.isfile(py):
        raise SystemExit(f"calibrate --engine vllm: no vLLM runtime at {py} (make vllm)")
    lengths = [16, 64, 128, 256, a.budget]
    args = {
        "model": model,
        "dtype": a.dtype,
        "budget": a.budget,
        "lengths": lengths,
        "reps": a.reps,
        "stat": a.stat,
        "vocab": cfg.vocab_size,
        "eager": a.vllm_eager,
        "copies": 4,
    }
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{a.threads - 1}",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OMP_NUM_THREADS": str(a.threads),
        "TOKENIZERS_PARALLELISM": "false",
    }
    done = subprocess.run(
        [py, "-c", VLLM_CHILD, json.dumps(args)], capture_output=True, text=True, env=env, timeout=1800
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"calibrate --engine vllm failed: {done.stderr[-3000:]}")
    got = json.loads(lines[-1])
    times = {int(n): t for n, t in got["prefill_s"].items()}
    overhead = None
    if a.overhead_from:
        # NOTE: vLLM's per-step overhead cannot be told apart from its weight read at batch 1 (both are
        # the whole step); the pdfleet engine's, measured in-process, stands in for it (an assumption)
        overhead = json.loads(Path(a.overhead_from).read_text().strip().splitlines()[-1])["step_overhead_s"]
    return _write(a, cfg, cpu, times, got["decode_step_s"], None, engine="vllm", overhead=overhead)


def _write(
    a: argparse.Namespace,
    cfg,
    cpu,
    times: dict[int, float],
    decode1: float,
    decode8: float | None,  # noqa: ANN001
    hop: float | None = None,
    engine: str = "pdfleet",
    overhead: float | None = None,
) -> int:
    xs, ys = list(times), [times[n] for n in times]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    overhead = max(0.0, my - slope * mx) if overhead is None else overhead
    dtype_bytes = {"float32": 4, "bfloat16": 2}[a.dtype]
    weights = cfg.num_params * dtype_bytes
    peak = cpu.peak_tflops * 1e12 * cpu.count
    bandwidth = cpu.memory_bandwidth_gbps * 1e9 * cpu.count
    mfu = min(1.0, 2 * cfg.num_params / (peak * slope))
    read = decode1 - overhead
    mbu = min(1.0, weights / (bandwidth * read)) if read > 0 else 1.0
    out = {
        "kind": "pdfleet-sim-calibration",
        "class": "cpu",
        "engine": engine,
        "model": f"{a.preset} ({cfg.num_params / 1e6:.1f}M params, {a.dtype})",
        "prefill_mfu": round(mfu, 4),
        "decode_mbu": round(mbu, 4),
        "step_overhead_s": round(overhead, 6),
        **({} if hop is None else {"http_hop_s": round(hop, 6)}),
        "prefill_s": {str(n): round(t, 6) for n, t in times.items()},
        "decode_step_s": {"1": round(decode1, 6), **({} if decode8 is None else {"8": round(decode8, 6)})},
        "threads": a.threads,
        "stat": a.stat,
    }
    print(
        f"{engine} prefill step: {overhead * 1000:.2f} ms + {slope * 1e6:.1f} us/token  -> MFU {mfu:.3f} of "
        f"{peak / 1e12:.2f} TFLOP/s"
    )
    print(f"{engine} decode bs1 step: {decode1 * 1000:.2f} ms -> MBU {mbu:.3f} of {bandwidth / 1e9:.0f} GB/s")
    if hop is not None:
        print(f"HTTP hop (client -> worker, first byte, beyond the engine's prefill): {hop * 1000:.2f} ms")
    line = json.dumps(out)
    print(line)
    if a.out:
        Path(a.out).write_text(line + "\n")
    return 0


def calibrate(a: argparse.Namespace) -> int:
    if a.engine == "vllm":
        from pdfleet_worker.config import ModelConfig
        from pdfleet_worker.model import model_init

        cpu = fleet_file.load(ROOT / "examples" / "sim" / "local-tiny.yaml").classes["cpu"]
        model = a.model or os.path.join(os.environ.get("TMPDIR", "/tmp"), f"pdfleet-bench-{a.preset}")
        if not os.path.isfile(os.path.join(model, "model.safetensors")):
            model_init.init_model(model, a.preset, seed=0)
        return calibrate_vllm(a, model, ModelConfig.from_dir(model), cpu)
    import torch

    from pdfleet_worker.config import EngineConfig, ModelConfig
    from pdfleet_worker.engine.llm_engine import LLMEngine
    from pdfleet_worker.model import model_init
    from pdfleet_worker.sampling_params import SamplingParams

    classes = fleet_file.load(ROOT / "examples" / "sim" / "local-tiny.yaml").classes
    cpu = classes["cpu"]
    torch.set_num_threads(a.threads)
    model = a.model or os.path.join(os.environ.get("TMPDIR", "/tmp"), f"pdfleet-bench-{a.preset}")
    if not os.path.isfile(os.path.join(model, "model.safetensors")):
        model_init.init_model(model, a.preset, seed=0)
    cfg = ModelConfig.from_dir(model)
    engine = LLMEngine(
        EngineConfig(
            model=model,
            dtype=a.dtype,
            max_num_seqs=64,
            max_num_batched_tokens=a.budget,
            kv_cache_memory_bytes=1 << 30,
            num_threads=a.threads,
            enable_prefix_caching=False,
        ),
        load_tokenizer=False,
    )
    counter = iter(range(10**9))

    def prefill(n: int) -> float:
        prompt = [(7 * i + n) % (cfg.vocab_size - 8) + 8 for i in range(n)]
        engine.add_request(f"p{next(counter)}", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - t

    def decode_step(batch: int, steps: int = 16) -> float:
        for b in range(batch):
            engine.add_request(
                f"d{next(counter)}",
                [8 + b, 9, 10, 11],
                SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True),
            )
        engine.step()  # the prompts
        stamps = []
        while engine.has_unfinished_requests():
            engine.step()
            stamps.append(time.perf_counter())
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        return stat(gaps)

    lengths = [16, 64, 128, 256, a.budget]
    for n in lengths:
        prefill(n)  # warm-up
    # min: the hardware's best (other jobs on a shared machine only add); median: the machine as a fleet
    # started now would find it (what a replay on the same, shared machine is compared against)
    stat = min if a.stat == "min" else statistics.median
    times = {n: stat([prefill(n) for _ in range(a.reps)]) for n in lengths}
    decode1 = decode_step(1)
    decode8 = decode_step(8)
    hop = None if a.no_http else http_hop(a, model, times[16])
    return _write(a, cfg, cpu, times, decode1, decode8, hop, engine="pdfleet")


def http_hop(a: argparse.Namespace, model: str, prefill16_s: float) -> float:
    """One HTTP round trip to first byte on this host: a real `pdfleet worker` (role both, the threads of the
    engine measurement) answering streaming 16-token, 2-output-token requests one at a time (4 per second),
    sent by `pdfleet load`'s client; the median TTFT minus the engine's own prefill of 16 tokens (measured
    above, in-process)."""
    import asyncio
    import subprocess

    import httpx

    from pdfleet_operator.local.ports import free_port

    port = free_port()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(a.threads),
        "MKL_NUM_THREADS": str(a.threads),
        "TOKENIZERS_PARALLELISM": "false",
    }
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdfleet_operator.cli",
            "worker",
            "--model",
            model,
            "--served-model-name",
            "calib",
            "--role",
            "both",
            "--port",
            str(port),
            "--num-threads",
            str(a.threads),
            "--max-model-len",
            "1024",
            "--num-kv-blocks",
            "256",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        with httpx.Client(timeout=30) as client:
            while True:
                try:
                    if client.get(f"{base}/ready", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"calibrate: the worker on :{port} did not become ready")
                time.sleep(0.2)
        # the requests themselves go through `pdfleet load`'s own client (asyncio httpx, one pooled client,
        # streaming), so what the hop costs includes the client a replay measures TTFT with
        from pdfleet_operator.local import load as loadgen

        arrivals = [loadgen.Arrival(t=0.25 * i, prompt_tokens=16, output_tokens=2) for i in range(a.http_reps + 3)]
        results = asyncio.run(loadgen.LoadGenerator(base, arrivals, model="calib").run())
        firsts = [r.ttft for r in results[3:] if r.ttft is not None]  # the first three warm the path up
        if len(firsts) < a.http_reps // 2:
            raise SystemExit(f"calibrate: only {len(firsts)} of {a.http_reps} timed requests answered")
    finally:
        worker.terminate()
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(10)
    return max(0.0, statistics.median(firsts) - prefill16_s)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd")
    p.add_argument("--fleet", default=str(FLEET))
    p.add_argument("--policy", nargs="+")
    p.add_argument("--duration", default="1d")
    p.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("calibrate", help="measure the cpu class with the engine (needs torch)")
    c.add_argument("--preset", default="tiny", help="pdfleet model init preset (the local fleet runs tiny)")
    c.add_argument("--model", help="model directory (default: a temp dir, created with model init)")
    c.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    c.add_argument("--threads", type=int, default=2)
    c.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens (local-tiny uses 512)")
    c.add_argument("--reps", type=int, default=5)
    c.add_argument(
        "--stat",
        choices=("min", "median"),
        default="min",
        help="min over repetitions: the hardware (default); median: this shared machine as it is now",
    )
    c.add_argument("--http-reps", type=int, default=20, help="requests timed for the HTTP hop (default 20)")
    c.add_argument("--no-http", action="store_true", help="skip the HTTP hop (no worker process)")
    c.add_argument("--out", help="also write the JSON line here")
    c.add_argument(
        "--engine",
        choices=("pdfleet", "vllm"),
        default="pdfleet",
        help="the engine measured: the pdfleet engine in-process, or vLLM's CPU build (.venv-vllm)",
    )
    c.add_argument("--vllm-eager", action="store_true", help="vLLM without torch.compile (starts sooner, runs slower)")
    c.add_argument(
        "--overhead-from",
        metavar="FILE",
        help="with --engine vllm: take the per-step overhead from this pdfleet calibration (see calibrate_vllm)",
    )
    a = p.parse_args()
    return calibrate(a) if a.cmd == "calibrate" else speed(a)


if __name__ == "__main__":
    sys.exit(main())
