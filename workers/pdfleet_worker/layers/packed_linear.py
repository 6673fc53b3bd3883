"""CPU linear kernels: plain F.linear, oneDNN with a prepacked weight, or pdfleet's own kernel on the plain weight
(layers/cpu_kernels.cpp plain_linear), chosen per weight shape and row count by timing them on this machine at
start-up; ModelRunner calls choose() and pack_linears()."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import time
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger("pdfleet.engine")

KERNELS = ("torch", "onednn", "pdfleet")
# The weight layout each kernel reads: one shape holds one layout unless it may keep both (SPLIT_BYTES, split_within).
LAYOUT = {"torch": "plain", "pdfleet": "plain", "onednn": "packed"}
ENV = "PDFLEET_LINEAR_KERNEL"  # auto (measure), torch, onednn or pdfleet
# NOTE: which kernel is faster depends on the CPU, the dtype, the shape and the batch, so it is measured
# here instead of assumed. On a 2-core AMD EPYC, MKL (torch's fp32 path) ran its AVX2 kernels at about
# half of oneDNN's speed, and pdfleet's plain_linear took 0.65-0.9x oneDNN's time at 1-4 rows (it reads the
# weights at 28-36 GB/s where oneDNN read 15-25) and 0.84-1.1x at 8-32; on a 2-core Intel Xeon with
# AVX-512/AMX, F.linear was ~1.5x faster than the prepacked call at 1 row for the tiny preset's shapes (~10 us
# of fixed cost per oneDNN call, which a small weight does not hide) and 1.2-1.6x slower at 4-8 rows; in bf16
# oneDNN won at every size there (before plain_linear ran bf16). Without native bf16 (AVX2) oneDNN refuses bf16,
# F.linear's bf16 took 2.4-9x plain_linear's fp32 time at 4-512 rows, and plain_linear runs bf16 in fp32
# arithmetic on widened weights: 0.63-0.82x its own fp32 time at 1-4 rows (half the bytes), 1.0-1.24x at 8-512.
PROBE_BYTES = 64 << 20  # weights timed per shape: enough layers to leave the caches, as a step does
# A shape whose faster kernel changes with the row count keeps both layouts (and takes each where it won)
# when that costs at most this much memory; a larger one gets one kernel for every row count.
SPLIT_BYTES = 64 << 20
# ... or, beyond that, while the second layouts together fit in the room `choose` is given (the engine gives it
# SPLIT_ROOM_SHARE of the memory the KV pool leaves), the shapes that gain most first. NOTE: a shape too large for
# SPLIT_BYTES had one kernel at every row count, and on a 2-core EPYC the small preset's 768x4096 and 2048x768
# (201 and 100 MB) flipped between oneDNN and plain_linear from one start-up to the next: plain_linear wins a lone
# decode by ~30%, oneDNN 8-128 rows by 5-15%, and the log-time sums came out within the timings' noise. A start-up
# on plain_linear served the peer's mixed workload ~5% slower (bench/HISTORY.md, sixteenth session).
SPLIT_ROOM_SHARE = 8
# ... and only when that loses at least this much less (summed log time) than the best single layout: the
# probe's timings of two close kernels swap from run to run, and on a 2-core EPYC one start-up in four split
# the small preset's 768x1280 shape (63 MB) for a 5% difference at 32 rows.
SPLIT_MIN_GAIN = math.log(1.1)
PROBE_REPS = 5  # timed passes per kernel and row count, alternating; the fastest pass counts


PREFILL_PROBE_ROWS = 128  # the prefill-sized row count probed (capped at the step's token budget)


def probe_rows(max_num_seqs: int, max_num_batched_tokens: int = 0) -> tuple[int, ...]:
    """The row counts the choice is made for: a lone decode, a small and a full decode batch, and (given the
    step's token budget) a prefill chunk's size, capped at PREFILL_PROBE_ROWS.

    NOTE: a row count between two probed ones takes the smaller one's kernel, so without the prefill size
    every chunk ran on the kernel that won at 32 rows. On a 2-core EPYC that put the tiny preset's prefill on
    pdfleet's plain_linear, and `make demo` met its SLO for 44-49% of requests against 52-64% on oneDNN (two
    alternating pairs); the mixed peer workload lost a tenth on the small preset. 128 rows, not 512: the
    probe times each kernel on up to 64 MB of a shape's weights, and at 512 rows that is seconds of start-up
    for a large model."""
    rows = {1, min(8, max_num_seqs), min(32, max_num_seqs)}
    if max_num_batched_tokens:
        rows.add(min(PREFILL_PROBE_ROWS, max_num_batched_tokens))
    return tuple(sorted(rows))


NO_FAST_BF16 = "this CPU has no fast bf16 matmul (oneDNN's needs AVX512-BW/VL/DQ or AVX-NE-CONVERT)"


def fast_bf16() -> bool:
    """Whether oneDNN runs bf16 matmuls natively here. Without it (an AVX2-only CPU) bf16 falls back to a path
    far slower than fp32: autocast to bf16 trained the tiny preset ~30x slower (103 against 3,338 tokens/s)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (RuntimeError, AttributeError):
        return False


