"""The engine's CUDA path on a GPU in one prepared run (issue 29): greedy tokens against transformers, decode and
prefill speed of a Llama-3.1-8B-shaped model with CUDA graphs on and off, int8 weights against bf16; a session lent a
device runs it, tests/worker/engine/test_gpu_script.py runs --cpu-smoke.

python bench/gpu.py [--reps 5] [--peak-hbm-tbps 4.8] [--peak-tflops 989] [--only SECTIONS] [--out FILE]
python bench/gpu.py --cpu-smoke     # the same code at toy sizes on CPU, the Triton kernel interpreted

Sections, in this order (a failing section is recorded under "errors" and the run goes on; exit 1 if any, or
if tokens_match is false):
- ceilings: a device-to-device copy (bytes read + written) and a bf16 matrix product, measured here.
- correctness: a small Llama (GQA, llama3 RoPE, untied) and Qwen2 (qkv bias, MQA, tied, sharded), fp32 and
  bf16, CUDA graphs on and off: the engine's greedy tokens and logits against transformers.generate in the
  same dtype on the same device and weights. A differing token is a near-tie when the oracle's top-2 logits
  are closer than NEAR_TIE (fp32) or BF16_NEAR_TIE x max|logit| (bf16); near-ties are counted (the sequence
  is compared no further), any other difference is a mismatch and makes tokens_match false.
- bs1, b64, prefill: a Llama-3.1-8B-shaped model (random bf16 weights, built on the device: nothing can be
  downloaded), the engine with CUDA graphs (as served), the same engine with them off, the engine with int8
  weights, and transformers.generate (eager, static batch) on the same weights, in a rotating order every
  repetition: batch-1 decode (ms per token, HBM fraction), 64 sequences decoding (tokens/s of the
  decode-only steps), 8 x 2,048-token prompts (prefill tokens/s). Fresh random prompts every run, so the
  prefix cache never hits.
Ends with one JSON line; on a GPU it is also a `pdfleet simulate --calibration` line for --class-name.
"""

from __future__ import annotations

if not __package__:  # run as a script; imported as `bench.gpu` (tests) bench/ is not on sys.path
    import _sys_path  # noqa: F401,I001  -- first: keeps bench/operator.py from shadowing the stdlib (see it)

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
# NVIDIA's H200 SXM datasheet: 141 GB of HBM3e at 4.8 TB/s; 989 TFLOP/s dense bf16 (1,979 with sparsity).
# examples/acceleratorclasses.yaml's h200-141gb carries the same two (memoryBandwidthGBps 4800, peakTflops 989).
H200_HBM_TBPS = 4.8
H200_BF16_TFLOPS = 989.0
# Near-ties (see the module docstring): fp32 as tests/worker/oracle.py; bf16 as
# tests/worker/layers/test_quantization.py.
NEAR_TIE = 1e-4
BF16_NEAR_TIE = 2e-2
SECTIONS = ("ceilings", "correctness", "bs1", "b64", "prefill")

