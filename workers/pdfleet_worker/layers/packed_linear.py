"""CPU linear kernels: plain F.linear or oneDNN with a prepacked weight, chosen per weight shape by timing both on this
machine at start-up; ModelRunner calls choose() and pack_linears()."""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger("pdfleet.engine")

KERNELS = ("torch", "onednn")
ENV = "PDFLEET_LINEAR_KERNEL"  # auto (measure), torch or onednn
# NOTE: which kernel is faster depends on the CPU, the dtype, the shape and the batch, so it is measured
# here instead of assumed. On a 2-core AMD EPYC, MKL (torch's fp32 path) ran its AVX2 kernels at about
# half of oneDNN's speed; on a 2-core Intel Xeon with AVX-512/AMX, F.linear was ~1.5x faster than the
# prepacked call at 1 row for the tiny preset's shapes (~10 us of fixed cost per oneDNN call, which a
# small weight does not hide) and 1.2-1.6x slower at 4-8 rows; in bf16 oneDNN won at every size.
PROBE_BYTES = 64 << 20  # weights timed per shape: enough layers to leave the caches, as a step does
# A shape whose faster kernel changes with the row count keeps both layouts (and takes each where it won)
# when that costs at most this much memory; a larger one gets one kernel for every row count.
SPLIT_BYTES = 64 << 20
PROBE_REPS = 5  # timed passes per kernel and row count, alternating; the fastest pass counts


def probe_rows(max_num_seqs: int) -> tuple[int, ...]:
    """The decode batch sizes the choice is made for: a lone decode, a small and a full batch.

    NOTE: prefill chunks are left out: there both kernels are compute-bound GEMMs of about the same
    speed (512 rows of the tiny preset: within 3% in fp32 and bf16, measured), and timing them on a
    large model would cost seconds of start-up."""
    return tuple(sorted({1, min(8, max_num_seqs), min(32, max_num_seqs)}))


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


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout. x: [T, in] -> [T, out]."""

    def __init__(self, linear: nn.Linear, plain_below: int = 0, plain_from: int = 0):
        """plain_below / plain_from (0: never): row counts under / from which F.linear on the plain
        weight (kept as a buffer) runs instead."""
        super().__init__()
        assert not (plain_below and plain_from), "plain below some rows or from some rows, not both"
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.plain_below, self.plain_from = plain_below, plain_from
        self.register_buffer("weight", linear.weight.detach() if plain_below or plain_from else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # NOTE: the same call under another name (layers/cpu_kernels.cpp): Inductor's lowering of
            # mkldnn._linear_pointwise accepts only weights it packed itself, so it must stay opaque.
            return torch.ops.pdfleet.onednn_linear(x, self.packed, self.bias)
        rows = x.shape[0]
        if rows < self.plain_below or 0 < self.plain_from <= rows:
            return nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        split = (
            f", F.linear below {self.plain_below} rows"
            if self.plain_below
            else f", F.linear from {self.plain_from} rows"
            if self.plain_from
            else ""
        )
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn{split}"


Shape = tuple[int, int]  # (in_features, out_features)


@dataclass(frozen=True)
class ShapeTiming:
    """One weight shape of the model: how many linears have it, each kernel's time per call at each
    probed row count (ms; empty when nothing was timed) and the kernel it gets: `kernel` from
    `split_at` rows on, `below` under it (split_at 0: `kernel` at every row count)."""

    shape: Shape
    count: int
    ms: tuple[tuple[str, int, float], ...]  # (kernel, rows, ms per call)
    kernel: str
    below: str = ""
    split_at: int = 0

    def kernel_at(self, rows: int) -> str:
        return self.below if rows < self.split_at else self.kernel

    @property
    def label(self) -> str:
        return f"{self.below} below {self.split_at} rows, {self.kernel} from it" if self.split_at else self.kernel

    def time(self, kernel: str, rows: int) -> float:
        return next(t for k, r, t in self.ms if k == kernel and r == rows)

    def ratio(self, rows: int) -> float:
        """oneDNN's time over F.linear's at `rows`."""
        return self.time("onednn", rows) / self.time("torch", rows)


@dataclass(frozen=True)
class LinearChoice:
    """What ModelRunner runs each linear with, and why (`source`: probe, the environment, or why
    oneDNN was not considered)."""

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
        """torch, onednn, or mixed (by shape or by row count)."""
        kernels = {k for s in self.shapes for k in (s.kernel, s.below) if k} or {"torch"}
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
        shapes = "; ".join(
            f"{s.shape[0]}x{s.shape[1]} x{s.count} {s.label} (oneDNN/F.linear "
            + "/".join(f"{s.ratio(r):.2f}" for r in self.rows)
            + ")"
            for s in self.shapes
        )
        return (
            f"{head}; step's linears vs F.linear: {per_rows} [rows {'/'.join(map(str, self.rows))}: {shapes}] "
            f"({self.source})"
        )


_PROBED: dict[tuple, LinearChoice] = {}  # probe key -> choice, for this process


def linear_shapes(model: nn.Module) -> dict[Shape, list[nn.Linear]]:
    """The model's nn.Linear modules grouped by weight shape, in model order."""
    out: dict[Shape, list[nn.Linear]] = {}
    for m in model.modules():
        if isinstance(m, nn.Linear):
            out.setdefault((m.in_features, m.out_features), []).append(m)
    return out


def decide(ratios: list[float]) -> str:
    """onednn when its time over F.linear's, averaged geometrically over the probed row counts, is below 1."""
    assert ratios and all(r > 0 for r in ratios), f"ratios must be positive: {ratios}"
    return "onednn" if math.exp(sum(map(math.log, ratios)) / len(ratios)) < 1.0 else "torch"


