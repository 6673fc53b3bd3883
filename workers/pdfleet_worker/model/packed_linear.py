"""oneDNN prepacked linear layers for the CPU; ModelRunner swaps them in around the model after loading."""
from __future__ import annotations

import functools

import torch
from torch import nn

# NOTE: torch sends fp32 nn.Linear to MKL, which runs its AVX2 path on AMD CPUs and multiplies
# [1, K] x [K, N] at about 18 GB/s here. oneDNN with a prepacked weight reads the same weights at
# about 40 GB/s (bf16: about twice the tokens/s again) and is 1.5-2x faster at batch 8-64 too.


@functools.lru_cache(maxsize=None)
def onednn_available(dtype: torch.dtype) -> bool:
    """True if this torch build can prepack and run a linear in `dtype`, and agrees with F.linear."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
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

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # NOTE: the same call under another name (engine/cpu_kernels.cpp): Inductor's lowering of
            # mkldnn._linear_pointwise accepts only weights it packed itself, so it must stay opaque.
            return torch.ops.pdfleet.onednn_linear(x, self.packed, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear of `model` by a PackedLinear in place; returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count