# meta-llama/Llama-3.1-8B's config.json (the shapes; the weights here are random).
LLAMA_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
# The --cpu-smoke stand-in: the same architecture at toy size.
LLAMA_TOY = dict(
    LLAMA_8B,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rope_scaling=dict(LLAMA_8B["rope_scaling"], original_max_position_embeddings=64),
)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What each section runs; FULL on a GPU, SMOKE on CPU (the Triton interpreter takes ~0.1-0.5 s per kernel call)."""

    reps: int
    correct_hidden: int  # the small correctness models' hidden size (head_dim 32 or 16: powers of two)
    correct_prompts: int  # prompts of 1..40 tokens, and one more of correct_long tokens
    correct_long: int  # prefilled in chunks of correct_budget tokens while the others decode
    correct_budget: int
    correct_new: int
    bs1_prompt: int
    bs1_new: int
    batch: int  # "b64"
    batch_prompt: int
    batch_new: int
    prefill_seqs: int
    prefill_len: int
    warm_new: int  # tokens of each untimed warm-up run
    kv_bytes: int  # each speed engine's KV pool
    copy_bytes: int  # ceilings: each copy buffer
    matmul_n: int


FULL = Sizes(
    reps=5,
    correct_hidden=128,
    correct_prompts=7,
    correct_long=100,
    correct_budget=64,
    correct_new=16,
    bs1_prompt=512,
    bs1_new=128,
    batch=64,
    batch_prompt=128,
    batch_new=128,
    prefill_seqs=8,
    prefill_len=2048,
    warm_new=4,
    kv_bytes=6 << 30,
    copy_bytes=1 << 30,
    matmul_n=8192,
)
SMOKE = Sizes(
    reps=1,
    correct_hidden=64,
    correct_prompts=2,
    correct_long=20,
    correct_budget=16,
    correct_new=4,
    bs1_prompt=8,
    bs1_new=3,
    batch=2,
    batch_prompt=8,
    batch_new=3,
    prefill_seqs=2,
    prefill_len=32,
    warm_new=2,
    kv_bytes=4 << 20,
    copy_bytes=8 << 20,
    matmul_n=128,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="toy sizes on CPU: the CUDA path's attention through Triton's interpreter, no CUDA graphs",
    )
    p.add_argument("--reps", type=int, help="repetitions of each speed measurement (default 5; smoke 1)")
    p.add_argument(
        "--peak-hbm-tbps",
        type=float,
        default=H200_HBM_TBPS,
        help="HBM bandwidth the fractions are taken of, TB/s (default: the H200 datasheet's 4.8)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=H200_BF16_TFLOPS,
        help="bf16 dense TFLOP/s the prefill MFU is taken of (default: the H200 datasheet's 989)",
    )
    p.add_argument(
        "--class-name",
        default="h200-141gb",
        help="the AcceleratorClass the result line calibrates (pdfleet simulate --calibration)",
    )
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    p.add_argument(
        "--deadline-s",
        type=float,
        default=360.0,
        help="no new section or repetition starts after this many seconds (the device call's limit)",
    )
    p.add_argument("--out", help="also write the result (rewritten after every section) to this file")
    a = p.parse_args(argv)
    a.sections = [s.strip() for s in a.only.split(",") if s.strip()]
    unknown = sorted(set(a.sections) - set(SECTIONS))
    if unknown:
        p.error(f"--only: unknown sections {unknown}; choose from {SECTIONS}")
    a.sizes = dataclasses.replace(SMOKE if a.cpu_smoke else FULL, **({"reps": a.reps} if a.reps else {}))
    if a.sizes.reps < 1:
        p.error("--reps must be >= 1")
    return a


def prepare_environment(smoke: bool) -> None:
    """Before anything imports triton or the engine. On a GPU nothing changes. With --cpu-smoke: Triton's
    interpreter (triton unpacked into build/triton by `make triton` when .venv has none), and the plain-PyTorch
    CPU paths (no C++ kernels, no linear probe), which are the ops the CUDA path runs."""
    if not smoke:
        return
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["PDFLEET_CPU_KERNELS"] = "0"
    os.environ["PDFLEET_LINEAR_KERNEL"] = "torch"
    os.environ.setdefault("PDFLEET_CPU_BIND", "off")
    # NOTE: one thread: at toy sizes a second OpenMP thread only adds a barrier per op, which costs ~25 ms
    # on a loaded shared machine (measured on the 2-core development VM).
    torch.set_num_threads(1)
    unpacked = REPO / "build" / "triton"
    if importlib.util.find_spec("triton") is None and (unpacked / "triton" / "__init__.py").is_file():
        sys.path.insert(0, str(unpacked))
    if importlib.util.find_spec("triton") is None:
        raise SystemExit("--cpu-smoke needs triton for its interpreter: `make triton` unpacks it into build/triton")
    from pdfleet_worker.layers import quantized_linear

    # NOTE: on CPU Int8Linear runs torch's CPU int8 kernel; the smoke takes the path every other device takes
    # (the weight widened per call), which is what the GPU run times.
    quantized_linear.Int8Linear.forward = quantized_linear.Int8Linear._generic


# -- the comparison -------------------------------------------------------------------------------
@dataclasses.dataclass
class Agreement:
    """Greedy tokens of the engine against the oracle's, sequence by sequence, up to the first difference."""

    sequences: int = 0
    compared: int = 0  # token positions compared
    near_ties: int = 0  # differing tokens where the oracle's top-2 logits were within the tie bound
    mismatches: int = 0  # any other difference (a wrong token, a missing or extra one)
    max_logit_diff: float = 0.0  # over the positions compared, before the first difference
    first_mismatch: str | None = None

    @property
    def tokens_match(self) -> bool:
        return self.compared > 0 and self.mismatches == 0

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "tokens_match": self.tokens_match}


def compare_greedy(
    got: list[list[int]],
    got_logits: list[list[torch.Tensor]],
    want: list[list[int]],
    want_logits: list[list[torch.Tensor]],
    *,
    tie_abs: float = 0.0,
    tie_rel: float = 0.0,
) -> Agreement:
    """Tokens must be equal; where they first differ, the oracle's top-2 gap decides near-tie (counted) or
    mismatch. A sequence stops being compared at its first difference (the two continue from different tokens).
    A near-tie's bound: max(tie_abs, tie_rel x max|oracle logit| at that position)."""
    if len(got) != len(want):
        raise ValueError(f"{len(got)} engine sequences against {len(want)} oracle sequences")
    agreement = Agreement(sequences=len(want))
    for i, (toks, rows, ref, ref_rows) in enumerate(zip(got, got_logits, want, want_logits)):
        for j, expected in enumerate(ref):
            if j >= len(toks):
                agreement.mismatches += 1
                agreement.first_mismatch = (
                    agreement.first_mismatch or f"sequence {i}: {len(toks)} tokens, {len(ref)} expected"
                )
                break
            agreement.compared += 1
            ref_row = ref_rows[j].float().cpu()
            if j < len(rows):
                diff = float((rows[j].float().cpu() - ref_row).abs().max())
                agreement.max_logit_diff = max(agreement.max_logit_diff, diff)
            if toks[j] == expected:
                continue
            top2 = torch.topk(ref_row, 2).values
            gap = float(top2[0] - top2[1])
            if gap <= max(tie_abs, tie_rel * float(ref_row.abs().max())):
                agreement.near_ties += 1
            else:
                agreement.mismatches += 1
                agreement.first_mismatch = agreement.first_mismatch or (
                    f"sequence {i} position {j}: {toks[j]} != {expected} (oracle's top-2 gap {gap:.3g})"
                )
            break
        else:
            if len(toks) > len(ref):
                agreement.mismatches += 1
                agreement.first_mismatch = (
                    agreement.first_mismatch or f"sequence {i}: {len(toks)} tokens, {len(ref)} expected"
                )
    return agreement


