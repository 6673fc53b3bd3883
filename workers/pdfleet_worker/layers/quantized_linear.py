"""Weight-only INT8 linear layers (per output channel), quantized from a float checkpoint at load; the loader builds
them.

y = (x W_q^T) * scale + b, with W_q int8 [out, in] and scale [out] = max|W row| / 127 (symmetric, no
zero point). Activations, the residual stream, norms, attention and the KV cache keep the engine's
dtype; only the linear layers' weights (and the LM head's) are int8. Weights take 1 byte per parameter
instead of 4 (fp32) or 2 (bf16), so a memory-bound decode step reads 4x / 2x fewer bytes.

CPU: torch's own `aten._weight_int8pack_mm` (a vectorised AVX2/AVX-512 GEMV; torch 2.13 vectorises it
for bf16 activations only, its fp32 path is ~10x slower, measured), so the matmul takes its activations
in bf16 whatever the engine dtype: an fp32 engine casts each linear's input to bf16 and gets fp32 back
(the scale is applied in fp32 there). From some row count on (prefill chunks, large decode batches)
that kernel loses to a bf16 GEMM, so the weight is widened to bf16 for the call instead (exact: every
int8 value is a bf16 value) and the scale applied after; the count is measured per shape when the
engine starts (choose_dequant_rows), DEQUANT_ROWS until then.

Other devices (CUDA, ...): plain torch ops, y = F.linear(x, W_q.to(x.dtype)) * scale: it saves the
weights' memory but widens the weight every call, so it is no faster than the float model there.
Untested: the machines this was built on have no GPU.
"""

from __future__ import annotations

import logging
import math
import time

import torch
from torch import nn

log = logging.getLogger("pdfleet.engine")

