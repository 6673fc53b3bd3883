"""The pdfleet engine against vLLM's CPU build on one model directory, the same workloads, threads, warm-up and
preloaded libraries (issues 19 and 28); run by hand or CI.

python bench/peer.py [--smoke] [--model DIR] [--reps 5] [--requests 64] [--dtypes float32,bfloat16]
                     [--vllm-engine-core inprocess|process] [--vllm-preload tcmalloc,iomp5] [--pdfleet-preload ...]

Each engine runs in a child process (bench/_peer_child.py): pdfleet's under this interpreter (.venv), vLLM's
offline engine under the vLLM runtime's (.venv-vllm, `make vllm`; $PDFLEET_VLLM_PYTHON overrides), driven over
a pipe one command at a time by the same code. A repetition starts each engine fresh, one after the other (the
order alternates), and runs on it: the same warm-up batch, the cold request, the mixed workload, batch-1
decode and the shared-prefix pair; only one engine is alive at a time. Each ratio is reported as the median of
the per-repetition ratios with its min and max, and a verdict against its target only where every repetition
falls on one side of it. Prints a table, then one JSON line.
"""

from __future__ import annotations

try:
    import _sys_path  # noqa: F401,I001  -- first: keeps bench/operator.py from shadowing the stdlib (see it)
except ModuleNotFoundError:  # NOTE: vLLM's spawned engine process re-imports this file with bench/ already off sys.path
    pass

import argparse
import importlib.util
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TMP = os.environ.get("TMPDIR", "/tmp")
INSTALL = "make vllm"
# Ratio key (without its dtype suffix) -> (direction, target); bs1_mbu is fp32 only.
TARGETS = {
    "mixed_vs_vllm": (">=", 1.0),
    "bs1_vs_vllm": (">=", 1.0),
    "prefix_ttft_vs_vllm": ("<=", 1.0),
    "cold_ttft_vs_vllm": ("<=", 1.5),
    "bs1_mbu": (">=", 0.80),
}
MIN_REPS_FOR_VERDICT = 3
PRELOADABLE = ("tcmalloc", "iomp5")
# The warm-up batch both engines run after construction, before anything is timed: (prompt length, tokens).
WARM_UP = ((8, 8), (32, 8), (128, 8), (256, 8))
ENGINE_CORES = {"inprocess": "0", "process": "1"}  # -> VLLM_ENABLE_V1_MULTIPROCESSING
# NOTE: a pause before each measured op, so the engine just measured does not take the cores from the next one:
# longer than the 1 s a vLLM worker process keeps polling its queue after its last message (shm_broadcast's
# busy_loop_s) and Intel OpenMP's default 200 ms spin after a parallel region. idle_cpu_s shows what is left.
SETTLE_S = 1.2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default=os.path.join(TMP, "pdfleet-bench-small"),
        help="HF model directory; created with `pdfleet model init --preset small` (600 MB fp32) if missing",
    )
    p.add_argument("--threads", type=int, default=2, help="compute threads of each engine")
    p.add_argument("--reps", type=int, default=5, help="repetitions, each on freshly started engines")
    p.add_argument("--requests", type=int, default=64, help="mixed workload size")
    p.add_argument("--prompt-len", default="64,512", help="mixed workload prompt lengths, U[lo, hi]")
    p.add_argument("--output-len", default="16,256", help="mixed workload output lengths, U[lo, hi]")
    p.add_argument("--max-num-seqs", type=int, default=64, help="both engines")
    p.add_argument("--budget", type=int, default=512, help="tokens per step (max_num_batched_tokens), both engines")
    p.add_argument("--bs1-tokens", type=int, default=128, help="tokens decoded at batch 1 (32-token prompt)")
    p.add_argument("--prefix", type=int, default=512, help="shared, block-aligned prefix of the TTFT test")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--kv-gib", type=float, default=2.0, help="KV cache of each engine, GiB")
    p.add_argument(
        "--vllm-eager",
        action="store_true",
        help="vLLM with enforce_eager (no torch.compile: starts in seconds, runs slower)",
    )
    p.add_argument(
        "--vllm-engine-core",
        choices=sorted(ENGINE_CORES),
        default="process",
        help="vLLM's engine core and CPU worker in processes of their own (its default, where its documented thread "
        "binding applies) or in the LLM's process (VLLM_ENABLE_V1_MULTIPROCESSING=0, with that binding set here)",
    )
    p.add_argument(
        "--vllm-preload",
        default="tcmalloc,iomp5",
        help="libraries LD_PRELOADed into vLLM's process (its CPU docs: tcmalloc and Intel OpenMP), or none",
    )
    p.add_argument(
        "--pdfleet-preload",
        default="tcmalloc,iomp5",
        help="libraries LD_PRELOADed into pdfleet's process (the same as vLLM's by default), or none",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="a check, not a measurement: tiny model, 6 short requests, 1 repetition, vLLM eager",
    )
    p.add_argument("--child", choices=("vllm", "pdfleet"), help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    p.add_argument("--max-model-len", type=int, default=1024, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.smoke:
        a.model = os.path.join(TMP, "pdfleet-bench-tiny") if a.model == p.get_default("model") else a.model
        a.reps, a.requests, a.prompt_len, a.output_len = 1, 6, "8,48", "4,16"
        a.bs1_tokens, a.prefix, a.vllm_eager, a.kv_gib = 8, 64, True, 0.25
    if a.reps < 1:
        p.error("--reps must be at least 1")
    return a


def span(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    if not 1 <= lo <= hi:
        raise SystemExit(f"bad range {text!r}: want lo,hi with 1 <= lo <= hi")
    return lo, hi


def mixed_workload(
    n: int, prompt: tuple[int, int], output: tuple[int, int], vocab: int, seed: int = 0
) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(8, vocab) for _ in range(rng.randint(*prompt))], rng.randint(*output)) for _ in range(n)]


