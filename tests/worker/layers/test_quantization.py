"""Weight-only INT8 (engine.quantization int8): quantization, the loader from an HF checkpoint, and the int8
engine against the same engine on the dequantized weights (what int8 should compute, exactly)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest

torch = pytest.importorskip("torch")

from pdfleet_worker.config import EngineConfig, ModelConfig  # noqa: E402
from pdfleet_worker.layers import quantized_linear as ql  # noqa: E402
from pdfleet_worker.model.llama import LlamaForCausalLM  # noqa: E402
from pdfleet_worker.model.loader import load_model  # noqa: E402
from tests.worker.oracle import random_prompts, run_and_capture  # noqa: E402

# NOTE: the CPU int8 matmul takes its activations in bf16 (torch's kernel is vectorised for bf16 only) and
# returns bf16 before the scale: about 3 significant digits per linear layer.
BF16_RTOL = 2e-2


def test_quantize_rows_is_symmetric_per_row_and_idempotent():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 80, generator=g) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different sizes
    w[5] = 0
    q, s = ql.quantize_rows(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (48,)
    assert int(q.abs().max()) == 127 and bool((q[5] == 0).all())
    nonzero = [i for i in range(48) if i != 5]
    assert bool((q[nonzero].abs().amax(1) == 127).all())  # every row uses its full range
    err = (q.float() * s[:, None] - w).abs()
    assert bool((err <= s[:, None] / 2 + 1e-12).all())  # at most half a step, row by row
    q2, s2 = ql.quantize_rows(q.float() * s[:, None])
    assert torch.equal(q2, q) and torch.allclose(s2, s, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, ql.DEQUANT_ROWS + 5])
def test_int8_linear_computes_x_times_the_dequantized_weight(dtype, rows):
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(96, 64, generator=g) * 0.05, torch.randn(96, generator=g)
    lin = ql.Int8Linear(64, 96, bias=True, dtype=dtype)
    lin.fill_rows(None, w)
    with torch.no_grad():
        lin.bias.copy_(b)
    x = torch.randn(rows, 64, generator=g).to(dtype)
    with torch.inference_mode():
        want = torch.nn.functional.linear(x.float(), lin.dequantized_weight(), lin.bias.float())
        for got in (lin.forward(x), lin._generic(x)):  # the CPU kernels and the plain-ops (CUDA) path
            assert got.dtype == dtype and got.shape == (rows, 96)
            assert float((got.float() - want).abs().max()) <= BF16_RTOL * float(want.abs().max())
    # and the dequantized weight is the float one to within half a step per row (a bf16 model's scales are
    # bf16: up to 127 x 2^-9 of a step more)
    step = float(w.abs().max()) / 127
    assert float((lin.dequantized_weight() - w).abs().max()) <= step * (0.5 if dtype == torch.float32 else 0.75) + 1e-7


def test_the_loader_quantizes_every_linear_from_the_hf_checkpoint(tiny):
    from safetensors import safe_open

    fp = load_model(tiny.path, torch.float32)
    q8 = load_model(tiny.path, torch.float32, quantization="int8")
    linears = [m for m in q8.modules() if isinstance(m, ql.Int8Linear)]
    assert len(linears) == 4 * q8.config.num_layers + 1  # qkv, o, gate_up, down per layer, and the LM head
    assert not any(isinstance(m, torch.nn.Linear) for m in q8.modules())
    assert q8.embed_tokens.weight.dtype == torch.float32 and torch.equal(q8.embed_tokens.weight, fp.embed_tokens.weight)
    assert ql.weight_bytes(q8) < 0.5 * ql.weight_bytes(fp)
    # each fused row range holds its own checkpoint tensor, quantized row by row
    cfg = q8.config
    qrows = cfg.num_heads * cfg.head_dim
    files = [os.path.join(tiny.path, f) for f in os.listdir(tiny.path) if f.endswith(".safetensors")]
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name == "model.layers.1.self_attn.k_proj.weight":
                    want_q, want_s = ql.quantize_rows(f.get_tensor(name))
                    layer = q8.layers[1].self_attn.qkv_proj
                    kv = cfg.num_kv_heads * cfg.head_dim
                    assert torch.equal(layer.qweight[qrows : qrows + kv], want_q)
                    assert torch.equal(layer.scale[qrows : qrows + kv], want_s)
    if cfg.tie_word_embeddings:  # the LM head: its own int8 copy of the embedding table
        want_q, _ = ql.quantize_rows(fp.embed_tokens.weight)
        assert torch.equal(q8.lm_head.qweight, want_q)
    if cfg.qkv_bias:
        assert torch.equal(q8.layers[0].self_attn.qkv_proj.bias, fp.layers[0].self_attn.qkv_proj.bias)


def test_unknown_quantization_is_refused_naming_the_field(llama):
    with pytest.raises(ValueError, match="quantization must be one of .*int4"):
        EngineConfig(model=llama.path, quantization="int4")
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model(llama.path, quantization="fp8")


def test_a_truncated_checkpoint_is_refused(llama, tmp_path):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "bad"
    shutil.copytree(llama.path, d)
    (path,) = [p for p in d.iterdir() if p.suffix == ".safetensors"]
    sd = load_file(path)
    sd["model.layers.0.mlp.down_proj.weight"] = sd["model.layers.0.mlp.down_proj.weight"][:, :-1].contiguous()
    save_file(sd, path)
    with pytest.raises(ValueError, match="down_proj.weight"):
        load_model(str(d), quantization="int8")
    del sd["model.layers.0.mlp.down_proj.weight"]
    save_file(sd, path)
    with pytest.raises(ValueError, match="lacks weights"):
        load_model(str(d), quantization="int8")


def test_dequant_rows_are_chosen_per_shape_by_timing_both_paths():
    """The probe sets one row count per shape, from the probed ones (or twice the largest), on every
    module of that shape; each module then takes the int8 kernel below it and the widened GEMM from it,
    and both compute x times the dequantized weight. Which count wins is the machine's business."""
    g = torch.Generator().manual_seed(2)
    model = torch.nn.Sequential(
        ql.Int8Linear(64, 96, bias=False, dtype=torch.float32),
        ql.Int8Linear(64, 96, bias=False, dtype=torch.float32),
        ql.Int8Linear(96, 32, bias=False, dtype=torch.float32),
    )
    for m in model:
        m.fill_rows(None, torch.randn(m.out_features, m.in_features, generator=g) * 0.05)
    chosen = ql.choose_dequant_rows(model, rows=(2, 8, 32))
    assert set(chosen) == {(64, 96), (96, 32)}
    assert all(v in (2, 8, 32, 64) for v in chosen.values())
    assert (
        model[0].dequant_rows == model[1].dequant_rows == chosen[(64, 96)] and model[2].dequant_rows == chosen[(96, 32)]
    )
    with torch.inference_mode():
        for rows in (1, chosen[(64, 96)] - 1, chosen[(64, 96)]):
            x = torch.randn(max(rows, 1), 64, generator=g)
            want = torch.nn.functional.linear(x, model[0].dequantized_weight())
            assert float((model[0](x) - want).abs().max()) <= BF16_RTOL * float(want.abs().max())