# -- models ---------------------------------------------------------------------------------------
def hf_config(kind: str, **shape):
    import transformers

    common = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if kind == "llama":
        return transformers.LlamaConfig(**shape, **common)
    return transformers.Qwen2Config(**shape, **common)


def small_shapes(kind: str, hidden: int) -> dict:
    """The correctness models (as tests/worker/oracle.py's, a little larger on a GPU)."""
    if kind == "llama":
        return dict(
            vocab_size=512,
            hidden_size=hidden,
            intermediate_size=2 * hidden + 32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=512,
            initializer_range=0.1,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    return dict(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden + 32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
        initializer_range=0.1,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    )


def random_hf(cfg, dtype: torch.dtype, device: torch.device, seed: int):
    """A transformers model with random weights, initialised where it will run; biases and norm weights random
    too (HF starts them at 0 and 1, which would hide a dropped bias or norm)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    hf.generation_config.eos_token_id = None
    return hf.eval()


@torch.inference_mode()
def engine_weights(hf, cfg, dtype: torch.dtype, device: torch.device, quantization: str):
    """The engine's network filled from a transformers model's tensors where they are (no checkpoint written):
    the loader's own name mapping (fused q/k/v and gate/up rows) and Int8Linear.fill_rows for int8."""
    from pdfleet_worker.layers.quantized_linear import Int8Linear, replace_linears
    from pdfleet_worker.model import loader
    from pdfleet_worker.model.llama import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
        if quantization == "int8":
            replace_linears(model)
    model = model.to_empty(device=device).to(dtype)
    if cfg.tie_word_embeddings and quantization == "none":
        model.lm_head.weight = model.embed_tokens.weight
    filled: dict[int, int] = {}
    for name, tensor in hf.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        # NOTE: loader._target is the loader's private name -> (destination, rows) map; reusing it keeps this
        # in-memory path the loader's mapping (load_model itself reads safetensors files only).
        target = loader._target(model, cfg, name)
        if target is None:
            continue
        dest, rows = target
        if isinstance(dest, Int8Linear):
            dest.fill_rows(rows, tensor)
        else:
            (dest if rows is None else dest[rows]).copy_(tensor)
        filled[id(dest)] = filled.get(id(dest), 0) + tensor.shape[0]
    if cfg.tie_word_embeddings and isinstance(model.lm_head, Int8Linear):
        model.lm_head.fill_rows(None, model.embed_tokens.weight)
        filled[id(model.lm_head)] = model.lm_head.out_features
    missing = [n for n, p in model.named_parameters() if filled.get(id(p), 0) != p.shape[0]]
    missing += [
        n for n, m in model.named_modules() if isinstance(m, Int8Linear) and filled.get(id(m), 0) != m.out_features
    ]
    assert not missing, f"weights not filled from the transformers model: {missing[:5]}"
    return model.eval()


@contextlib.contextmanager
def weights_given(model):
    """LLMEngine builds its network with llm_engine.load_model(dir, ...); within this block it gets `model`."""
    from pdfleet_worker.engine import llm_engine

    real = llm_engine.load_model
    llm_engine.load_model = lambda *args, **kwargs: model
    try:
        yield
    finally:
        llm_engine.load_model = real


def use_cuda_path(engine) -> dict:
    """The paged backend with its Triton decode kernel, warmed up; on CUDA its decode graphs captured. NOTE: on
    CPU (--cpu-smoke) the backend is switched after construction, as tests/worker/layers/test_triton_attention.py does:
    EngineConfig offers `paged` only through `auto` on CUDA; no graphs (they need CUDA)."""
    runner = engine.model_runner
    if runner.device.type == "cuda":
        if runner.backend != "paged":
            raise RuntimeError(f"auto chose the {runner.backend!r} backend on CUDA: triton is not importable")
    else:
        runner.backend, runner.decode_kernel = "paged", False
    engine.warm_up()
    if runner.device.type == "cuda" and runner.graphs is None:
        raise RuntimeError("warm_up captured no CUDA graphs (PDFLEET_CUDA_GRAPHS=0 set?)")
    return {
        "backend": runner.backend,
        "cuda_graphs": runner.graphs is not None,
        "graph_sizes": sorted(runner.graphs.graphs) if runner.graphs is not None else [],
    }


@contextlib.contextmanager
def graphs_off(engine):
    """The same engine stepping eagerly (ModelRunner replays graphs only when it holds them)."""
    runner = engine.model_runner
    held, runner.graphs = runner.graphs, None
    try:
        yield
    finally:
        runner.graphs = held


def decode_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter and buffer but the input embedding table (a
    decode reads one row of it), unless the table is also the LM head."""
    table = model.embed_tokens.weight
    tied = getattr(model.lm_head, "weight", None) is table
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen or (t is table and not tied):
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


# -- timing ---------------------------------------------------------------------------------------
def synchronizer(device: torch.device):
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def seconds_per_call(fn, device: torch.device, reps: int = 10, warm: int = 3) -> float:
    """Median seconds of fn() after warm-up: CUDA events on a GPU, the wall clock on CPU."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


@dataclasses.dataclass
class EngineRun:
    """One engine run to completion: each decode-only step's seconds and sequences, and the whole run's."""

    decode_s: list[float]
    decode_seqs: list[int]
    total_s: float
    prompt_tokens: int
    tokens: list[list[int]]


def run_engine(engine, prompts: list[list[int]], max_tokens: int, sync) -> EngineRun:
    from pdfleet_worker.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [f"g{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    decode_s, decode_seqs, prompt_tokens = [], [], 0
    sync()
    start = time.perf_counter()
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outs = engine.step()
        sync()
        dt = time.perf_counter() - t
        for o in outs:
            tokens[o.request_id] += o.new_token_ids
        it = engine.last_iteration_stats
        prompt_tokens += it.num_prompt_tokens
        if it.num_prompt_tokens == 0 and it.num_generation_tokens:
            decode_s.append(dt)
            decode_seqs.append(it.num_generation_tokens)
    total = time.perf_counter() - start
    assert all(len(t) == max_tokens for t in tokens.values()), "every requested token is produced"
    return EngineRun(decode_s, decode_seqs, total, prompt_tokens, [tokens[r] for r in ids])


@dataclasses.dataclass
class HFRun:
    """One transformers.generate call: its seconds, and a clock reading after each token it produced."""

    total_s: float
    stamps: list[float]

    @property
    def decode_s(self) -> float:
        """From the first token (the prefill's) to the last: the decode steps alone."""
        return self.stamps[-1] - self.stamps[0]


def hf_generate(hf, prompts: list[list[int]], new_tokens: int, sync) -> HFRun:
    """transformers.generate over equal-length prompts (a static batch, no padding), greedy, exactly new_tokens.
    A stopping criterion that never stops reads the clock after every token (generate syncs each step anyway:
    it checks whether every sequence is done)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Clock(StoppingCriteria):
        def __init__(self):
            self.stamps: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            sync()
            self.stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    clock = Clock()
    ids = torch.tensor(prompts, dtype=torch.long, device=hf.device)
    sync()
    t = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([clock]),
        )
    sync()
    total = time.perf_counter() - t
    assert out.shape == (len(prompts), ids.shape[1] + new_tokens), tuple(out.shape)
    assert len(clock.stamps) == new_tokens, f"{len(clock.stamps)} clock readings for {new_tokens} tokens"
    return HFRun(total, clock.stamps)


def random_prompts(n: int, length: int, vocab: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def rotated(items: list, k: int) -> list:
    k %= len(items)
    return items[k:] + items[:k]


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


# -- sections -------------------------------------------------------------------------------------
class Run:
    """Shared state of one invocation: arguments, device, the clock and the speed models once built."""

    def __init__(self, a: argparse.Namespace):
        self.a, self.sizes = a, a.sizes
        self.device = torch.device("cpu" if a.cpu_smoke else "cuda")
        self.sync = synchronizer(self.device)
        self.start = time.monotonic()
        self.speed = None  # SpeedModels, built by the first speed section
        self.speed_error: str | None = None
        self.results: dict = {}  # what the sections returned so far

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def past_deadline(self) -> bool:
        return self.elapsed() > self.a.deadline_s

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {msg}", file=sys.stderr, flush=True)


def section_ceilings(run: Run) -> dict:
    s, dev = run.sizes, run.device
    src = torch.rand(s.copy_bytes // 2, device=dev).to(torch.bfloat16)
    dst = torch.empty_like(src)
    copy_s = seconds_per_call(lambda: dst.copy_(src), dev)
    n = s.matmul_n
    x, y = torch.randn(n, n, device=dev, dtype=torch.bfloat16), torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    mm_s = seconds_per_call(lambda: x @ y, dev)
    src = dst = x = y = None  # (free the device memory; the lambdas that captured them are done)
    out = {
        "copy_bytes_per_s": 2 * s.copy_bytes / copy_s,
        "matmul_tflops": 2 * n**3 / mm_s / 1e12,
        "copy_buffer_bytes": s.copy_bytes,
        "matmul_n": n,
    }
    run.log(
        f"ceilings: copy {out['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write), bf16 matmul "
        f"{out['matmul_tflops']:.1f} TFLOP/s"
    )
    return out


def section_correctness(run: Run) -> dict:
    import tempfile

    s, dev = run.sizes, run.device
    rng = random.Random(29)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(1, 40))] for _ in range(s.correct_prompts)]
    prompts.append([rng.randrange(512) for _ in range(s.correct_long)])  # chunked over several steps
    graph_settings = (True, False) if dev.type == "cuda" else (False,)
    results = {}
    for kind, seed in (("llama", 1234), ("qwen2", 4321)):
        with tempfile.TemporaryDirectory(prefix="pdfleet-gpu-") as path:
            results.update(_correctness_of(run, kind, seed, path, prompts, graph_settings))
    return {
        "correctness": results,
        "tokens_match": all(r["tokens_match"] for r in results.values()),
        "cuda_graphs_checked": any(k.endswith("graphs-on") for k in results),
        "near_ties": sum(r["near_ties"] for r in results.values()),
        "tokens_compared": sum(r["compared"] for r in results.values()),
    }


def _correctness_of(run: Run, kind: str, seed: int, path: str, prompts: list[list[int]], graph_settings) -> dict:
    """One model saved as a checkpoint (the loader's real path), both dtypes: the oracle's greedy tokens and
    logits, then the engine's with graphs on, then off. NOTE: the graphs-off pass reruns the same prompts on the
    same engine, so its full blocks are prefix-cache hits (the prefill-with-a-past path is compared too)."""
    from pdfleet_worker.config import EngineConfig
    from pdfleet_worker.engine.llm_engine import LLMEngine

    s, dev, results = run.sizes, run.device, {}
    hf32 = random_hf(hf_config(kind, **small_shapes(kind, s.correct_hidden)), torch.float32, torch.device("cpu"), seed)
    hf32.save_pretrained(path, max_shard_size="200KB" if kind == "qwen2" else "1GB")  # qwen2: sharded
    del hf32
    for dtype in ("float32", "bfloat16"):
        want, want_logits = oracle_greedy(path, dtype, dev, prompts, s.correct_new)
        engine = LLMEngine(
            EngineConfig(
                model=path,
                dtype=dtype,
                device=dev.type,
                block_size=16,
                num_kv_blocks=128,
                max_num_seqs=8,
                max_num_batched_tokens=s.correct_budget,
            )
        )
        backend = use_cuda_path(engine)["backend"]
        tie = dict(tie_abs=NEAR_TIE) if dtype == "float32" else dict(tie_rel=BF16_NEAR_TIE)
        for graphs in graph_settings:
            with contextlib.nullcontext() if graphs else graphs_off(engine):
                got, got_logits = engine_greedy(engine, prompts, s.correct_new)
            agreement = compare_greedy(got, got_logits, want, want_logits, **tie)
            key = f"{kind}/{dtype}/graphs-{'on' if graphs else 'off'}"
            results[key] = {**agreement.as_dict(), "backend": backend}
            run.log(
                f"correctness {key}: {agreement.compared} tokens compared, {agreement.near_ties} near-ties, "
                f"{agreement.mismatches} mismatches, max logit diff {agreement.max_logit_diff:.2e}"
            )
        assert engine.is_idle_and_whole(), "the correctness engine kept blocks"
        del engine
    return results


def oracle_greedy(path: str, dtype: str, device: torch.device, prompts: list[list[int]], new: int):
    """transformers.generate, one prompt at a time, in `dtype` on `device`: tokens and raw logits per position."""
    from transformers import AutoModelForCausalLM

    oracle = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    tokens, logits = [], []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        with torch.inference_mode():
            out = oracle.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        tokens.append(out.sequences[0, len(p) :].tolist())
        logits.append([row[0].float().cpu() for row in out.logits])
    return tokens, logits


def engine_greedy(engine, prompts: list[list[int]], new: int):
    """All prompts at once through the engine: tokens and the logits rows it sampled from, per prompt."""
    from pdfleet_worker.sampling_params import SamplingParams

    rows: dict[str, list] = {}
    engine.model_runner.logits_hook = lambda ids, logits: [
        rows.setdefault(r, []).append(logits[i].float().cpu()) for i, r in enumerate(ids)
    ]
    try:
        outs = engine.generate(prompts, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    finally:
        engine.model_runner.logits_hook = None
    return [o.new_token_ids for o in outs], [rows.get(o.request_id, []) for o in outs]


@dataclasses.dataclass
class SpeedModels:
    """The Llama-3.1-8B-shaped model: transformers' bf16 copy, the engine on the same weights in bf16 and int8."""

    hf: object
    bf16: object
    int8: object
    cfg: object  # ModelConfig
    weight_bytes: dict[str, int]  # bf16 / int8: bytes one decode step reads
    kv_bytes_per_token: int
    info: dict


def build_speed_models(run: Run) -> SpeedModels:
    import tempfile

    from pdfleet_worker.config import EngineConfig, ModelConfig
    from pdfleet_worker.engine.llm_engine import LLMEngine

    s, dev = run.sizes, run.device
    shape = LLAMA_TOY if run.a.cpu_smoke else LLAMA_8B
    t = time.monotonic()
    hf = random_hf(hf_config("llama", **shape), torch.bfloat16, dev, seed=8)
    engines, weight_bytes = {}, {}
    with tempfile.TemporaryDirectory(prefix="pdfleet-gpu-8b-") as model_dir:
        hf.config.save_pretrained(model_dir)  # config.json only: the engine reads its shapes from it at start
        cfg = ModelConfig.from_dir(model_dir)
        for quant in ("none", "int8"):
            model = engine_weights(hf, cfg, torch.bfloat16, dev, quant)
            weight_bytes["bf16" if quant == "none" else "int8"] = decode_weight_bytes(model)
            with weights_given(model):
                engines[quant] = LLMEngine(
                    EngineConfig(
                        model=model_dir,
                        dtype="bfloat16",
                        device=dev.type,
                        quantization=quant,
                        block_size=16,
                        kv_cache_memory_bytes=s.kv_bytes,
                        max_num_seqs=s.batch,
                        max_num_batched_tokens=max(s.prefill_seqs * s.prefill_len, s.batch * s.batch_prompt),
                        max_model_len=max(s.prefill_len, s.bs1_prompt, s.batch_prompt)
                        + max(s.bs1_new, s.batch_new, s.warm_new),
                    )
                )
            del model
    paths = {name: use_cuda_path(e) for name, e in engines.items()}
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2  # K and V, bf16
    info = {
        "model": "Llama-3.1-8B shapes, random bf16" if not run.a.cpu_smoke else "toy Llama (smoke)",
        "model_params": cfg.num_params,
        "weight_bytes_bf16": weight_bytes["bf16"],
        "weight_bytes_int8": weight_bytes["int8"],
        "kv_bytes_per_token": per_token,
        "engine_paths": paths,
        "build_s": round(time.monotonic() - t, 1),
    }
    if dev.type == "cuda":
        info["device_memory_allocated_gib"] = round(torch.cuda.memory_allocated(dev) / 2**30, 1)
    run.log(
        f"speed models built in {info['build_s']} s: {cfg.num_params / 1e9:.2f}B params, "
        f"{weight_bytes['bf16'] / 1e9:.2f} GB read per bf16 decode step, {weight_bytes['int8'] / 1e9:.2f} GB int8"
    )
    return SpeedModels(hf, engines["none"], engines["int8"], cfg, weight_bytes, per_token, info)


def speed_models(run: Run) -> SpeedModels:
    """Built and warmed once per invocation; a failed build fails every speed section at once, not each again."""
    if run.speed_error is not None:
        raise RuntimeError(f"the speed models failed to build earlier: {run.speed_error}")
    if run.speed is None:
        try:
            run.speed = build_speed_models(run)
            warm(run)
        except Exception as exc:
            run.speed_error = repr(exc)
            raise
    return run.speed


def warm(run: Run) -> None:
    """One short untimed run of each workload on each variant: kernel selection and allocator growth happen here."""
    m, s, rng = run.speed, run.sizes, random.Random(0)
    vocab = m.cfg.vocab_size
    shapes = [(1, s.bs1_prompt), (s.batch, s.batch_prompt), (s.prefill_seqs, s.prefill_len)]
    for n, length in shapes:
        for engine in (m.bf16, m.int8):
            run_engine(engine, random_prompts(n, length, vocab, rng), s.warm_new, run.sync)
            if engine.model_runner.graphs is not None:
                with graphs_off(engine):
                    run_engine(engine, random_prompts(n, length, vocab, rng), s.warm_new, run.sync)
        hf_generate(m.hf, random_prompts(n, length, vocab, rng), s.warm_new, run.sync)
    run.log("warm-up runs done")


def decode_variants(m: SpeedModels) -> dict:
    """name -> (engine, whether CUDA graphs stay on)."""
    return {"bf16": (m.bf16, True), "bf16_no_graphs": (m.bf16, False), "int8": (m.int8, True)}


def timed_decode(run: Run, batch: int, prompt_len: int, new: int) -> dict[str, list[dict]]:
    """Every repetition, each variant in a rotating order: `batch` fresh prompts for `new` tokens; the engine's
    decode-only steps, transformers.generate's time from its first token to its last."""
    m = speed_models(run)
    rng = random.Random(1000 + batch)
    vocab = m.cfg.vocab_size
    names = list(decode_variants(m)) + ["hf"]
    reps: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(run.sizes.reps):
        if r and run.past_deadline():
            run.log(f"deadline: batch {batch} stops after {r} repetitions")
            break
        for name in rotated(names, r):
            prompts = random_prompts(batch, prompt_len, vocab, rng)
            if name == "hf":
                hr = hf_generate(m.hf, prompts, new, run.sync)
                reps[name].append({"decode_s": hr.decode_s, "steps": new - 1, "seqs": batch, "total_s": hr.total_s})
                continue
            engine, graphs = decode_variants(m)[name]
            with contextlib.nullcontext() if graphs else graphs_off(engine):
                er = run_engine(engine, prompts, new, run.sync)
            assert len(er.decode_s) == new - 1 and set(er.decode_seqs) == {batch}, (
                f"{name}: expected {new - 1} decode-only steps of {batch} sequences, got {er.decode_seqs}"
            )
            reps[name].append(
                {
                    "decode_s": sum(er.decode_s),
                    "steps": len(er.decode_s),
                    "seqs": batch,
                    "median_step_s": statistics.median(er.decode_s),
                    "total_s": er.total_s,
                }
            )
        run.log(
            f"batch {batch} repetition {r + 1}: "
            + ", ".join(f"{n} {reps[n][-1]['decode_s'] / reps[n][-1]['steps'] * 1000:.2f} ms/step" for n in names)
        )
    return reps


def kv_read_bytes(m: SpeedModels, prompt_len: int, new: int, batch: int) -> float:
    """KV bytes the decode steps of one run read, all steps together: step j of a sequence attends to
    prompt_len + 1 + j tokens (the token it feeds included)."""
    return batch * sum(prompt_len + 1 + j for j in range(new - 1)) * m.kv_bytes_per_token


def section_bs1(run: Run) -> dict:
    s = run.sizes
    m = speed_models(run)
    reps = timed_decode(run, 1, s.bs1_prompt, s.bs1_new)
    ms = {n: [r["decode_s"] / r["steps"] * 1000 for r in rs] for n, rs in reps.items()}
    peak = run.a.peak_hbm_tbps * 1e12
    kv = kv_read_bytes(m, s.bs1_prompt, s.bs1_new, 1) / (s.bs1_new - 1)

    def fraction(name: str, weights: int) -> list[float]:
        return [(weights + kv) / (t / 1000) / peak for t in ms[name]]

    out = {
        "bs1_ms_per_token": med(ms["bf16"]),
        "bs1_ms_per_token_no_graphs": med(ms["bf16_no_graphs"]),
        "int8_bs1_ms_per_token": med(ms["int8"]),
        "hf_bs1_ms_per_token": med(ms["hf"]),
        "bs1_hbm_fraction": med(fraction("bf16", m.weight_bytes["bf16"])),
        "bs1_hbm_fraction_no_graphs": med(fraction("bf16_no_graphs", m.weight_bytes["bf16"])),
        "int8_bs1_hbm_fraction": med(fraction("int8", m.weight_bytes["int8"])),
        "int8_bs1_vs_bf16": med([b / i for b, i in zip(ms["bf16"], ms["int8"])]),
        "bs1_graphs_speedup": med([e / g for g, e in zip(ms["bf16"], ms["bf16_no_graphs"])]),
        "bs1_vs_hf": med([h / e for e, h in zip(ms["bf16"], ms["hf"])]),
        "bs1_bytes_per_step": m.weight_bytes["bf16"] + kv,
        "bs1_reps_ms": ms,
    }
    copy = run.results.get("copy_bytes_per_s")
    if copy:
        out["bs1_copy_fraction"] = (m.weight_bytes["bf16"] + kv) / (out["bs1_ms_per_token"] / 1000) / copy
    return out


def section_b64(run: Run) -> dict:
    s = run.sizes
    reps = timed_decode(run, s.batch, s.batch_prompt, s.batch_new)
    tps = {n: [r["seqs"] * r["steps"] / r["decode_s"] for r in rs] for n, rs in reps.items()}
    return {
        "b64_tokens_per_s": med(tps["bf16"]),
        "b64_tokens_per_s_no_graphs": med(tps["bf16_no_graphs"]),
        "int8_b64_tokens_per_s": med(tps["int8"]),
        "hf_b64_tokens_per_s": med(tps["hf"]),
        "int8_b64_vs_bf16": med([i / b for b, i in zip(tps["bf16"], tps["int8"])]),
        "b64_graphs_speedup": med([g / e for g, e in zip(tps["bf16"], tps["bf16_no_graphs"])]),
        "b64_vs_hf": med([e / h for e, h in zip(tps["bf16"], tps["hf"])]),
        "b64_batch": s.batch,
        "b64_reps_tokens_per_s": tps,
    }


def section_prefill(run: Run) -> dict:
    s = run.sizes
    m = speed_models(run)
    rng = random.Random(2048)
    tokens = s.prefill_seqs * s.prefill_len
    names = ["bf16", "int8", "hf"]
    tps: dict[str, list[float]] = {n: [] for n in names}
    for r in range(s.reps):
        if r and run.past_deadline():
            run.log(f"deadline: prefill stops after {r} repetitions")
            break
        for name in rotated(names, r):
            prompts = random_prompts(s.prefill_seqs, s.prefill_len, m.cfg.vocab_size, rng)
            if name == "hf":
                tps[name].append(tokens / hf_generate(m.hf, prompts, 1, run.sync).total_s)
                continue
            er = run_engine(m.bf16 if name == "bf16" else m.int8, prompts, 1, run.sync)
            assert er.prompt_tokens == tokens, f"{name}: {er.prompt_tokens} prompt tokens computed, {tokens} expected"
            tps[name].append(tokens / er.total_s)
        run.log(f"prefill repetition {r + 1}: " + ", ".join(f"{n} {tps[n][-1]:.0f} tok/s" for n in names))
    per_token_flops = prefill_flops_per_token(m.cfg, s.prefill_len)
    return {
        "prefill_tokens_per_s": med(tps["bf16"]),
        "int8_prefill_tokens_per_s": med(tps["int8"]),
        "hf_prefill_tokens_per_s": med(tps["hf"]),
        "prefill_vs_hf": med([e / h for e, h in zip(tps["bf16"], tps["hf"])]),
        "prefill_mfu": med([t * per_token_flops / (run.a.peak_tflops * 1e12) for t in tps["bf16"]]),
        "prefill_shape": [s.prefill_seqs, s.prefill_len],
        "prefill_reps_tokens_per_s": tps,
    }


def prefill_flops_per_token(cfg, length: int) -> float:
    """Matrix FLOPs per prompt token: 2 x the linear layers' parameters (the LM head once per sequence, not per
    token) plus causal attention's QK^T and PV over (length + 1) / 2 keys on average."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    per_layer = h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * h * i
    attention = 2 * 2 * cfg.num_heads * d * (length + 1) / 2
    return cfg.num_layers * (2 * per_layer + attention) + 2 * cfg.vocab_size * h / length


SECTION_FUNCS = {
    "ceilings": section_ceilings,
    "correctness": section_correctness,
    "bs1": section_bs1,
    "b64": section_b64,
    "prefill": section_prefill,
}
REQUIRED = (
    "tokens_match",
    "bs1_ms_per_token",
    "bs1_hbm_fraction",
    "b64_tokens_per_s",
    "prefill_tokens_per_s",
    "int8_bs1_vs_bf16",
)


def environment(run: Run) -> dict:
    import transformers

    env = {
        "smoke": run.a.cpu_smoke,
        "device": str(run.device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "reps": run.sizes.reps,
        "peak_hbm_tbps": run.a.peak_hbm_tbps,
        "peak_tflops": run.a.peak_tflops,
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if run.device.type == "cuda":
        props = torch.cuda.get_device_properties(run.device)
        env.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
        )
    return env


def calibration(run: Run, result: dict) -> dict:
    """The `pdfleet simulate --calibration` keys (operator/pdfleet_operator/sim/calibration.py), on a GPU only.
    Its roofline counts every parameter at 2 bytes per decode step and 2 FLOPs per prefill token over the
    class's peaks; NOTE: the per-step overhead is not separable from the weight read at batch 1, so it is 0 and
    the batch-1 step time is all in decode_mbu (as bench/sim.py calibrate does for vLLM)."""
    m = run.speed
    if (
        run.a.cpu_smoke
        or m is None
        or result.get("bs1_ms_per_token") is None
        or result.get("prefill_tokens_per_s") is None
    ):
        return {}
    params = m.cfg.num_params
    kv = result["bs1_bytes_per_step"] - m.weight_bytes["bf16"]
    mbu = (2 * params + kv) / (result["bs1_ms_per_token"] / 1000) / (run.a.peak_hbm_tbps * 1e12)
    mfu = 2 * params * result["prefill_tokens_per_s"] / (run.a.peak_tflops * 1e12)
    return {
        "kind": "pdfleet-sim-calibration",
        "class": run.a.class_name,
        "engine": "pdfleet",
        "model": f"Llama-3.1-8B shapes ({params / 1e9:.2f}B params, bfloat16, random)",
        "decode_mbu": round(min(1.0, mbu), 4),
        "prefill_mfu": round(min(1.0, mfu), 4),
        "step_overhead_s": 0.0,
    }


def summary(result: dict) -> list[str]:
    def f(key, scale=1.0, unit="", digits=2):
        v = result.get(key)
        return "—" if v is None else f"{v * scale:.{digits}f}{unit}"

    rows = [
        (
            "tokens match transformers",
            str(result.get("tokens_match")),
            f"{result.get('tokens_compared', 0)} compared, {result.get('near_ties', 0)} near-ties",
        ),
        ("bs1 decode (graphs / eager)", f"{f('bs1_ms_per_token')} / {f('bs1_ms_per_token_no_graphs')} ms", ""),
        ("bs1 HBM fraction", f("bs1_hbm_fraction", digits=3), f"goal >= 0.70 of {result.get('peak_hbm_tbps')} TB/s"),
        ("bs1 int8 / transformers", f"{f('int8_bs1_ms_per_token')} / {f('hf_bs1_ms_per_token')} ms", ""),
        (
            "int8 / bf16 speed (bs1, b64)",
            f"{f('int8_bs1_vs_bf16', digits=3)}, {f('int8_b64_vs_bf16', digits=3)}",
            "< 1: int8 is not half the bytes' time on CUDA",
        ),
        (
            "b64 decode (graphs / eager / hf)",
            f"{f('b64_tokens_per_s', digits=0)} / {f('b64_tokens_per_s_no_graphs', digits=0)}"
            f" / {f('hf_b64_tokens_per_s', digits=0)} tok/s",
            "",
        ),
        (
            "prefill (engine / int8 / hf)",
            f"{f('prefill_tokens_per_s', digits=0)} / {f('int8_prefill_tokens_per_s', digits=0)}"
            f" / {f('hf_prefill_tokens_per_s', digits=0)} tok/s",
            f"MFU {f('prefill_mfu', digits=3)}",
        ),
        (
            "ceilings: copy, bf16 matmul",
            f"{f('copy_bytes_per_s', 1e-12)} TB/s, {f('matmul_tflops', digits=0)} TFLOP/s",
            "",
        ),
    ]
    return [f"{a:34s} {b:>32s}  {c}" for a, b, c in rows]


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    prepare_environment(a.cpu_smoke)
    if not a.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU, or --cpu-smoke for the toy-sized CPU run")
    run = Run(a)
    result = run.results
    result.update({**{k: None for k in REQUIRED}, **environment(run), "errors": {}})
    for name in a.sections:
        if run.past_deadline():
            result["errors"][name] = f"skipped: past --deadline-s {a.deadline_s}"
            continue
        run.log(f"section {name}")
        try:
            result.update(SECTION_FUNCS[name](run))
        except Exception as exc:  # noqa: BLE001 -- recorded, reported, and the exit status says so
            result["errors"][name] = "".join(traceback.format_exception(exc))[-4000:]
            run.log(f"section {name} FAILED: {exc!r}")
        if run.speed is not None:
            result["speed_model"] = run.speed.info
        result["wall_s"] = round(run.elapsed(), 1)
        if a.out:
            Path(a.out).write_text(json.dumps(result) + "\n")
    result.update(calibration(run, result))
    print("\n".join(summary(result)))
    for name, err in result["errors"].items():
        print(f"error in {name}: {err.strip().splitlines()[-1]}", file=sys.stderr)
    line = json.dumps(result)
    if a.out:
        Path(a.out).write_text(line + "\n")
    print(line)
    return 1 if result["errors"] or result["tokens_match"] is False else 0


if __name__ == "__main__":
    sys.exit(main())
