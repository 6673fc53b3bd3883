"""The pdfleet engine against vLLM's CPU build on one model directory, the same workloads and threads (issue 19); run by
hand or CI.

python bench/peer.py [--smoke] [--model DIR] [--reps 3] [--requests 64] [--dtypes float32,bfloat16]

The pdfleet engine runs in this process (.venv); vLLM's offline `LLM` runs in a child process under
the vLLM runtime's own interpreter (.venv-vllm, `make vllm`; $PDFLEET_VLLM_PYTHON overrides), driven
over a pipe, one command at a time, so the two never compute at once. Every repetition runs both
engines back to back (the order alternates) and each reported ratio is the median of the
per-repetition ratios. Prints a table, then one JSON line.
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
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TMP = os.environ.get("TMPDIR", "/tmp")
INSTALL = "make vllm"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default=os.path.join(TMP, "pdfleet-bench-small"),
        help="HF model directory; created with `pdfleet model init --preset small` (600 MB fp32) if missing",
    )
    p.add_argument("--threads", type=int, default=2, help="compute threads of each engine")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every measurement (medians reported)")
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
        "--smoke",
        action="store_true",
        help="a check, not a measurement: tiny model, 6 short requests, 1 repetition, vLLM eager",
    )
    p.add_argument("--vllm-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    p.add_argument("--max-model-len", type=int, default=1024, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.smoke:
        a.model = os.path.join(TMP, "pdfleet-bench-tiny") if a.model == p.get_default("model") else a.model
        a.reps, a.requests, a.prompt_len, a.output_len = 1, 6, "8,48", "4,16"
        a.bs1_tokens, a.prefix, a.vllm_eager, a.kv_gib = 8, 64, True, 0.25
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


# == the vLLM side: runs under .venv-vllm's python ================================================
def vllm_child(a: argparse.Namespace) -> int:
    """Serve commands (one JSON line each on stdin) with one vLLM `LLM`; answers on the original stdout."""
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's own logs go to stderr

    def send(obj) -> None:
        reply.write(json.dumps(obj) + "\n")

    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    llm = LLM(
        model=a.model,
        dtype=a.dtype,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.budget,
        max_model_len=a.max_model_len,
        enable_prefix_caching=True,
        enforce_eager=a.vllm_eager,
        seed=0,
    )
    engine = llm.llm_engine

    def greedy(n: int, kind=RequestOutputKind.FINAL_ONLY) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False, output_kind=kind)

    def stream(prompt: list[int], n: int) -> tuple[list[int], list[float], float]:
        """One request through LLMEngine.step(): its tokens, the time each arrived, and its start."""
        rid = f"r{time.monotonic_ns()}"
        start = time.perf_counter()
        engine.add_request(rid, {"prompt_token_ids": prompt}, greedy(n, RequestOutputKind.DELTA))
        tokens, stamps = [], []
        while engine.has_unfinished_requests():
            for out in engine.step():
                new = list(out.outputs[0].token_ids)
                if new:
                    stamps.append(time.perf_counter())
                    tokens += new
        return tokens, stamps, start

    llm.generate([{"prompt_token_ids": [11, 12, 13, 14]}], greedy(4), use_tqdm=False)  # warm-up
    send({"ready": True, "version": vllm.__version__, "startup_s": time.perf_counter() - t0})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "quit":
            break
        if op == "mixed":
            prompts = [{"prompt_token_ids": p} for p, _ in cmd["work"]]
            params = [greedy(n) for _, n in cmd["work"]]
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            send({"wall_s": wall, "tokens": tokens})
        elif op == "decode":
            tokens, stamps, _ = stream(cmd["prompt"], cmd["n"] + 1)
            send({"s_per_token": (stamps[-1] - stamps[0]) / (len(tokens) - 1), "tokens": tokens})
        elif op == "ttft":
            tokens, stamps, start = stream(cmd["prompt"], 1)
            send({"ttft_s": stamps[0] - start, "tokens": tokens})
        else:
            send({"error": f"unknown op {op!r}"})
    return 0


def vllm_python() -> str:
    return os.environ.get("PDFLEET_VLLM_PYTHON") or os.path.join(REPO, ".venv-vllm", "bin", "python")


def check_vllm_runtime() -> str:
    """vLLM's version, or exit 2 naming the command that installs the runtime."""
    py = vllm_python()
    if not os.access(py, os.X_OK):
        raise SystemExit(f"bench/peer.py: the vLLM runtime is not installed ({py} is missing); run `{INSTALL}`")
    probe = subprocess.run(
        [py, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, timeout=300
    )
    if probe.returncode != 0:
        tail = probe.stderr.strip()[-600:]
        raise SystemExit(f"bench/peer.py: the vLLM runtime at {py} cannot import vllm ({tail}); run `{INSTALL}`")
    return probe.stdout.strip().splitlines()[-1]


def cpu_bind(threads: int) -> str:
    """The first `threads` cores this process may use, as VLLM_CPU_OMP_THREADS_BIND takes them."""
    cores = sorted(os.sched_getaffinity(0))[:threads]
    return ",".join(str(c) for c in cores)


class VllmPeer:
    """A child process holding one vLLM `LLM`; `call` sends a command and waits for its answer."""

    def __init__(self, a: argparse.Namespace, dtype: str, max_model_len: int):
        self.log = tempfile.NamedTemporaryFile(prefix=f"peer-vllm-{dtype}-", suffix=".log", dir=TMP, delete=False)
        args = [
            vllm_python(),
            os.path.abspath(__file__),
            "--vllm-child",
            "--model",
            a.model,
            "--dtype",
            dtype,
            "--max-num-seqs",
            str(a.max_num_seqs),
            "--budget",
            str(a.budget),
            "--max-model-len",
            str(max_model_len),
        ]
        if a.vllm_eager:
            args.append("--vllm-eager")
        env = {
            **os.environ,
            "VLLM_CPU_OMP_THREADS_BIND": cpu_bind(a.threads),
            "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(a.kv_gib))),
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # the bind decides vLLM's threads
            env.pop(name, None)
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
        self.version, self.startup_s = hello["version"], hello["startup_s"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=60)
            with open(self.log.name, errors="replace") as f:
                tail = f.read()[-4000:]
            raise RuntimeError(f"vLLM child exited ({self.proc.returncode}); log {self.log.name}:\n{tail}")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"vLLM child: {out['error']}")
        return out

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=10)
        try:  # vLLM's engine-core process, if it outlived its parent
            os.killpg(self.proc.pid, 9)
        except ProcessLookupError:
            pass
        os.unlink(self.log.name)