def warm_up_workload(vocab: int) -> list[tuple[list[int], int]]:
    """WARM_UP's requests, seeded: random tokens that share no block with anything timed later."""
    rng = random.Random(7)
    return [([rng.randrange(8, vocab) for _ in range(length)], n) for length, n in WARM_UP]


# == the vLLM runtime and the preloaded libraries =================================================
def vllm_python() -> str:
    return os.environ.get("PDFLEET_VLLM_PYTHON") or os.path.join(REPO, ".venv-vllm", "bin", "python")


def check_vllm_runtime() -> tuple[str, str]:
    """vLLM's version and its interpreter's sys.prefix, or exit naming the command that installs the runtime."""
    py = vllm_python()
    if not os.access(py, os.X_OK):
        raise SystemExit(f"bench/peer.py: the vLLM runtime is not installed ({py} is missing); run `{INSTALL}`")
    probe = subprocess.run(
        [py, "-c", "import sys, vllm; print(vllm.__version__); print(sys.prefix)"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if probe.returncode != 0:
        tail = probe.stderr.strip()[-600:]
        raise SystemExit(f"bench/peer.py: the vLLM runtime at {py} cannot import vllm ({tail}); run `{INSTALL}`")
    version, prefix = probe.stdout.strip().splitlines()[-2:]
    return version, prefix


def library_paths(vllm_prefix: str) -> dict[str, str | None]:
    """Where each preloadable library is on this machine (None: absent): tcmalloc from the system's linker cache
    (Debian's libtcmalloc-minimal4), Intel OpenMP from the vLLM runtime (the intel-openmp wheel vLLM pins)."""
    found: dict[str, str | None] = {"tcmalloc": None, "iomp5": None}
    cache = ""
    for ldconfig in (shutil.which("ldconfig"), "/sbin/ldconfig"):  # NOTE: /sbin is not on a user's PATH on Debian
        if ldconfig and os.access(ldconfig, os.X_OK):
            cache = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=30).stdout
            break
    for soname in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
        hits = [ln.split("=>")[-1].strip() for ln in cache.splitlines() if ln.strip().startswith(soname + " ")]
        if hits:
            found["tcmalloc"] = hits[0]
            break
    iomp = os.path.join(vllm_prefix, "lib", "libiomp5.so")
    found["iomp5"] = iomp if os.path.isfile(iomp) else None
    return found


def preload(setting: str, found: dict[str, str | None], strict: bool) -> list[str]:
    """The LD_PRELOAD list for a --*-preload setting ('none' or names from PRELOADABLE). A missing library
    ends the run naming how to install it, unless strict is off (a smoke check), where it is left out loudly."""
    names = [] if setting.strip() == "none" else [n.strip() for n in setting.split(",") if n.strip()]
    unknown = sorted(set(names) - set(PRELOADABLE))
    if unknown:
        raise SystemExit(f"bench/peer.py: cannot preload {unknown}: choose from {list(PRELOADABLE)} or none")
    paths = []
    for name in names:
        if found[name] is None:
            why = f"{name} is not installed (`{INSTALL}` installs Debian's libtcmalloc-minimal4 and intel-openmp)"
            if strict:
                raise SystemExit(f"bench/peer.py: {why}; or pass a preload setting without it")
            progress(f"WARNING: {why}; running without it")
            continue
        paths.append(found[name])
    return paths


def cpu_bind(threads: int) -> str:
    """The first `threads` cores this process may use, as VLLM_CPU_OMP_THREADS_BIND takes them."""
    cores = sorted(os.sched_getaffinity(0))[:threads]
    return ",".join(str(c) for c in cores)


def vllm_worker_omp_env(cores: str, libs: list[str]) -> dict[str, str]:
    """The OpenMP settings vLLM's multiprocess executor gives its CPU worker process for VLLM_CPU_OMP_THREADS_BIND
    (vllm/utils/ompmultiprocessing.py, 0.32.0), for its engine core run in-process.

    NOTE: in-process, vLLM applies neither the bind nor these settings (its CPU platform code says the uniprocess
    executor cannot set the OpenMP environment): its threads would run unbound, with Intel OpenMP's 200 ms spin
    after every parallel region. Set before the process starts, they give it the worker vLLM would have spawned."""
    env = {"OMP_NUM_THREADS": str(len(cores.split(",")))}
    if any("libiomp" in lib for lib in libs):
        env.update(KMP_AFFINITY=f"granularity=fine,explicit,proclist=[{cores}]", KMP_BLOCKTIME="5", KMP_TPAUSE="0")
    else:
        env["GOMP_CPU_AFFINITY"] = cores.replace(",", " ")
    return env


# == one engine in a child process =================================================================
class Engine:
    """A child process holding one engine (bench/_peer_child.py); `call` sends a command and waits for its answer.
    startup_s: from the process's start to the engine's ready line (imports, load, the engine's own warm-up)."""

    def __init__(self, a: argparse.Namespace, side: str, dtype: str, max_model_len: int, libs: list[str]):
        self.side = side
        self.log = tempfile.NamedTemporaryFile(prefix=f"peer-{side}-{dtype}-", suffix=".log", dir=TMP, delete=False)
        args = [
            vllm_python() if side == "vllm" else sys.executable,
            os.path.abspath(__file__),
            "--child",
            side,
            "--model",
            a.model,
            "--dtype",
            dtype,
            "--threads",
            str(a.threads),
            "--max-num-seqs",
            str(a.max_num_seqs),
            "--budget",
            str(a.budget),
            "--max-model-len",
            str(max_model_len),
            "--kv-gib",
            str(a.kv_gib),
        ]
        if a.vllm_eager:
            args.append("--vllm-eager")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("LD_PRELOAD", None)
        if libs:
            env["LD_PRELOAD"] = ":".join(libs)
        if side == "vllm":
            env.update(
                VLLM_CPU_OMP_THREADS_BIND=cpu_bind(a.threads),
                VLLM_CPU_KVCACHE_SPACE=str(max(1, round(a.kv_gib))),
                VLLM_ENABLE_V1_MULTIPROCESSING=ENGINE_CORES[a.vllm_engine_core],
                VLLM_NO_USAGE_STATS="1",
                DO_NOT_TRACK="1",
            )
            for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # the bind decides vLLM's threads
                env.pop(name, None)
            if a.vllm_engine_core == "inprocess":
                env.update(vllm_worker_omp_env(cpu_bind(a.threads), libs))
        t = time.perf_counter()
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            start_new_session=True,
        )
        hello = self._read()
        self.startup_s = time.perf_counter() - t
        self.version, self.own_warm_up_s = hello["version"], hello["own_warm_up_s"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=60)
            with open(self.log.name, errors="replace") as f:
                tail = f.read()[-4000:]
            raise RuntimeError(f"{self.side} child exited ({self.proc.returncode}); log {self.log.name}:\n{tail}")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"{self.side} child: {out['error']}")
        return out

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def cpu_seconds(self) -> float:
        """User + system CPU time of every live process in the child's session (vLLM's engine core and workers
        included: they inherit it)."""
        tick, total = os.sysconf("SC_CLK_TCK"), 0
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == self.proc.pid:  # session id (field 6 of stat; start_new_session made it ours)
                total += int(fields[11]) + int(fields[12])
        return total / tick

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=10)
        try:  # vLLM's engine-core and worker processes, if they outlived their parent
            os.killpg(self.proc.pid, 9)
        except ProcessLookupError:
            pass
        os.unlink(self.log.name)