QUANTIZATIONS = ("none", "int8")
# NOTE: the default only; on the CPU ModelRunner times both paths per shape at start-up
# (choose_dequant_rows). On the 2-core AMD EPYC (AVX-512) this was built on, widening the weight to
# bf16 + F.linear tied with _weight_int8pack_mm at 64 rows and won beyond; on the 2-core Intel Xeon
# (AVX-512, AMX) of later machines it already won at about 16 (tiny and small presets' shapes).
DEQUANT_ROWS = 64
PROBE_ROWS = (4, 8, 16, 32, 64, 128)
PROBE_REPS = 3


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row INT8: w [N, K] (any float dtype) -> (q int8 [N, K], scale fp32 [N]), w ~= q * scale."""
    wf = w.detach().float()
    scale = wf.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: q = 0, any scale
    q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """y = x W^T + b with W held as int8 rows and a scale per row. x: [T, in] -> [T, out] in x's dtype.

    `qweight` (int8) and `scale` (the model dtype: a bf16 model keeps bf16 scales, as its float weights
    were bf16) are buffers the loader fills row range by row range (the fused qkv / gate_up weights come
    from several checkpoint tensors).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.empty(out_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        self._unit_scale: torch.Tensor | None = None  # bf16 ones [out]: the kernel's scale for fp32 models
        self.dequant_rows = DEQUANT_ROWS  # from this many rows on, the CPU widens the weight to bf16 instead

    def fill_rows(self, rows: slice | None, w: torch.Tensor) -> None:
        """Quantize the float rows `w` into qweight[rows] (all rows when None)."""
        q, s = quantize_rows(w)
        dq = self.qweight if rows is None else self.qweight[rows]
        ds = self.scale if rows is None else self.scale[rows]
        if tuple(dq.shape) != tuple(q.shape):
            raise ValueError(f"weight has shape {tuple(w.shape)}, expected {tuple(dq.shape)}")
        dq.copy_(q)
        ds.copy_(s)

    def dequantized_weight(self) -> torch.Tensor:
        """W ~= qweight * scale in fp32 [out, in] (tests and the reference checkpoint use it)."""
        return self.qweight.float() * self.scale.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return self._generic(x)
        y = self._cpu(x)
        return y if self.bias is None else y + self.bias

    def _generic(self, x: torch.Tensor) -> torch.Tensor:
        """Plain torch ops, any device (the CUDA path; untested on a GPU here): the weight widened per call."""
        y = nn.functional.linear(x, self.qweight.to(x.dtype)) * self.scale
        return y if self.bias is None else y + self.bias

    def _cpu(self, x: torch.Tensor) -> torch.Tensor:
        xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        if x.shape[0] >= self.dequant_rows:
            y = nn.functional.linear(xb, self.qweight.to(torch.bfloat16))
            return torch.mul(y, self.scale).to(x.dtype)  # bf16 x fp32 scale -> fp32 (fp32 model)
        if self.scale.dtype == torch.bfloat16:
            return torch.ops.aten._weight_int8pack_mm(xb.contiguous(), self.qweight, self.scale)
        unit = self._unit_scale
        if unit is None or unit.device != x.device:
            unit = self._unit_scale = torch.ones(self.out_features, dtype=torch.bfloat16, device=x.device)
        # NOTE: the fp32 scale is applied outside the kernel (its scales are bf16: a per-row 0.2% error);
        # torch.mul promotes bf16 x fp32 to fp32, so this is also the cast back.
        return torch.mul(torch.ops.aten._weight_int8pack_mm(xb.contiguous(), self.qweight, unit), self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per output channel"


@torch.inference_mode()
def choose_dequant_rows(model: nn.Module, rows: tuple[int, ...] = PROBE_ROWS) -> dict[tuple[int, int], int]:
    """On the CPU, per Int8Linear shape (in, out): time the int8 kernel against the widened-weight GEMM on
    the first layer of that shape at each of `rows`, alternating, fastest of PROBE_REPS; dequant_rows
    becomes the smallest row count from which the GEMM wins at every larger probed count too (twice the
    largest when it never does). Sets it on every module of the shape; returns shape -> dequant_rows."""
    groups: dict[tuple[int, int], list[Int8Linear]] = {}
    for m in model.modules():
        if isinstance(m, Int8Linear) and m.qweight.device.type == "cpu":
            groups.setdefault((m.in_features, m.out_features), []).append(m)
    chosen = {}
    for shape, mods in groups.items():
        m, wins = mods[0], []
        x_dtype = m.scale.dtype
        for r in rows:
            x = torch.randn(r, shape[0], generator=torch.Generator().manual_seed(r)).to(x_dtype)
            best = {}
            for rep in range(PROBE_REPS + 1):  # the first pass only warms up
                for path, threshold in (("int8", r + 1), ("dequant", 0))[:: 1 if rep % 2 else -1]:
                    m.dequant_rows = threshold
                    t = time.perf_counter()
                    m._cpu(x)
                    if rep:
                        best[path] = min(best.get(path, math.inf), time.perf_counter() - t)
            wins.append(best["dequant"] < best["int8"])
        first = next((i for i in range(len(rows)) if all(wins[i:])), None)
        chosen[shape] = rows[first] if first is not None else 2 * rows[-1]
        for mod in mods:
            mod.dequant_rows = chosen[shape]
    if chosen:
        log.info(
            "int8 linears widen the weight to bf16 from %s rows (by shape, measured)",
            ", ".join(f"{k[0]}x{k[1]}: {v}" for k, v in chosen.items()),
        )
    return chosen


def replace_linears(model: nn.Module) -> int:
    """Swap every nn.Linear of `model` (any device, meta included) for an empty Int8Linear; returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                w = child.weight
                setattr(
                    parent,
                    name,
                    Int8Linear(
                        child.in_features, child.out_features, child.bias is not None, device=w.device, dtype=w.dtype
                    ),
                )
                count += 1
    return count


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of `model`, and of the packed weights CpuLinear holds (a tensor
    held twice, tied or a view of the same memory, once)."""
    seen, total = set(), 0
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [m.packed for m in model.modules() if isinstance(getattr(m, "packed", None), torch.Tensor)]
    for t in tensors:
        opaque = t.is_mkldnn or t.device.type == "meta"  # no storage to compare
        key = id(t) if opaque else (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total