# == the pdfleet side ===============================================================================
def pdfleet_mixed(engine, work) -> tuple[float, list[list[int]]]:
    from pdfleet_worker.sampling_params import SamplingParams

    ids = [f"m{i}-{time.monotonic_ns()}" for i in range(len(work))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    t = time.perf_counter()
    for rid, (prompt, n) in zip(ids, work):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
    wall = time.perf_counter() - t
    return wall, [tokens[rid] for rid in ids]


def pdfleet_stream(engine, prompt: list[int], n: int) -> tuple[list[int], list[float], float]:
    from pdfleet_worker.sampling_params import SamplingParams

    start = time.perf_counter()
    engine.add_request(f"s{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    tokens, stamps = [], []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.new_token_ids:
                stamps.append(time.perf_counter())
                tokens += o.new_token_ids
    return tokens, stamps, start


def load_engine_bench():
    """bench/engine.py as a module: the bandwidth reading and the weight-bytes floor are its own."""
    spec = importlib.util.spec_from_file_location("pdfleet_bench_engine", os.path.join(HERE, "engine.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def disagreements(ours: list[list[int]], theirs: list[list[int]]) -> list[int]:
    """Index of the first differing token of every sequence pair that differs (-1 for a length mismatch)."""
    out = []
    for a, b in zip(ours, theirs, strict=True):
        if a != b:
            out.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), -1))
    return out


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_dtype(a, dtype: str, work, bs1_prompt, prefixes, weight_bytes, eb, cfg) -> dict:
    """Every measurement of one dtype, both engines alternating; returns the raw samples."""
    import torch

    from pdfleet_worker.config import EngineConfig
    from pdfleet_worker.engine.llm_engine import LLMEngine

    max_len = max(len(p) + n for p, n in work)
    max_len = max(max_len, len(bs1_prompt) + a.bs1_tokens + 2, a.prefix + 17)
    max_model_len = 1 << (max_len - 1).bit_length()
    progress(f"{dtype}: starting vLLM ({'eager' if a.vllm_eager else 'torch.compile'}; about 1-2 minutes)")
    peer = VllmPeer(a, dtype, max_model_len)
    try:
        progress(f"{dtype}: vLLM {peer.version} ready in {peer.startup_s:.0f} s; loading the pdfleet engine")
        t = time.perf_counter()
        eng = LLMEngine(
            EngineConfig(
                model=a.model,
                dtype=dtype,
                max_num_seqs=a.max_num_seqs,
                max_num_batched_tokens=a.budget,
                kv_cache_memory_bytes=int(a.kv_gib * (1 << 30)),
                max_model_len=max_model_len,
                num_threads=a.threads,
            ),
            load_tokenizer=False,
        )
        warm_s = eng.warm_up()
        startup = time.perf_counter() - t
        torch.set_num_threads(a.threads)
        s = {k: [] for k in ("mixed", "v_mixed", "dec", "v_dec", "bw", "ttft", "v_ttft", "ttft_cold", "v_ttft_cold")}
        s.update(
            startup_s=startup, warm_up_s=warm_s, v_startup_s=peer.startup_s, version=peer.version, bad=[], compared=0
        )
        produced = sum(n for _, n in work)

        def compare(label, ours, theirs):
            s["compared"] += len(ours)
            for i in disagreements(ours, theirs):
                s["bad"].append(f"{label}@{i}")

        for rep in range(a.reps):
            first_ours = rep % 2 == 0
            progress(
                f"{dtype}: repetition {rep + 1}/{a.reps} (mixed, batch-1 decode, shared-prefix TTFT); "
                f"{'pdfleet' if first_ours else 'vLLM'} first"
            )
            for ours in (first_ours, not first_ours):
                if ours:
                    wall, ours_tokens = pdfleet_mixed(eng, work)
                    s["mixed"].append(produced / wall)
                else:
                    r = peer.call(op="mixed", work=work)
                    s["v_mixed"].append(produced / r["wall_s"])
                    theirs_tokens = r["tokens"]
            assert all(len(t) == n for t, (_, n) in zip(ours_tokens, work)), "pdfleet produced every requested token"
            if rep == 0:
                for i, (x, y) in enumerate(zip(ours_tokens, theirs_tokens)):
                    compare(f"mixed[{i}]", [x], [y])
            for ours in (first_ours, not first_ours):
                if ours:
                    s["bw"].append(eb.read_bandwidth_gbs())
                    toks, stamps, _ = pdfleet_stream(eng, bs1_prompt, a.bs1_tokens + 1)
                    s["dec"].append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
                else:
                    r = peer.call(op="decode", prompt=bs1_prompt, n=a.bs1_tokens)
                    s["v_dec"].append(r["s_per_token"])
                    v_toks = r["tokens"]
            if rep == 0:
                compare("bs1", [toks], [v_toks])
            prefix, tails = prefixes[rep]
            for ours in (first_ours, not first_ours):
                for j, tail in enumerate(tails):
                    if ours:
                        toks, stamps, start = pdfleet_stream(eng, prefix + tail, 1)
                        s["ttft_cold" if j == 0 else "ttft"].append(stamps[0] - start)
                    else:
                        r = peer.call(op="ttft", prompt=prefix + tail)
                        s["v_ttft_cold" if j == 0 else "v_ttft"].append(r["ttft_s"])
            progress(
                f"{dtype}: mixed {s['mixed'][-1]:.0f} vs {s['v_mixed'][-1]:.0f} tok/s, bs1 "
                f"{s['dec'][-1] * 1e3:.2f} vs {s['v_dec'][-1] * 1e3:.2f} ms/tok, shared-prefix TTFT "
                f"{s['ttft'][-1] * 1e3:.1f} vs {s['v_ttft'][-1] * 1e3:.1f} ms (pdfleet vs vLLM)"
            )
        assert eng.is_idle_and_whole(), "pdfleet engine ends idle with every block free"
        stats = eng.stats()
        s["prefix_hits"] = stats.prefix_cache_hits_total
        del eng
    finally:
        peer.close()
    return s


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.vllm_child:
        return vllm_child(a)
    version = check_vllm_runtime()
    import torch

    torch.set_num_threads(a.threads)
    from pdfleet_worker.config import ModelConfig
    from pdfleet_worker.model import model_init

    if not os.path.isfile(os.path.join(a.model, "model.safetensors")):
        preset = "tiny" if a.smoke else "small"
        progress(f"creating {a.model} (pdfleet model init --preset {preset})")
        model_init.init_model(a.model, preset, seed=0)
    cfg = ModelConfig.from_dir(a.model)
    eb = load_engine_bench()
    work = mixed_workload(a.requests, span(a.prompt_len), span(a.output_len), cfg.vocab_size)
    rng = random.Random(1)
    bs1_prompt = [rng.randrange(8, cfg.vocab_size) for _ in range(32)]
    prefixes = []
    for rep in range(a.reps):  # a fresh prefix per repetition; cold request, then one sharing its prefix
        r = random.Random(100 + rep)
        prefix = [r.randrange(8, cfg.vocab_size) for _ in range(a.prefix)]
        prefixes.append((prefix, [[r.randrange(8, cfg.vocab_size) for _ in range(16)] for _ in range(2)]))
    weight_bytes = eb.weight_bytes_per_token(a.model, 4)
    dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    began = time.perf_counter()
    runs = {d: run_dtype(a, d, work, bs1_prompt, prefixes, weight_bytes, eb, cfg) for d in dtypes}

    med = statistics.median

    def ratios(num, den):
        return [x / y for x, y in zip(num, den)]

    def fmt(xs, scale=1.0, digits=2):
        return "[" + ", ".join(f"{x * scale:.{digits}f}" for x in xs) + "]"

    short = {"float32": "fp32", "bfloat16": "bf16"}
    result: dict = {}
    rows = []
    for d, s in runs.items():
        k = short.get(d, d)
        r_mixed = ratios(s["mixed"], s["v_mixed"])
        r_bs1 = ratios(s["v_dec"], s["dec"])
        r_ttft = ratios(s["ttft"], s["v_ttft"])
        result[f"mixed_vs_vllm_{k}"] = round(med(r_mixed), 3)
        result[f"bs1_vs_vllm_{k}"] = round(med(r_bs1), 3)
        result[f"prefix_ttft_vs_vllm_{k}"] = round(med(r_ttft), 3)
        result[f"pdfleet_mixed_tok_s_{k}"] = round(med(s["mixed"]), 1)
        result[f"vllm_mixed_tok_s_{k}"] = round(med(s["v_mixed"]), 1)
        result[f"pdfleet_bs1_ms_{k}"] = round(med(s["dec"]) * 1e3, 2)
        result[f"vllm_bs1_ms_{k}"] = round(med(s["v_dec"]) * 1e3, 2)
        result[f"token_disagreements_{k}"] = len(s["bad"])
        result[f"tokens_compared_{k}"] = s["compared"]
        rows += [
            (f"pdfleet mixed ({k})", f"{med(s['mixed']):.1f} tok/s", f"{a.requests} requests {fmt(s['mixed'], 1, 1)}"),
            (f"vLLM mixed ({k})", f"{med(s['v_mixed']):.1f} tok/s", fmt(s["v_mixed"], 1, 1)),
            (f"pdfleet bs1 decode ({k})", f"{med(s['dec']) * 1e3:.2f} ms/tok", fmt(s["dec"], 1e3)),
            (f"vLLM bs1 decode ({k})", f"{med(s['v_dec']) * 1e3:.2f} ms/tok", fmt(s["v_dec"], 1e3)),
            (
                f"pdfleet TTFT cold / shared ({k})",
                f"{med(s['ttft_cold']) * 1e3:.0f} / {med(s['ttft']) * 1e3:.1f} ms",
                f"{a.prefix}-token prefix + 16 {fmt(s['ttft'], 1e3, 1)}",
            ),
            (
                f"vLLM TTFT cold / shared ({k})",
                f"{med(s['v_ttft_cold']) * 1e3:.0f} / {med(s['v_ttft']) * 1e3:.1f} ms",
                fmt(s["v_ttft"], 1e3, 1),
            ),
            (f"ratio mixed pdfleet / vLLM ({k})", f"{med(r_mixed):.2f}", f"target >= 1.0 {fmt(r_mixed)}"),
            (f"ratio bs1 speed pdfleet / vLLM ({k})", f"{med(r_bs1):.2f}", f"target >= 1.0 {fmt(r_bs1)}"),
            (f"ratio shared-prefix TTFT pdfleet / vLLM ({k})", f"{med(r_ttft):.2f}", f"target <= 1.0 {fmt(r_ttft)}"),
            (
                f"startup pdfleet / vLLM ({k})",
                f"{s['startup_s']:.1f} / {s['v_startup_s']:.1f} s",
                f"pdfleet warm_up {s['warm_up_s']:.1f} s",
            ),
            (f"token disagreements ({k})", f"{len(s['bad'])} of {s['compared']}", " ".join(s["bad"][:12])),
        ]
    if "float32" in runs:
        s = runs["float32"]
        floors = [weight_bytes / (bw * 1e9) for bw in s["bw"]]
        r_mbu = ratios(floors, s["dec"])
        result["bs1_mbu"] = round(med(r_mbu), 3)
        result["read_gbs"] = round(med(s["bw"]), 1)
        result["prefix_ttft_vs_vllm"] = result["prefix_ttft_vs_vllm_fp32"]
        rows += [
            ("memory read bandwidth", f"{med(s['bw']):.1f} GB/s", f"1 GiB sum {fmt(s['bw'], 1, 1)}"),
            (
                "bs1 MBU fp32 (floor / pdfleet)",
                f"{med(r_mbu):.2f}",
                f"target >= 0.80 floor {weight_bytes / 1e6:.0f} MB / bandwidth {fmt(r_mbu)}",
            ),
        ]
    result["token_disagreements"] = sum(len(s["bad"]) for s in runs.values())
    result["tokens_compared"] = sum(s["compared"] for s in runs.values())
    result["vllm_version"] = version
    result.update(
        model=os.path.basename(os.path.normpath(a.model)),
        model_params=cfg.num_params,
        threads=a.threads,
        requests=a.requests,
        reps=a.reps,
        vllm_compiled=not a.vllm_eager,
        wall_s=round(time.perf_counter() - began, 1),
    )
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>18}  {note}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