def one_repetition(a, order: tuple[str, ...], dtype: str, max_model_len: int, libs: dict, plan: dict) -> dict:
    """Start each engine fresh (in `order`, one after the other) and run every measurement of a repetition on
    both, op by op in that order, so the two see the machine within seconds of each other. Each engine's answer
    to each op, plus idle_cpu_s: the CPU seconds its processes used while the other engine was being measured."""
    engines: dict[str, Engine] = {}
    try:
        for side in order:
            engines[side] = Engine(a, side, dtype, max_model_len, libs[side])
        out = {
            s: {"startup_s": e.startup_s, "version": e.version, "own_warm_up_s": e.own_warm_up_s, "idle_cpu_s": 0.0}
            for s, e in engines.items()
        }

        def each(op: str, **cmd) -> dict[str, dict]:
            answers = {}
            for side in order:
                others = [s for s in order if s != side]
                time.sleep(SETTLE_S)
                before = {s: engines[s].cpu_seconds() for s in others}
                answers[side] = engines[side].call(op=op, **cmd)
                for s in others:
                    out[s]["idle_cpu_s"] += engines[s].cpu_seconds() - before[s]
            return answers

        for side, r in each("batch", work=plan["warm_up"]).items():
            out[side]["warm_up_s"] = r["wall_s"]
        for side, r in each("ttft", prompt=plan["cold"]).items():
            out[side]["cold_s"] = r["ttft_s"]
        for side, r in each("batch", work=plan["work"]).items():
            out[side]["mixed_tok_s"], out[side]["mixed_tokens"] = plan["produced"] / r["wall_s"], r["tokens"]
        out["pdfleet"]["read_gbs"] = engines["pdfleet"].call(op="bandwidth")["gbs"]
        for side, r in each("decode", prompt=plan["bs1_prompt"], n=a.bs1_tokens).items():
            out[side]["dec_s"], out[side]["bs1_tokens"] = r["s_per_token"], r["tokens"]
        prefix, (first, second) = plan["prefix"]
        for side, r in each("ttft", prompt=prefix + first).items():
            out[side]["fresh_s"] = r["ttft_s"]
        for side, r in each("ttft", prompt=prefix + second).items():
            out[side]["shared_s"] = r["ttft_s"]
        for side, r in each("idle").items():
            assert r["idle_and_whole"], f"{side} ends idle with every block free"
        return out
    finally:
        for e in engines.values():
            e.close()


