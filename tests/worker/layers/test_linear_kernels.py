"""The CPU linear kernel choice (layers/packed_linear.py): the rule, the probe's bookkeeping, the
override, and both kernels token-exact against the transformers oracle. No timing is asserted."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdfleet_worker.layers import packed_linear
from tests.worker.oracle import compare, random_prompts, run_and_capture


def _toy() -> nn.Module:
    """Two shapes: 16->24 twice (one with a bias) and 24->40 once."""
    return nn.Sequential(nn.Linear(16, 24), nn.Linear(24, 40, bias=False), nn.Sequential(nn.Linear(16, 24)))


def _ms(rows, **times):
    """{(kernel, rows): ms} from kernel=[ms at each of rows]."""
    return {(k, r): t for k, ts in times.items() for r, t in zip(rows, ts)}


def test_plan_takes_the_fastest_kernel_of_the_layouts_that_lose_least():
    rows = (1, 8, 32)
    plan = packed_linear.plan
    assert plan(rows, _ms(rows, torch=[1, 1, 1], onednn=[0.9, 0.8, 0.7]), True) == ((0, "onednn"),)
    assert plan(rows, _ms(rows, torch=[1, 1, 1], onednn=[1.2, 1.1, 1.3]), True) == ((0, "torch"),)
    assert plan(rows, _ms(rows, torch=[1, 1, 1], onednn=[1.2, 0.6, 0.8]), True) == ((0, "torch"), (8, "onednn"))
    assert plan(rows, _ms(rows, torch=[1, 1, 1], onednn=[0.8, 0.9, 1.2]), True) == ((0, "onednn"), (32, "torch"))
    # too big to hold twice: one layout, the one that loses least (log 1.2 at 1 row against log 0.6 + log 0.8)
    assert plan(rows, _ms(rows, torch=[1, 1, 1], onednn=[1.2, 0.6, 0.8]), False) == ((0, "onednn"),)
    # the winner changes twice: each row count its own
    assert plan(rows, _ms(rows, torch=[1, 1, 1], onednn=[1.2, 0.6, 1.1]), True) == (
        (0, "torch"),
        (8, "onednn"),
        (32, "torch"),
    )
    # F.linear and plain_linear read the same weight: switching between them costs no memory
    assert plan(rows, _ms(rows, torch=[1, 1, 1], onednn=[0.7, 0.7, 0.7], pdfleet=[0.5, 0.9, 1.1]), False) == (
        (0, "onednn"),
    )
    assert plan(rows, _ms(rows, torch=[1, 1, 1], onednn=[0.9, 0.9, 0.9], pdfleet=[0.5, 0.95, 1.1]), False) == (
        (0, "pdfleet"),
        (32, "torch"),
    )
    assert plan(rows, _ms(rows, torch=[1, 1, 1], onednn=[0.7, 0.7, 0.7], pdfleet=[0.5, 0.9, 1.1]), True) == (
        (0, "pdfleet"),
        (8, "onednn"),
    )
    assert plan(rows, _ms(rows, torch=[1, 1, 1], onednn=[1, 1, 1]), True) == ((0, "torch"),)  # ties: no packing
    # a second layout only for a gain above the probe's noise: 5% at one row count is not, 15% is
    close = _ms(rows, torch=[1, 1, 1], onednn=[1.5, 1.5, 0.95], pdfleet=[0.6, 0.6, 1.0])
    assert plan(rows, close, True) == ((0, "pdfleet"), (32, "torch"))
    assert plan(rows, {**close, ("onednn", 32): 0.85}, True) == ((0, "pdfleet"), (32, "onednn"))
    with pytest.raises(AssertionError):
        plan(rows, _ms((1, 8), torch=[1, 1], onednn=[1, 1]), True)  # a row count not timed


def test_larger_shapes_keep_both_layouts_within_the_room_by_gain():
    """Shapes of at most SPLIT_BYTES split whenever that gains; larger ones while their second layouts fit the room
    together, the largest gain first; a shape whose split gains too little keeps one layout whatever the room."""
    rows = (1, 8, 32)
    mb = 1 << 20
    big_gain = _ms(rows, torch=[1, 1, 1], onednn=[2.0, 0.6, 0.6], pdfleet=[0.5, 0.9, 0.9])
    small_gain = _ms(rows, torch=[1, 1, 1], onednn=[1.3, 0.8, 0.8], pdfleet=[0.8, 1.0, 1.0])
    no_gain = _ms(rows, torch=[1, 1, 1], onednn=[0.7, 0.7, 0.7])

    def timing(name, ms, size):
        t = tuple((k, r, v) for (k, r), v in ms.items())
        return packed_linear.ShapeTiming((name, 1), 1, t, packed_linear.plan(rows, ms, False), size)

    shapes = [
        timing(1, small_gain, 100 * mb),
        timing(2, big_gain, 150 * mb),
        timing(3, no_gain, 10 * mb),
        timing(4, big_gain, packed_linear.SPLIT_BYTES),
    ]

    def split(room):  # which shapes hold both layouts
        layouts = [{packed_linear.LAYOUT[k] for _, k in s.plan} for s in packed_linear.split_within(shapes, rows, room)]
        return [len(x) == 2 for x in layouts]

    assert split(0) == [False, False, False, True]  # at most SPLIT_BYTES: always
    assert split(200 * mb) == [False, True, False, True]  # the larger gain first; the next no longer fits
    assert split(250 * mb) == [True, True, False, True]
    assert split(10 << 30) == [True, True, False, True]  # no gain, no second layout
    assert [s.plan for s in packed_linear.split_within(shapes, rows, 0)][:3] == [s.plan for s in shapes][:3]


SPLITS = [((0, "torch"), (4, "onednn")), ((0, "onednn"), (4, "torch")), ((0, "pdfleet"), (4, "onednn"), (9, "torch"))]


@pytest.mark.parametrize("plan", SPLITS)
def test_a_split_linear_computes_the_same_at_every_row_count(plan):
    if not packed_linear.onednn_available(torch.float32) or not packed_linear.plain_available(torch.float32):
        pytest.skip("this machine runs no oneDNN linear or no plain_linear")
    lin = nn.Linear(16, 24)
    split = packed_linear.CpuLinear(lin, plan)
    assert split.weight is not None and split.packed is not None and "from 4 rows" in split.extra_repr()
    with torch.inference_mode():
        for rows in (1, 3, 4, 9, 40):
            x = torch.randn(rows, 16)
            assert torch.allclose(split(x), lin(x), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_linear_matches_f_linear_on_each_path(dtype):
    """Few rows (dot products; bf16 in pairs of lanes), 5-63 rows (the weight as brgemm's A operand, x^T in one
    chunk or two; bf16 weights widened 16 rows at a time), from 64 (packed panels of 32 weight rows, the last one
    partial; depth past 2048 in several products), with and without a bias, odd sizes, and a strided x. bf16
    runs its products in fp32 and rounds once: within half a bf16 step (at most 2^-8 relative) of the fp32 result on the
    same bf16 values, plus the fp32 sum's own error."""
    if not packed_linear.plain_available(dtype):
        pytest.skip(f"no pdfleet CPU kernels for {dtype} here")
    g = torch.Generator().manual_seed(0)
    for k, n in ((16, 24), (37, 61), (768, 1280), (2100, 40)):
        w, b = torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
        for rows in (0, 1, 2, 3, 4, 5, 8, 31, 32, 33, 63, 64, 65, 129, 300):
            x = torch.randn(rows, k, generator=g).to(dtype)
            for bias in (None, b):
                want = nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
                got = torch.ops.pdfleet.plain_linear(x, w, bias)
                assert got.shape == (rows, n) and got.dtype == dtype, (k, n, rows)
                tol = want.abs() * (2**-8 if dtype == torch.bfloat16 else 0) + 1e-3
                assert ((got.double() - want).abs() <= tol).all(), (k, n, rows, (got.double() - want).abs().max())
    for rows in (3, 40, 70):  # no input features: the bias alone on every path
        b = torch.randn(5, generator=g).to(dtype)
        assert torch.equal(
            torch.ops.pdfleet.plain_linear(torch.empty(rows, 0, dtype=dtype), torch.empty(5, 0, dtype=dtype), b),
            b.expand(rows, 5),
        )
    x = torch.randn(6, 2 * 16, generator=g).to(dtype)[:, ::2]
    w = torch.randn(24, 16, generator=g).to(dtype)
    want = nn.functional.linear(x.float(), w.float())
    assert torch.allclose(torch.ops.pdfleet.plain_linear(x, w, None).float(), want, atol=1e-2, rtol=1e-2)