def plan(rows: tuple[int, ...], ratios: list[float], split_ok: bool) -> tuple[str, str, int]:
    """(kernel, below, split_at) for one shape from oneDNN/F.linear at each of `rows` (ascending): of one
    kernel for every row count, or (when `split_ok`) one kernel below some probed row count and the
    other from it, the plan that loses least to the faster kernel summed over the row counts in log
    time (ties: one kernel before a split, F.linear before oneDNN). With one kernel this is decide()."""
    assert len(rows) == len(ratios) and all(r > 0 for r in ratios), (rows, ratios)
    plans = [("torch", "", 0), ("onednn", "", 0)]
    if split_ok:
        plans += [
            (above, below, rows[i])
            for i in range(1, len(rows))
            for below, above in (("torch", "onednn"), ("onednn", "torch"))
        ]

    def regret(p: tuple[str, str, int]) -> float:
        kernel, below, split_at = p
        chosen = [below if r < split_at else kernel for r in rows]
        return sum(abs(math.log(q)) for k, q in zip(chosen, ratios) if (k == "onednn") != (q < 1.0))

    return min(plans, key=lambda p: (round(regret(p), 9), p[2] != 0, p[0] != "torch"))


def choose(model: nn.Module, dtype: torch.dtype, rows: tuple[int, ...], *, setting: str | None = None) -> LinearChoice:
    """The kernel of each weight shape of `model` (on the CPU, in `dtype`); `setting` defaults to
    $PDFLEET_LINEAR_KERNEL: auto (time both at `rows`), torch or onednn (every shape, no timing)."""
    setting = (os.environ.get(ENV, "auto") if setting is None else setting).strip().lower()
    if setting not in ("auto", *KERNELS):
        raise ValueError(f"{ENV}={setting!r}: expected auto, torch or onednn")
    groups = linear_shapes(model)
    threads = torch.get_num_threads()

    def fixed(kernel: str, source: str) -> LinearChoice:
        return LinearChoice(
            dtype, threads, rows, source, tuple(ShapeTiming(s, len(ms), (), kernel) for s, ms in groups.items())
        )

    if not groups:
        return fixed("torch", "no float linears")
    if setting == "torch":
        return fixed("torch", f"{ENV}=torch")
    if not onednn_available(dtype):
        if setting == "onednn":
            raise ValueError(f"{ENV}=onednn: this torch build cannot run oneDNN linears in {dtype}")
        return fixed("torch", "oneDNN unavailable")
    if setting == "onednn":
        return fixed("onednn", f"{ENV}=onednn")
    key = (dtype, threads, rows, tuple((s, len(ms), ms[0].bias is not None) for s, ms in groups.items()))
    if key in _PROBED:  # NOTE: one probe per process for the same shapes (tests build many engines)
        return _PROBED[key]
    t0 = time.perf_counter()
    shapes = tuple(_probe_shape(shape, mods, dtype, rows) for shape, mods in groups.items())
    choice = _PROBED[key] = LinearChoice(dtype, threads, rows, f"probe, {time.perf_counter() - t0:.2f}s", shapes)
    log.info("%s", choice.describe())
    return choice


@torch.inference_mode()
def _probe_shape(shape: Shape, modules: list[nn.Linear], dtype: torch.dtype, rows: tuple[int, ...]) -> ShapeTiming:
    """Time F.linear and the prepacked call over this shape's first layers (up to PROBE_BYTES of
    weights, each layer once per pass, as a step reads them), alternating kernels pass by pass."""
    per_layer = max(1, modules[0].weight.numel() * modules[0].weight.element_size())
    layers = modules[: max(1, min(len(modules), PROBE_BYTES // per_layer))]
    plain = [(m.weight.detach().to(dtype), None if m.bias is None else m.bias.detach().to(dtype)) for m in layers]
    packed = [(torch.ops.mkldnn._reorder_linear_weight(w, None), b) for w, b in plain]
    g = torch.Generator().manual_seed(0)
    calls = {
        "torch": lambda x: [nn.functional.linear(x, w, b) for w, b in plain],
        "onednn": lambda x: [torch.ops.mkldnn._linear_pointwise(x, p, b, "none", [], "") for p, b in packed],
    }
    best: dict[tuple[str, int], float] = {}
    for r in rows:
        x = torch.randn(r, shape[0], generator=g).to(dtype)
        for call in calls.values():
            call(x)  # first calls create the kernels (oneDNN primitives, MKL's buffers)
        for rep in range(PROBE_REPS):
            for kernel in KERNELS if rep % 2 == 0 else KERNELS[::-1]:
                t = time.perf_counter()
                calls[kernel](x)
                ms = (time.perf_counter() - t) * 1e3 / len(layers)
                best[kernel, r] = min(best.get((kernel, r), math.inf), ms)
    timing = tuple((k, r, best[k, r]) for r in rows for k in KERNELS)
    split_ok = len(modules) * per_layer <= SPLIT_BYTES
    kernel, below, split_at = plan(rows, [best["onednn", r] / best["torch", r] for r in rows], split_ok)
    return ShapeTiming(shape, len(modules), timing, kernel, below, split_at)


def pack_linears(model: nn.Module, choice: LinearChoice | None = None) -> int:
    """Replace the nn.Linear modules of `model` whose shape `choice` gives oneDNN at some row count (all
    of them without a choice) by PackedLinear, in place (a split shape keeps its plain weight for the
    rows F.linear won); returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            t = None if choice is None else choice.timing_for((child.in_features, child.out_features))
            if choice is not None and (t is None or "onednn" not in (t.kernel, t.below)):
                continue
            split = (
                {}
                if t is None or not t.split_at
                else ({"plain_below": t.split_at} if t.below == "torch" else {"plain_from": t.split_at})
            )
            setattr(parent, name, PackedLinear(child, **split))
            count += 1
    return count