# == measurement ====================================================================================
def disagreements(ours: list[list[int]], theirs: list[list[int]]) -> list[int]:
    """Index of the first differing token of every sequence pair that differs (-1 for a length mismatch)."""
    out = []
    for a, b in zip(ours, theirs, strict=True):
        if a != b:
            out.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), -1))
    return out


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_dtype(a, dtype: str, plans: list[dict], libs: dict[str, list[str]]) -> dict:
    """Every repetition of one dtype: per repetition both engines started fresh and measured, the order alternating.
    Returns the per-repetition samples of each engine and the token comparison of the first repetition."""
    plan0 = plans[0]
    max_len = max(len(p) + n for p, n in plan0["work"] + plan0["warm_up"])
    max_len = max(max_len, len(plan0["bs1_prompt"]) + a.bs1_tokens + 2, len(plan0["cold"]) + 1, a.prefix + 17)
    max_model_len = 1 << (max_len - 1).bit_length()
    runs: dict[str, list[dict]] = {"pdfleet": [], "vllm": []}
    for rep, plan in enumerate(plans):
        order = ("pdfleet", "vllm") if rep % 2 == 0 else ("vllm", "pdfleet")
        progress(f"{dtype}: repetition {rep + 1}/{a.reps}: starting {order[0]}, then {order[1]}")
        reps = one_repetition(a, order, dtype, max_model_len, libs, plan)
        for side, r in reps.items():
            assert all(len(t) == n for t, (_, n) in zip(r["mixed_tokens"], plan["work"])), f"{side}: every token"
            runs[side].append(r)
        p, v = runs["pdfleet"][-1], runs["vllm"][-1]
        progress(
            f"{dtype}: mixed {p['mixed_tok_s']:.0f} vs {v['mixed_tok_s']:.0f} tok/s, bs1 {p['dec_s'] * 1e3:.2f} vs "
            f"{v['dec_s'] * 1e3:.2f} ms/tok, cold TTFT {p['cold_s'] * 1e3:.0f} vs {v['cold_s'] * 1e3:.0f} ms, "
            f"shared-prefix TTFT {p['shared_s'] * 1e3:.1f} vs {v['shared_s'] * 1e3:.1f} ms (pdfleet vs vLLM)"
        )
    p, v = runs["pdfleet"][0], runs["vllm"][0]
    bad = [
        f"mixed[{i}]@{d}"
        for i, (x, y) in enumerate(zip(p["mixed_tokens"], v["mixed_tokens"]))
        for d in disagreements([x], [y])
    ]
    bad += [f"bs1@{d}" for d in disagreements([p["bs1_tokens"]], [v["bs1_tokens"]])]
    return {"pdfleet": runs["pdfleet"], "vllm": runs["vllm"], "bad": bad, "compared": len(p["mixed_tokens"]) + 1}