def test_plain_linear_refuses_other_dtypes_and_mixed_operands():
    if not packed_linear.plain_available(torch.float32):
        pytest.skip("no pdfleet CPU kernels here")
    x, w = torch.randn(3, 16), torch.randn(24, 16)
    for xx, ww, bb in ((x.half(), w.half(), None), (x.bfloat16(), w, None), (x, w, torch.zeros(24).bfloat16())):
        with pytest.raises(RuntimeError, match="float32 or bfloat16|in w's dtype"):
            torch.ops.pdfleet.plain_linear(xx, ww, bb)


def test_probe_rows_cover_a_lone_decode_and_the_batch():
    assert packed_linear.probe_rows(64) == (1, 8, 32)
    assert packed_linear.probe_rows(4) == (1, 4)
    assert packed_linear.probe_rows(1) == (1,)
    assert packed_linear.probe_rows(64, 512) == (1, 8, 32, packed_linear.PREFILL_PROBE_ROWS)  # and a prefill chunk
    assert packed_linear.probe_rows(4, 16) == (1, 4, 16)  # capped at the step's token budget
    assert packed_linear.probe_rows(4, 4) == (1, 4)


@pytest.mark.parametrize("setting", packed_linear.KERNELS)
def test_a_fixed_setting_times_nothing_and_packs_accordingly(setting):
    if not packed_linear.available(setting, torch.float32):
        pytest.skip(f"no {setting} linear here")
    model = _toy()
    choice = packed_linear.choose(model, torch.float32, (1, 8), setting=setting)
    assert choice.backend == setting and not choice.timed
    assert {s.shape: s.count for s in choice.shapes} == {(16, 24): 2, (24, 40): 1}
    packed = packed_linear.pack_linears(model, choice)
    assert packed == (0 if setting == "torch" else 3)
    kinds = [type(m).__name__ for m in model.modules() if isinstance(m, (nn.Linear, packed_linear.CpuLinear))]
    assert kinds == ["Linear" if setting == "torch" else "CpuLinear"] * 3