def write_dequantized_checkpoint(model_dir: str, out: str) -> None:
    """The checkpoint an int8 load should be equivalent to: every linear weight replaced by its
    dequantized int8 values (the LM head untied from the embedding, which stays float)."""
    from pdfleet_worker.model.model_train import save_hf

    q8 = load_model(model_dir, torch.float32, quantization="int8")
    shutil.copytree(model_dir, out)
    for f in os.listdir(out):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            os.unlink(os.path.join(out, f))
    with open(os.path.join(out, "config.json")) as f:
        raw = json.load(f)
    raw["tie_word_embeddings"] = False
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(raw, f)
    ref = LlamaForCausalLM(dataclasses.replace(q8.config, tie_word_embeddings=False))
    with torch.no_grad():
        for name, mod in q8.named_modules():
            if isinstance(mod, ql.Int8Linear):
                dst = ref.get_submodule(name)
                dst.weight.copy_(mod.dequantized_weight())
                if mod.bias is not None:
                    dst.bias.copy_(mod.bias)
        for name, p in q8.named_parameters():
            if not name.endswith("bias"):
                ref.get_parameter(name).copy_(p)
    save_hf(ref, out)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_int8_engine_decodes_as_the_engine_on_the_dequantized_weights(tiny, make_engine, tmp_path, dtype):
    """Greedy tokens and logits of the int8 engine against the same engine (same dtype, no quantization) on a
    checkpoint holding the dequantized weights: only the int8 matmul's bf16 rounding may differ."""
    ref_dir = str(tmp_path / "dequantized")
    write_dequantized_checkpoint(tiny.path, ref_dir)
    prompts = random_prompts(6, 1, 40, seed=7) + [list(range(3, 3 + 80))]  # the last one: a prefill past DEQUANT_ROWS
    q8 = make_engine(tiny.path, dtype=dtype, quantization="int8", block_size=4, max_num_batched_tokens=128)
    ref = make_engine(ref_dir, dtype=dtype, block_size=4, max_num_batched_tokens=128)
    assert isinstance(q8.model_runner.model.layers[0].mlp.down_proj, ql.Int8Linear)
    got_t, got_l, _ = run_and_capture(q8, prompts)
    want_t, want_l, _ = run_and_capture(ref, prompts)
    near_ties = 0
    for toks, rows, ref_toks, ref_rows in zip(got_t, got_l, want_t, want_l):
        for j, (a, b) in enumerate(zip(toks, ref_toks)):
            scale = float(ref_rows[j].abs().max())
            assert float((rows[j] - ref_rows[j]).abs().max()) <= BF16_RTOL * 2 * scale, (j, dtype)
            if a != b:
                top2 = torch.topk(ref_rows[j], 2).values
                assert float(top2[0] - top2[1]) <= BF16_RTOL * 2 * scale, f"token {a} != {b} without a near-tie"
                near_ties += 1
                break  # the sequences diverge from here
    # NOTE: in bf16 the reference itself rounds q * scale to bf16, so it is a little further away
    assert near_ties <= (1 if dtype == "float32" else 3)