# == the summary ===================================================================================
def verdict(key: str, values: list[float]) -> str:
    """'met' or 'missed' only when every repetition falls on one side of the key's target, else 'no verdict'."""
    direction, target = TARGETS[key]
    lo, hi = min(values), max(values)
    if len(values) < MIN_REPS_FOR_VERDICT:
        return f"no verdict ({len(values)} repetition(s); {MIN_REPS_FOR_VERDICT} needed)"
    met = lo >= target if direction == ">=" else hi <= target
    missed = hi < target if direction == ">=" else lo > target
    return "met" if met else "missed" if missed else f"no verdict ({lo:.2f}-{hi:.2f} straddles {target})"


def summarize(a, runs: dict, weight_bytes: int, version: str, libs: dict[str, list[str]]) -> tuple[dict, list]:
    """The JSON result and the table rows."""
    med = statistics.median

    def ratios(num, den):
        return [x / y for x, y in zip(num, den)]

    def fmt(xs, scale=1.0, digits=2):
        return "[" + ", ".join(f"{x * scale:.{digits}f}" for x in xs) + "]"

    short = {"float32": "fp32", "bfloat16": "bf16"}
    result: dict = {}
    spread: dict[str, list[float]] = {}
    verdicts: dict[str, str] = {}
    rows = []

    def ratio_key(name: str, k: str, values: list[float]) -> float:
        key = f"{name}_{k}" if k else name
        result[key] = round(med(values), 3)
        spread[key] = [round(min(values), 3), round(max(values), 3)]
        if name in TARGETS:
            verdicts[key] = verdict(name, values)
        return result[key]

    for d, s in runs.items():
        k = short.get(d, d)
        P, V = s["pdfleet"], s["vllm"]

        def col(side, field, P=P, V=V):
            return [r[field] for r in (P if side == "pdfleet" else V)]

        r_mixed = ratios(col("pdfleet", "mixed_tok_s"), col("vllm", "mixed_tok_s"))
        r_bs1 = ratios(col("vllm", "dec_s"), col("pdfleet", "dec_s"))
        r_prefix = ratios(col("pdfleet", "shared_s"), col("vllm", "shared_s"))
        r_cold = ratios(col("pdfleet", "cold_s"), col("vllm", "cold_s"))
        r_fresh = ratios(col("pdfleet", "fresh_s"), col("vllm", "fresh_s"))
        ratio_key("mixed_vs_vllm", k, r_mixed)
        ratio_key("bs1_vs_vllm", k, r_bs1)
        ratio_key("prefix_ttft_vs_vllm", k, r_prefix)
        ratio_key("cold_ttft_vs_vllm", k, r_cold)
        ratio_key("fresh_ttft_vs_vllm", k, r_fresh)
        for side in ("pdfleet", "vllm"):
            result[f"{side}_mixed_tok_s_{k}"] = round(med(col(side, "mixed_tok_s")), 1)
            result[f"{side}_bs1_ms_{k}"] = round(med(col(side, "dec_s")) * 1e3, 2)
            result[f"{side}_cold_ttft_ms_{k}"] = round(med(col(side, "cold_s")) * 1e3, 1)
            result[f"{side}_startup_s_{k}"] = round(med(col(side, "startup_s")), 1)
            result[f"{side}_idle_cpu_s_{k}"] = round(med(col(side, "idle_cpu_s")), 2)
        result[f"token_disagreements_{k}"] = len(s["bad"])
        result[f"tokens_compared_{k}"] = s["compared"]
        for side, label in (("pdfleet", "pdfleet"), ("vllm", "vLLM")):
            rows += [
                (
                    f"{label} mixed ({k})",
                    f"{med(col(side, 'mixed_tok_s')):.1f} tok/s",
                    fmt(col(side, "mixed_tok_s"), 1, 1),
                ),
                (
                    f"{label} bs1 decode ({k})",
                    f"{med(col(side, 'dec_s')) * 1e3:.2f} ms/tok",
                    fmt(col(side, "dec_s"), 1e3),
                ),
                (
                    f"{label} TTFT cold / fresh / shared ({k})",
                    f"{med(col(side, 'cold_s')) * 1e3:.0f} / {med(col(side, 'fresh_s')) * 1e3:.0f} / "
                    f"{med(col(side, 'shared_s')) * 1e3:.1f} ms",
                    f"cold {fmt(col(side, 'cold_s'), 1e3, 0)} shared {fmt(col(side, 'shared_s'), 1e3, 1)}",
                ),
                (
                    f"{label} startup / warm-up batch ({k})",
                    f"{med(col(side, 'startup_s')):.1f} / {med(col(side, 'warm_up_s')):.2f} s",
                    f"startup {fmt(col(side, 'startup_s'), 1, 1)}",
                ),
                (
                    f"{label} CPU while idle ({k})",
                    f"{med(col(side, 'idle_cpu_s')):.2f} s",
                    f"while the other engine ran {fmt(col(side, 'idle_cpu_s'))}",
                ),
            ]
        rows += [
            (f"ratio mixed pdfleet / vLLM ({k})", f"{med(r_mixed):.2f}", f"target >= 1.0 {fmt(r_mixed)}"),
            (f"ratio bs1 speed pdfleet / vLLM ({k})", f"{med(r_bs1):.2f}", f"target >= 1.0 {fmt(r_bs1)}"),
            (f"ratio cold TTFT pdfleet / vLLM ({k})", f"{med(r_cold):.2f}", f"target <= 1.5 {fmt(r_cold)}"),
            (f"ratio fresh-prefix TTFT pdfleet / vLLM ({k})", f"{med(r_fresh):.2f}", f"no target {fmt(r_fresh)}"),
            (
                f"ratio shared-prefix TTFT pdfleet / vLLM ({k})",
                f"{med(r_prefix):.2f}",
                f"target <= 1.0 {fmt(r_prefix)}",
            ),
            (f"token disagreements ({k})", f"{len(s['bad'])} of {s['compared']}", " ".join(s["bad"][:12])),
        ]
    if "float32" in runs:
        P = runs["float32"]["pdfleet"]
        bws = [r["read_gbs"] for r in P]
        r_mbu = ratios([weight_bytes / (bw * 1e9) for bw in bws], [r["dec_s"] for r in P])
        ratio_key("bs1_mbu", "", r_mbu)
        result["read_gbs"] = round(med(bws), 1)
        result["prefix_ttft_vs_vllm"] = result["prefix_ttft_vs_vllm_fp32"]
        rows += [
            ("memory read bandwidth", f"{med(bws):.1f} GB/s", f"1 GiB sum {fmt(bws, 1, 1)}"),
            (
                "bs1 MBU fp32 (floor / pdfleet)",
                f"{med(r_mbu):.2f}",
                f"target >= 0.80 floor {weight_bytes / 1e6:.0f} MB / bandwidth {fmt(r_mbu)}",
            ),
        ]
    # NOTE: the interface key is fp32's, as prefix_ttft_vs_vllm; a bf16-only run gives bf16's.
    first = "fp32" if "float32" in runs else short.get(next(iter(runs)), next(iter(runs)))
    result["cold_ttft_vs_vllm"] = result[f"cold_ttft_vs_vllm_{first}"]
    spread["cold_ttft_vs_vllm"] = spread[f"cold_ttft_vs_vllm_{first}"]
    verdicts["cold_ttft_vs_vllm"] = verdicts[f"cold_ttft_vs_vllm_{first}"]
    result["token_disagreements"] = sum(len(s["bad"]) for s in runs.values())
    result["tokens_compared"] = sum(s["compared"] for s in runs.values())
    result["vllm_version"] = version
    result["spread"] = spread
    result["verdicts"] = verdicts
    result.update(
        vllm_engine_core=a.vllm_engine_core,
        vllm_preload=[os.path.basename(p) for p in libs["vllm"]],
        pdfleet_preload=[os.path.basename(p) for p in libs["pdfleet"]],
        warm_up=[list(w) for w in WARM_UP],
        vllm_compiled=not a.vllm_eager,
    )
    return result, rows