def test_the_environment_sets_the_kernel_and_rejects_nonsense(monkeypatch):
    monkeypatch.setenv(packed_linear.ENV, "torch")
    assert packed_linear.choose(_toy(), torch.float32, (1,)).source == "PDFLEET_LINEAR_KERNEL=torch"
    if not packed_linear.plain_available(torch.float32):
        monkeypatch.setenv(packed_linear.ENV, "pdfleet")
        with pytest.raises(ValueError, match="cannot run pdfleet linears"):
            packed_linear.choose(_toy(), torch.float32, (1,))
    monkeypatch.setenv(packed_linear.ENV, "fastest")
    with pytest.raises(ValueError, match="PDFLEET_LINEAR_KERNEL='fastest'"):
        packed_linear.choose(_toy(), torch.float32, (1,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_times_every_shape_at_every_row_count_and_follows_the_rule(dtype):
    kernels = {k for k in packed_linear.KERNELS if packed_linear.available(k, dtype)}
    if kernels == {"torch"}:
        pytest.skip(f"this machine runs neither oneDNN nor plain_linear in {dtype}")
    model = _toy().to(dtype)
    choice = packed_linear.choose(model, dtype, (1, 4, 8), setting="auto")
    assert choice.timed and choice.source.startswith("probe")
    for s in choice.shapes:
        assert {(k, r) for k, r, _ in s.ms} == {(k, r) for k in kernels for r in (1, 4, 8)}
        assert all(t > 0 for _, _, t in s.ms)
        ms = {(k, r): t for k, r, t in s.ms}
        assert s.plan == packed_linear.plan((1, 4, 8), ms, True)  # the toy's shapes are small: both layouts fit
        for r in (1, 4, 8):  # each row count on its fastest kernel
            assert ms[s.kernel_at(r), r] == min(ms[k, r] for k in kernels)
    assert choice.backend in (*packed_linear.KERNELS, "mixed")
    assert packed_linear.choose(model, dtype, (1, 4, 8), setting="auto") is choice  # probed once per process
    packed = packed_linear.pack_linears(model, choice)
    assert packed == sum(s.count for s in choice.shapes if s.kernels != {"torch"})
    x = torch.randn(3, 16).to(dtype)
    assert model[0](x).shape == (3, 24) and "thread(s)" in choice.describe()


@pytest.mark.parametrize("kernel", packed_linear.KERNELS)
def test_each_kernel_matches_transformers(tiny, make_engine, monkeypatch, kernel):
    """Whatever the probe picks on a machine, each kernel alone keeps the engine token-exact."""
    if not packed_linear.available(kernel, torch.float32):
        pytest.skip(f"no {kernel} linear here")
    monkeypatch.setenv(packed_linear.ENV, kernel)
    eng = make_engine(tiny.path)
    assert eng.model_runner.linear_backend == kernel
    prompts = random_prompts(4, 1, 30, seed=11)
    tokens, logits, _ = run_and_capture(eng, prompts)
    assert compare(tiny, prompts, tokens, logits).near_ties <= 1


def test_bf16_on_plain_linear_stays_close_to_the_fp32_oracle(llama, make_engine, monkeypatch):
    """bf16 weights on pdfleet's kernel (on an AVX2 CPU the only fast bf16 linear): first-token logits within
    the bound test_engine_oracle.py holds bf16 to."""
    if not packed_linear.plain_available(torch.bfloat16):
        pytest.skip("no pdfleet CPU kernels here")
    monkeypatch.setenv(packed_linear.ENV, "pdfleet")
    eng = make_engine(llama.path, dtype="bfloat16")
    assert eng.model_runner.linear_backend == "pdfleet"
    prompts = random_prompts(3, 5, 40, seed=12)
    _, logits, _ = run_and_capture(eng, prompts)
    for p, rows in zip(prompts, logits):
        ref = llama.oracle(p).logits[0]
        assert float((rows[0] - ref).abs().max()) < 0.05 * float(ref.abs().max()) + 0.05


def test_engine_runs_the_probed_choice(llama, make_engine, monkeypatch):
    monkeypatch.setenv(packed_linear.ENV, "auto")
    eng = make_engine(llama.path, max_num_seqs=4)
    choice = eng.model_runner.linear_choice
    assert choice is not None and choice.rows == packed_linear.probe_rows(4, eng.config.max_num_batched_tokens)
    assert eng.model_runner.linear_backend == choice.backend
    for m in eng.model_runner.model.modules():
        if isinstance(m, (packed_linear.CpuLinear, nn.Linear)):
            for rows in (1, 2, 4, 7):
                want = choice.kernel_for((m.in_features, m.out_features), rows)
                got = "torch" if isinstance(m, nn.Linear) else packed_linear.kernel_at(m.plan, rows)
                assert got == want