@functools.lru_cache(maxsize=None)
def onednn_available(dtype: torch.dtype) -> bool:
    """True if this torch build can prepack and run a linear in `dtype`, and agrees with F.linear."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        if dtype == torch.bfloat16 and not fast_bf16():
            return False
        g = torch.Generator().manual_seed(0)
        w = torch.randn(24, 40, generator=g).to(dtype)
        b = torch.randn(24, generator=g).to(dtype)
        x = torch.randn(3, 40, generator=g).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
        want = nn.functional.linear(x.float(), w.float(), b.float())
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        return bool(torch.allclose(got.float(), want, atol=tol, rtol=tol))
    except (RuntimeError, AttributeError):
        return False


@functools.lru_cache(maxsize=None)
def plain_available(dtype: torch.dtype) -> bool:
    """True if pdfleet's plain_linear runs here in `dtype` (fp32 or bf16, with the CPU kernels built) and agrees
    with F.linear in fp32 on each of its paths (few rows, the weight as brgemm's A in one chunk of x or two,
    packed panels)."""
    from pdfleet_worker.layers import cpu_kernels

    if dtype not in (torch.float32, torch.bfloat16) or not cpu_kernels.load():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w, b = torch.randn(24, 40, generator=g).to(dtype), torch.randn(24, generator=g).to(dtype)
        tol = 1e-4 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding (8 bits of mantissa)
        for rows in (1, 3, 8, 40, 70):
            x = torch.randn(rows, 40, generator=g).to(dtype)
            got = torch.ops.pdfleet.plain_linear(x, w, b)
            want = nn.functional.linear(x.float(), w.float(), b.float())
            if got.dtype != dtype or not torch.allclose(got.float(), want, atol=tol, rtol=tol):
                return False
        return True
    except (RuntimeError, AttributeError):
        return False


def available(kernel: str, dtype: torch.dtype) -> bool:
    return kernel == "torch" or (onednn_available(dtype) if kernel == "onednn" else plain_available(dtype))


Plan = tuple[tuple[int, str], ...]  # (from this many rows, kernel), ascending; the first from 0


def kernel_at(plan: Plan, rows: int) -> str:
    return next(k for start, k in reversed(plan) if start <= rows)


def plan_label(plan: Plan) -> str:
    return ", ".join(k if start == 0 else f"{k} from {start} rows" for start, k in plan)


class CpuLinear(nn.Module):
    """y = x W^T + b on the kernel `plan` gives for x's row count. x: [T, in] -> [T, out]. Holds oneDNN's
    packed weight if the plan runs oneDNN at some row count, the plain weight if it runs F.linear or
    pdfleet's plain_linear."""

    def __init__(self, linear: nn.Linear, plan: Plan):
        super().__init__()
        assert plan and plan[0][0] == 0 and all(k in KERNELS for _, k in plan), plan
        self.in_features, self.out_features, self.plan = linear.in_features, linear.out_features, plan
        kernels = {k for _, k in plan}
        w = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None) if "onednn" in kernels else None
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("weight", w if kernels - {"onednn"} else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # NOTE: one kernel for every row count, with no branch on a dynamic size. oneDNN goes under another
            # name (layers/cpu_kernels.cpp): Inductor's lowering of mkldnn._linear_pointwise accepts only
            # weights it packed itself, so it must stay opaque.
            if self.packed is not None:
                return torch.ops.pdfleet.onednn_linear(x, self.packed, self.bias)
            return nn.functional.linear(x, self.weight, self.bias)
        rows, kernel = x.shape[0], self.plan[0][1]
        for start, k in self.plan[1:]:
            if rows >= start:
                kernel = k
        if kernel == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if kernel == "pdfleet":
            return torch.ops.pdfleet.plain_linear(x, self.weight, self.bias)
        return nn.functional.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {plan_label(self.plan)}"


Shape = tuple[int, int]  # (in_features, out_features)


@dataclass(frozen=True)
class ShapeTiming:
    """One weight shape of the model: how many linears have it, each kernel's time per call at each
    probed row count (ms; empty when nothing was timed) and the kernel it runs at each row count."""

    shape: Shape
    count: int
    ms: tuple[tuple[str, int, float], ...]  # (kernel, rows, ms per call)
    plan: Plan
    bytes: int = 0  # the weights of every linear of this shape, one layout

    def kernel_at(self, rows: int) -> str:
        return kernel_at(self.plan, rows)

    @property
    def kernels(self) -> set[str]:
        return {k for _, k in self.plan}

    @property
    def label(self) -> str:
        return plan_label(self.plan)

    def time(self, kernel: str, rows: int) -> float:
        return next(t for k, r, t in self.ms if k == kernel and r == rows)

    def ratio(self, kernel: str, rows: int) -> float:
        """`kernel`'s time over F.linear's at `rows`."""
        return self.time(kernel, rows) / self.time("torch", rows)


@dataclass(frozen=True)
class LinearChoice:
    """What ModelRunner runs each linear with, and why (`source`: probe, the environment, or why
    the other kernels were not considered)."""

    dtype: torch.dtype
    threads: int
    rows: tuple[int, ...]
    source: str
    shapes: tuple[ShapeTiming, ...]

    def timing_for(self, shape: Shape) -> ShapeTiming | None:
        return next((s for s in self.shapes if s.shape == shape), None)

    def kernel_for(self, shape: Shape, rows: int) -> str:
        timing = self.timing_for(shape)
        return "torch" if timing is None else timing.kernel_at(rows)

    @property
    def backend(self) -> str:
        """torch, onednn, pdfleet, or mixed (by shape or by row count)."""
        kernels = set().union(*(s.kernels for s in self.shapes)) or {"torch"}
        return kernels.pop() if len(kernels) == 1 else "mixed"

    @property
    def timed(self) -> bool:
        return bool(self.shapes) and all(s.ms for s in self.shapes)

    def step_ms(self, kernel: str, rows: int) -> float:
        """One step's linears at `rows` with every shape on `kernel` ("chosen": each on its own), from the probe."""
        return sum(s.count * s.time(s.kernel_at(rows) if kernel == "chosen" else kernel, rows) for s in self.shapes)

    def describe(self) -> str:
        head = f"linear kernels ({str(self.dtype).removeprefix('torch.')}, {self.threads} thread(s)): {self.backend}"
        if not self.timed:
            return f"{head} ({self.source})"
        per_rows = ", ".join(f"{r} rows {self.step_ms('chosen', r) / self.step_ms('torch', r):.2f}x" for r in self.rows)
        timed = sorted({k for s in self.shapes for k, _, _ in s.ms} - {"torch"}, key=KERNELS.index)
        shapes = "; ".join(
            f"{s.shape[0]}x{s.shape[1]} x{s.count} {s.label} ("
            + ", ".join(f"{k} " + "/".join(f"{s.ratio(k, r):.2f}" for r in self.rows) for k in timed)
            + ")"
            for s in self.shapes
        )
        return (
            f"{head}; step's linears vs F.linear: {per_rows} [rows {'/'.join(map(str, self.rows))}, time vs "
            f"F.linear: {shapes}] ({self.source})"
        )


_PROBED: dict[tuple, LinearChoice] = {}  # (probe key, split room) -> choice, for this process
_TIMED: dict[tuple, tuple[list[ShapeTiming], str]] = {}  # probe key -> each shape's timings and one-layout plan


def linear_shapes(model: nn.Module) -> dict[Shape, list[nn.Linear]]:
    """The model's nn.Linear modules grouped by weight shape, in model order."""
    out: dict[Shape, list[nn.Linear]] = {}
    for m in model.modules():
        if isinstance(m, nn.Linear):
            out.setdefault((m.in_features, m.out_features), []).append(m)
    return out


def plan(rows: tuple[int, ...], ms: dict[tuple[str, int], float], split_ok: bool) -> Plan:
    """The kernel of one shape at each row count from each timed kernel's time at each of `rows` (ascending):
    at each probed row count the fastest kernel among those reading one layout (plain: F.linear and
    plain_linear; packed: oneDNN), for the layout that loses least to the fastest kernel summed over the row
    counts in log time (ties: plain before packed, and F.linear before the others); both layouts instead when
    `split_ok` and that loses SPLIT_MIN_GAIN less. A row count between two probed ones takes the smaller one's
    kernel."""
    kernels = sorted({k for k, _ in ms}, key=KERNELS.index)
    assert rows and all(ms.get((k, r), 0) > 0 for k in kernels for r in rows), (rows, ms)

    def per_row(layouts: set[str]) -> list[str] | None:
        usable = [k for k in kernels if LAYOUT[k] in layouts]
        return [min(usable, key=lambda k: ms[k, r]) for r in rows] if usable else None

    def regret(chosen: list[str]) -> float:
        return _regret(chosen, rows, ms)

    singles = [c for layout in ("plain", "packed") if (c := per_row({layout})) is not None]
    chosen = min(singles, key=lambda c: round(regret(c), 9))  # the first of equals: plain
    if split_ok and regret(split := per_row({"plain", "packed"})) < regret(chosen) - SPLIT_MIN_GAIN:
        chosen = split
    out: list[tuple[int, str]] = []
    for r, k in zip(rows, chosen):
        if not out or out[-1][1] != k:
            out.append((0 if not out else r, k))
    return tuple(out)


def choose(
    model: nn.Module,
    dtype: torch.dtype,
    rows: tuple[int, ...],
    *,
    setting: str | None = None,
    split_room: int = 0,
) -> LinearChoice:
    """The kernel of each weight shape of `model` (on the CPU, in `dtype`) at each row count; `setting` defaults
    to $PDFLEET_LINEAR_KERNEL: auto (time every kernel usable here at `rows`), or one of KERNELS for every
    shape (no timing). `split_room`: bytes the second layouts of shapes larger than SPLIT_BYTES may take
    together (0: none of them keeps both)."""
    setting = (os.environ.get(ENV, "auto") if setting is None else setting).strip().lower()
    if setting not in ("auto", *KERNELS):
        raise ValueError(f"{ENV}={setting!r}: expected auto, " + ", ".join(KERNELS[:-1]) + f" or {KERNELS[-1]}")
    groups = linear_shapes(model)
    threads = torch.get_num_threads()

    def fixed(kernel: str, source: str) -> LinearChoice:
        return LinearChoice(
            dtype, threads, rows, source, tuple(ShapeTiming(s, len(ms), (), ((0, kernel),)) for s, ms in groups.items())
        )

    if not groups:
        return fixed("torch", "no float linears")
    if setting != "auto":
        if not available(setting, dtype):
            raise ValueError(f"{ENV}={setting}: this machine cannot run {setting} linears in {dtype}")
        return fixed(setting, f"{ENV}={setting}")
    kernels = tuple(k for k in KERNELS if available(k, dtype))
    if kernels == ("torch",):
        return fixed("torch", "oneDNN and plain_linear unavailable")
    key = (dtype, threads, rows, kernels, tuple((s, len(ms), ms[0].bias is not None) for s, ms in groups.items()))
    if (key, split_room) in _PROBED:  # NOTE: one probe per process for the same shapes (tests build many engines)
        return _PROBED[key, split_room]
    if key not in _TIMED:
        t0 = time.perf_counter()
        timed = [_probe_shape(shape, mods, dtype, rows, kernels) for shape, mods in groups.items()]
        _TIMED[key] = (timed, f"probe, {time.perf_counter() - t0:.2f}s")
    timed, source = _TIMED[key]
    shapes = tuple(split_within(timed, rows, split_room))
    choice = _PROBED[key, split_room] = LinearChoice(dtype, threads, rows, source, shapes)
    log.info("%s", choice.describe())
    return choice


@torch.inference_mode()
def _probe_shape(
    shape: Shape, modules: list[nn.Linear], dtype: torch.dtype, rows: tuple[int, ...], kernels: tuple[str, ...]
) -> ShapeTiming:
    """Time each of `kernels` over this shape's first layers (up to PROBE_BYTES of weights, each layer once per
    pass, as a step reads them), alternating kernels pass by pass."""
    per_layer = max(1, modules[0].weight.numel() * modules[0].weight.element_size())
    layers = modules[: max(1, min(len(modules), PROBE_BYTES // per_layer))]
    plain = [(m.weight.detach().to(dtype), None if m.bias is None else m.bias.detach().to(dtype)) for m in layers]
    packed = [(torch.ops.mkldnn._reorder_linear_weight(w, None), b) for w, b in plain] if "onednn" in kernels else []
    g = torch.Generator().manual_seed(0)
    all_calls = {
        "torch": lambda x: [nn.functional.linear(x, w, b) for w, b in plain],
        "onednn": lambda x: [torch.ops.mkldnn._linear_pointwise(x, p, b, "none", [], "") for p, b in packed],
        "pdfleet": lambda x: [torch.ops.pdfleet.plain_linear(x, w, b) for w, b in plain],
    }
    calls = {k: all_calls[k] for k in kernels}
    best: dict[tuple[str, int], float] = {}
    for r in rows:
        x = torch.randn(r, shape[0], generator=g).to(dtype)
        for call in calls.values():
            call(x)  # first calls create the kernels (oneDNN primitives, brgemm's JIT code, MKL's buffers)
        for rep in range(PROBE_REPS):
            for kernel in kernels if rep % 2 == 0 else kernels[::-1]:
                t = time.perf_counter()
                calls[kernel](x)
                ms = (time.perf_counter() - t) * 1e3 / len(layers)
                best[kernel, r] = min(best.get((kernel, r), math.inf), ms)
    timing = tuple((k, r, best[k, r]) for r in rows for k in kernels)
    return ShapeTiming(shape, len(modules), timing, plan(rows, best, False), len(modules) * per_layer)


def split_within(shapes: list[ShapeTiming], rows: tuple[int, ...], room: int) -> list[ShapeTiming]:
    """`shapes` with both layouts where that gains SPLIT_MIN_GAIN: every shape of at most SPLIT_BYTES, then the
    larger ones by gain while their second layouts fit in `room` bytes together."""
    out = list(shapes)
    larger = []
    for i, s in enumerate(shapes):
        ms = {(k, r): t for k, r, t in s.ms}
        split = plan(rows, ms, True)
        if split == s.plan:
            continue
        if s.bytes <= SPLIT_BYTES:
            out[i] = dataclasses.replace(s, plan=split)
        else:
            one, both = ([kernel_at(p, r) for r in rows] for p in (s.plan, split))
            larger.append((_regret(one, rows, ms) - _regret(both, rows, ms), i, split))
    for _, i, split in sorted(larger, reverse=True):
        if shapes[i].bytes <= room:
            room -= shapes[i].bytes
            out[i] = dataclasses.replace(shapes[i], plan=split)
    return out


def _regret(chosen: list[str], rows: tuple[int, ...], ms: dict[tuple[str, int], float]) -> float:
    """Summed log time `chosen` (a kernel at each of `rows`) loses against the fastest kernel at each row count."""
    return sum(math.log(ms[k, r] / min(t for (_, rr), t in ms.items() if rr == r)) for k, r in zip(chosen, rows))


def pack_linears(model: nn.Module, choice: LinearChoice | None = None) -> int:
    """Replace the nn.Linear modules of `model` whose shape `choice` gives a kernel other than F.linear at some
    row count (all of them, on oneDNN, without a choice) by CpuLinear, in place; returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            t = None if choice is None else choice.timing_for((child.in_features, child.out_features))
            if choice is not None and (t is None or t.kernels == {"torch"}):
                continue
            setattr(parent, name, CpuLinear(child, ((0, "onednn"),) if t is None else t.plan))
            count += 1
    return count