def make_plans(a, vocab: int) -> list[dict]:
    """Every repetition's inputs: the same for both engines; the cold prompt and the prefix are new each time."""
    work = mixed_workload(a.requests, span(a.prompt_len), span(a.output_len), vocab)
    rng = random.Random(1)
    bs1_prompt = [rng.randrange(8, vocab) for _ in range(32)]
    plans = []
    for rep in range(a.reps):
        r = random.Random(100 + rep)
        prefix = [r.randrange(8, vocab) for _ in range(a.prefix)]
        tails = [[r.randrange(8, vocab) for _ in range(16)] for _ in range(2)]
        cold = [random.Random(200 + rep).randrange(8, vocab) for _ in range(a.prefix + 16)]
        plans.append(
            {
                "warm_up": warm_up_workload(vocab),
                "cold": cold,
                "work": work,
                "produced": sum(n for _, n in work),
                "bs1_prompt": bs1_prompt,
                "prefix": (prefix, tails),
            }
        )
    return plans


def load_engine_bench():
    """bench/engine.py as a module: the weight-bytes floor is its own."""
    spec = importlib.util.spec_from_file_location("pdfleet_bench_engine", os.path.join(HERE, "engine.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def child_main(a: argparse.Namespace) -> int:
    spec = importlib.util.spec_from_file_location("_peer_child", os.path.join(HERE, "_peer_child.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.serve(a)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.child:
        return child_main(a)
    # NOTE: a stopped run (SIGTERM) unwinds like an error, so every child engine is closed by its finally block.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    version, vllm_prefix = check_vllm_runtime()
    found = library_paths(vllm_prefix)
    libs = {
        "vllm": preload(a.vllm_preload, found, strict=not a.smoke),
        "pdfleet": preload(a.pdfleet_preload, found, strict=not a.smoke),
    }
    from pdfleet_worker.config import ModelConfig
    from pdfleet_worker.model import model_init

    if not os.path.isfile(os.path.join(a.model, "model.safetensors")):
        preset = "tiny" if a.smoke else "small"
        progress(f"creating {a.model} (pdfleet model init --preset {preset})")
        model_init.init_model(a.model, preset, seed=0)
    cfg = ModelConfig.from_dir(a.model)
    weight_bytes = load_engine_bench().weight_bytes_per_token(a.model, 4)
    plans = make_plans(a, cfg.vocab_size)
    dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    if "bfloat16" in dtypes:
        from pdfleet_worker.layers.packed_linear import NO_FAST_BF16, fast_bf16

        if not fast_bf16():
            progress(
                f"NOTE: {NO_FAST_BF16}: vLLM runs bf16 several times slower than fp32 here; pdfleet's "
                "plain_linear widens bf16 weights to fp32 as it reads them"
            )
    load_before = [round(x, 2) for x in os.getloadavg()]
    began = time.perf_counter()
    progress(
        f"vLLM {version}, engine core {a.vllm_engine_core}, {'eager' if a.vllm_eager else 'torch.compile'}; preload "
        f"vLLM {libs['vllm'] or 'none'}, pdfleet {libs['pdfleet'] or 'none'}; load average {load_before}"
    )
    runs = {d: run_dtype(a, d, plans, libs) for d in dtypes}
    result, rows = summarize(a, runs, weight_bytes, version, libs)
    result.update(
        model=os.path.basename(os.path.normpath(a.model)),
        model_params=cfg.num_params,
        threads=a.threads,
        requests=a.requests,
        reps=a.reps,
        load_before=load_before,
        load_after=[round(x, 2) for x in os.getloadavg()],
        wall_s=round(time.perf_counter() - began, 1),
    )
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>22}  {note}")
    for key, v in result["verdicts"].items():
        print(f"verdict {key}: {v} (median {result[key]}, min-max {result['spread'][key]})")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
