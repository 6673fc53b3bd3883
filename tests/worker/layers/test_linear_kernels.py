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


def test_decide_is_the_geometric_mean_below_one():
    assert packed_linear.decide([0.5]) == "onednn"
    assert packed_linear.decide([2.0, 0.4]) == "onednn"  # mean of logs: 0.8
    assert packed_linear.decide([2.0, 0.5]) == "torch"  # exactly 1: no reason to pack
    assert packed_linear.decide([1.5, 0.9, 0.9]) == "torch"
    with pytest.raises(AssertionError):
        packed_linear.decide([])


def test_plan_loses_least_to_the_faster_kernel_and_splits_where_it_may():
    rows = (1, 8, 32)
    assert packed_linear.plan(rows, [0.9, 0.8, 0.7], split_ok=True) == ("onednn", "", 0)
    assert packed_linear.plan(rows, [1.2, 1.1, 1.3], split_ok=True) == ("torch", "", 0)
    assert packed_linear.plan(rows, [1.2, 0.6, 0.8], split_ok=True) == ("onednn", "torch", 8)
    assert packed_linear.plan(rows, [0.8, 0.9, 1.2], split_ok=True) == ("torch", "onednn", 32)
    assert packed_linear.plan(rows, [1.2, 0.6, 0.8], split_ok=False) == ("onednn", "", 0)  # too big to hold twice
    # the winner changes twice: the split that costs least (1.1x at 32 rows, not 1.2x at 1 row)
    assert packed_linear.plan(rows, [1.2, 0.6, 1.1], split_ok=True) == ("onednn", "torch", 8)
    assert packed_linear.plan((1, 8), [2.0, 0.5], split_ok=True) == ("onednn", "torch", 8)
    for ratios in ([1.3, 0.7, 0.9], [0.9, 1.05, 1.4], [1.0, 1.0, 1.0]):  # one kernel: the geometric-mean rule
        assert packed_linear.plan(rows, ratios, split_ok=False)[0] == packed_linear.decide(ratios)


@pytest.mark.parametrize("split", [{"plain_below": 4}, {"plain_from": 4}])
def test_a_split_linear_computes_the_same_on_both_sides(split):
    if not packed_linear.onednn_available(torch.float32):
        pytest.skip("this torch build has no oneDNN linear")
    lin = nn.Linear(16, 24)
    packed = packed_linear.PackedLinear(lin, **split)
    assert packed.weight is not None and "F.linear" in packed.extra_repr()
    with torch.inference_mode():
        for rows in (1, 3, 4, 9):
            x = torch.randn(rows, 16)
            assert torch.allclose(packed(x), lin(x), atol=1e-5)


def test_probe_rows_cover_a_lone_decode_and_the_batch():
    assert packed_linear.probe_rows(64) == (1, 8, 32)
    assert packed_linear.probe_rows(4) == (1, 4)
    assert packed_linear.probe_rows(1) == (1,)


@pytest.mark.parametrize("setting", ["torch", "onednn"])
def test_a_fixed_setting_times_nothing_and_packs_accordingly(setting):
    if setting == "onednn" and not packed_linear.onednn_available(torch.float32):
        pytest.skip("this torch build has no oneDNN linear")
    model = _toy()
    choice = packed_linear.choose(model, torch.float32, (1, 8), setting=setting)
    assert choice.backend == setting and not choice.timed
    assert {s.shape: s.count for s in choice.shapes} == {(16, 24): 2, (24, 40): 1}
    packed = packed_linear.pack_linears(model, choice)
    assert packed == (3 if setting == "onednn" else 0)
    kinds = [type(m).__name__ for m in model.modules() if isinstance(m, (nn.Linear, packed_linear.PackedLinear))]
    assert kinds == ["PackedLinear" if setting == "onednn" else "Linear"] * 3


def test_the_environment_sets_the_kernel_and_rejects_nonsense(monkeypatch):
    monkeypatch.setenv(packed_linear.ENV, "torch")
    assert packed_linear.choose(_toy(), torch.float32, (1,)).source == "PDFLEET_LINEAR_KERNEL=torch"
    monkeypatch.setenv(packed_linear.ENV, "fastest")
    with pytest.raises(ValueError, match="PDFLEET_LINEAR_KERNEL='fastest'"):
        packed_linear.choose(_toy(), torch.float32, (1,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_times_every_shape_at_every_row_count_and_follows_the_rule(dtype):
    if not packed_linear.onednn_available(dtype):
        pytest.skip(f"this torch build has no oneDNN linear in {dtype}")
    model = _toy().to(dtype)
    choice = packed_linear.choose(model, dtype, (1, 4, 8), setting="auto")
    assert choice.timed and choice.source.startswith("probe")
    for s in choice.shapes:
        assert {(k, r) for k, r, _ in s.ms} == {(k, r) for k in packed_linear.KERNELS for r in (1, 4, 8)}
        assert all(t > 0 for _, _, t in s.ms)
        assert (s.kernel, s.below, s.split_at) == packed_linear.plan((1, 4, 8), [s.ratio(r) for r in (1, 4, 8)], True)
        winners = ["onednn" if s.ratio(r) < 1 else "torch" for r in (1, 4, 8)]
        if sum(a != b for a, b in zip(winners, winners[1:])) <= 1:  # each row count where it won
            assert [s.kernel_at(r) for r in (1, 4, 8)] == winners
    assert choice.backend in ("torch", "onednn", "mixed")
    assert packed_linear.choose(model, dtype, (1, 4, 8), setting="auto") is choice  # probed once per process
    packed = packed_linear.pack_linears(model, choice)
    assert packed == sum(s.count for s in choice.shapes if "onednn" in (s.kernel, s.below))
    x = torch.randn(3, 16).to(dtype)
    assert model[0](x).shape == (3, 24) and "thread(s)" in choice.describe()


@pytest.mark.parametrize("kernel", ["torch", "onednn"])
def test_each_kernel_matches_transformers(tiny, make_engine, monkeypatch, kernel):
    """Whatever the probe picks on a machine, each kernel alone keeps the engine token-exact."""
    if kernel == "onednn" and not packed_linear.onednn_available(torch.float32):
        pytest.skip("this torch build has no oneDNN linear")
    monkeypatch.setenv(packed_linear.ENV, kernel)
    eng = make_engine(tiny.path)
    assert eng.model_runner.linear_backend == kernel
    prompts = random_prompts(4, 1, 30, seed=11)
    tokens, logits, _ = run_and_capture(eng, prompts)
    assert compare(tiny, prompts, tokens, logits).near_ties <= 1


def test_engine_runs_the_probed_choice(llama, make_engine, monkeypatch):
    monkeypatch.setenv(packed_linear.ENV, "auto")
    eng = make_engine(llama.path, max_num_seqs=4)
    choice = eng.model_runner.linear_choice
    assert choice is not None and choice.rows == (1, 4)
    assert eng.model_runner.linear_backend == choice.backend
    for m in eng.model_runner.model.modules():
        if isinstance(m, (packed_linear.PackedLinear, nn.Linear)):
            for rows in (1, 2, 4, 7):
                want = choice.kernel_for((m.in_features, m.out_features), rows)
                if isinstance(m, nn.Linear):
                    assert want == "torch"
                else:
                    plain = rows < m.plain_below or 0 < m.plain_from <= rows
                    assert want == ("torch" if plain else "onednn")