def test_the_int8_engine_is_not_the_float_engine(llama, make_engine):
    """The comparison above would pass vacuously if int8 were ignored: the quantized logits differ from the
    float model's, by about what rounding the weights to 8 bits does."""
    prompts = random_prompts(2, 8, 16, seed=3)
    _, q_logits, _ = run_and_capture(make_engine(llama.path, quantization="int8"), prompts)
    _, f_logits, _ = run_and_capture(make_engine(llama.path), prompts)
    diff = max(float((a - b).abs().max()) for ra, rb in zip(q_logits, f_logits) for a, b in zip(ra, rb))
    scale = max(float(r.abs().max()) for rows in f_logits for r in rows)
    assert 1e-4 * scale < diff < 0.1 * scale


def test_worker_flag_and_engine_file_reach_the_engine_and_int8_leaves_more_kv_room(llama, tmp_path):
    import argparse

    from pdfleet_worker.server import worker_config

    p = argparse.ArgumentParser()
    worker_config.add_arguments(p)
    cfg = worker_config.from_args(p.parse_args(["--model", llama.path, "--quantization", "int8", "--device", "cpu"]))
    assert cfg.engine.quantization == "int8"
    f = tmp_path / "engine.json"
    f.write_text(json.dumps({"quantization": "int8"}))
    cfg = worker_config.from_args(p.parse_args(["--model", llama.path, "--engine-config", str(f), "--device", "cpu"]))
    assert cfg.engine.quantization == "int8"
    f.write_text(json.dumps({"quantization": "int4"}))
    with pytest.raises(ValueError, match="quantization"):
        worker_config.from_args(p.parse_args(["--model", llama.path, "--engine-config", str(f), "--device", "cpu"]))
    with pytest.raises(SystemExit):
        p.parse_args(["--model", llama.path, "--quantization", "int4"])
    mcfg = ModelConfig.from_dir(llama.path)
    loaded = load_model(llama.path, torch.float32, quantization="int8")
    # the estimate the KV pool is sized with is the loaded size (within the scales' rounding)
    assert abs(worker_config.int8_weight_bytes(mcfg, 4) - ql.weight_bytes(loaded)) <= 0.02 * ql.weight_bytes(loaded)
