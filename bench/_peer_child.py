"""One engine of bench/peer.py in a child process: vLLM's offline `LLMEngine` (under .venv-vllm) or pdfleet's
(under .venv), behind one command loop, so both are constructed, warmed and timed by the same code; bench/peer.py
starts it as `peer.py --child vllm|pdfleet` and sends one JSON command per line.

Commands (answers are one JSON line on the original stdout; the engines' logs go to stderr):
  {"op": "batch", "work": [[prompt, n], ...]}  all submitted at once, run to the end: wall_s, tokens
  {"op": "ttft", "prompt": [...]}              one request alone: ttft_s (submission to its first token), tokens
  {"op": "decode", "prompt": [...], "n": N}    one request alone, N + 1 tokens: s_per_token between first and last
  {"op": "bandwidth"}                          pdfleet only: bench/engine.py's 1 GiB read, GB/s
  {"op": "idle"}                               idle_and_whole: no request left (and, pdfleet, every block free)
  {"op": "quit"}
Stdlib only at import time: vLLM's engine-core process re-imports the main module without bench/ on its path.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time


class PdfleetSide:
    """pdfleet's LLMEngine, constructed and warmed as `pdfleet worker` does before it says ready."""

    name = "pdfleet"

    def __init__(self, a):
        import torch

        from pdfleet_worker.config import EngineConfig
        from pdfleet_worker.engine.llm_engine import LLMEngine
        from pdfleet_worker.sampling_params import SamplingParams

        torch.set_num_threads(a.threads)
        self._params = SamplingParams
        self.engine = LLMEngine(
            EngineConfig(
                model=a.model,
                dtype=a.dtype,
                max_num_seqs=a.max_num_seqs,
                max_num_batched_tokens=a.budget,
                kv_cache_memory_bytes=int(a.kv_gib * (1 << 30)),
                max_model_len=a.max_model_len,
                num_threads=a.threads,
            ),
            load_tokenizer=False,
        )
        self.own_warm_up_s = self.engine.warm_up()  # NOTE: what server/app.py runs before the worker says ready
        self.version = "HEAD"

    def submit(self, rid: str, prompt: list[int], n: int, stream: bool) -> None:
        del stream  # pdfleet's step() always returns deltas
        self.engine.add_request(rid, prompt, self._params(max_tokens=n, temperature=0, ignore_eos=True))

    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> list[tuple[str, list[int]]]:
        return [(o.request_id, o.new_token_ids) for o in self.engine.step()]

    def idle_and_whole(self) -> bool:
        return self.engine.is_idle_and_whole()


class VllmSide:
    """vLLM's offline engine (`LLM(...).llm_engine`), constructed with the bench's limits; `LLM` runs its own
    profiling pass and, compiled, its graph warm-up before it returns."""

    name = "vllm"

    def __init__(self, a):
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.version = vllm.__version__
        self._params, self._kind = SamplingParams, RequestOutputKind
        self.llm = LLM(
            model=a.model,
            dtype=a.dtype,
            max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=a.budget,
            max_model_len=a.max_model_len,
            enable_prefix_caching=True,
            enforce_eager=a.vllm_eager,
            seed=0,
        )
        self.engine = self.llm.llm_engine
        self.own_warm_up_s = None

    def submit(self, rid: str, prompt: list[int], n: int, stream: bool) -> None:
        # NOTE: FINAL_ONLY is what LLM.generate asks for; streaming requests take deltas, as pdfleet's do.
        kind = self._kind.DELTA if stream else self._kind.FINAL_ONLY
        params = self._params(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False, output_kind=kind)
        self.engine.add_request(rid, {"prompt_token_ids": prompt}, params)

    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> list[tuple[str, list[int]]]:
        return [(o.request_id, list(o.outputs[0].token_ids)) for o in self.engine.step()]

    def idle_and_whole(self) -> bool:
        return not self.engine.has_unfinished_requests()


def drive(side, work: list, stream: bool) -> tuple[float, list[list[int]], list[list[float]]]:
    """Submit every (prompt, n) at once and step until all finish: the start time, each request's tokens and
    the time each of its token deltas arrived."""
    base = f"{side.name}-{time.monotonic_ns()}"
    ids = [f"{base}-{i}" for i in range(len(work))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    stamps: dict[str, list[float]] = {rid: [] for rid in ids}
    start = time.perf_counter()
    for rid, (prompt, n) in zip(ids, work):
        side.submit(rid, prompt, n, stream)
    while side.busy():
        for rid, new in side.step():
            if new:
                stamps[rid].append(time.perf_counter())
                tokens[rid] += new
    return start, [tokens[r] for r in ids], [stamps[r] for r in ids]


def answer(side, cmd: dict, bandwidth) -> dict:
    op = cmd["op"]
    if op == "batch":
        start, tokens, stamps = drive(side, cmd["work"], stream=False)
        return {"wall_s": max(s[-1] for s in stamps) - start, "tokens": tokens}
    if op == "ttft":
        start, tokens, stamps = drive(side, [(cmd["prompt"], 1)], stream=True)
        return {"ttft_s": stamps[0][0] - start, "tokens": tokens[0]}
    if op == "decode":
        _, tokens, stamps = drive(side, [(cmd["prompt"], cmd["n"] + 1)], stream=True)
        s = stamps[0]
        if len(tokens[0]) != len(s):
            return {"error": f"{side.name} streamed {len(tokens[0])} tokens in {len(s)} deltas"}
        return {"s_per_token": (s[-1] - s[0]) / (len(s) - 1), "tokens": tokens[0]}
    if op == "bandwidth" and bandwidth is not None:
        return {"gbs": bandwidth()}
    if op == "idle":
        return {"idle_and_whole": side.idle_and_whole()}
    return {"error": f"{side.name}: unknown op {op!r}"}


def engine_bench_bandwidth():
    """bench/engine.py's read-bandwidth probe (the figure bs1_mbu divides by), loaded from its file."""
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("pdfleet_bench_engine", os.path.join(here, "engine.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.read_bandwidth_gbs


def serve(a) -> int:
    """Construct one engine, say ready, then answer commands until quit or end of input."""
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # NOTE: the engines print to stdout; only answers may go there

    def send(obj: dict) -> None:
        reply.write(json.dumps(obj) + "\n")

    side = PdfleetSide(a) if a.child == "pdfleet" else VllmSide(a)
    bandwidth = engine_bench_bandwidth() if a.child == "pdfleet" else None
    send({"ready": True, "version": side.version, "own_warm_up_s": side.own_warm_up_s, "pid": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        send(answer(side, cmd, bandwidth))
    return 0
