"""`pdfleet model init`: a regular HF directory (transformers loads it), a real BPE tokenizer, determinism."""

from __future__ import annotations

import argparse
import hashlib
import os

import pytest
import torch
import transformers

from pdfleet_worker import cli
from pdfleet_worker.model.tokenizer import IncrementalDetokenizer, Tokenizer
from pdfleet_worker.sampling_params import SamplingParams

TEXTS = [
    "hello world",
    "def f(x):\n    return x ** 2  # comment",
    "Größe naïve café — «quotes»",
    "模型用中文回答问题。",
    "emoji 🙂🚀 and \u200b zero width",
    "  leading and trailing  ",
    "\t\n\r",
    "ü" * 7,
    "<|im_start|>user\nhi<|im_end|>",
    "\U0001f9ec\U00010348 rare planes",
    "a\x00b",
]


def _init(path, *extra) -> int:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["model", "init", str(path), *extra])
    return args.func(args)


@pytest.fixture(scope="session")
def inited(tmp_path_factory):
    path = tmp_path_factory.mktemp("init") / "tiny"
    assert _init(path, "--preset", "tiny", "--seed", "3") == 0
    return str(path)


def test_directory_is_a_regular_hf_model(inited):
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert os.path.isfile(os.path.join(inited, name)), name
    hf_tok = transformers.AutoTokenizer.from_pretrained(inited)
    hf = transformers.AutoModelForCausalLM.from_pretrained(inited, dtype=torch.float32)
    assert type(hf).__name__ == "LlamaForCausalLM"
    n = sum(p.numel() for p in hf.parameters())
    assert 1e6 < n < 10e6, n
    ours = Tokenizer(inited)
    for t in TEXTS:
        assert ours.encode(t) == hf_tok(t).input_ids
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs) == hf_tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )


def test_byte_level_bpe_round_trips_any_utf8(inited):
    tok = Tokenizer(inited)
    assert tok.vocab_size == 4096
    code = "import os\nimport sys\n\n\ndef main(self, value):\n    return self.value is None\n"
    assert len(tok.encode(code, add_special_tokens=False)) < len(code) / 3  # merges were learned
    for t in TEXTS:
        ids = tok.encode(t, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == t
        # Streaming: token by token, deltas never split a character and add up to the text.
        detok = IncrementalDetokenizer(tok, [])
        pieces = [detok.step(ids[: i + 1]) for i in range(len(ids))]
        assert "".join(pieces) == tok.decode(ids), t
        assert all("\ufffd" not in p for p in pieces)


def test_init_is_deterministic(tmp_path):
    def digest(path):
        return {
            f: hashlib.sha256(open(os.path.join(path, f), "rb").read()).hexdigest() for f in sorted(os.listdir(path))
        }

    _init(tmp_path / "a", "--seed", "5")
    _init(tmp_path / "b", "--seed", "5")
    _init(tmp_path / "c", "--seed", "6")
    a, b, c = digest(tmp_path / "a"), digest(tmp_path / "b"), digest(tmp_path / "c")
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"] and a["tokenizer.json"] == c["tokenizer.json"]


def test_engine_on_inited_model_matches_transformers_and_stops_on_strings(inited, make_engine):
    hf = transformers.AutoModelForCausalLM.from_pretrained(inited, dtype=torch.float32)
    eng = make_engine(inited)
    prompt = eng.tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku."}])
    ids = eng.tokenizer.encode(prompt)
    out = eng.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    x = torch.tensor([ids])
    ref = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert out.new_token_ids == ref[0, len(ids) :].tolist()
    assert out.new_text == eng.tokenizer.decode(out.new_token_ids)
    # Stop strings: cut the text where a stop string starts, finish with "stop", and what was
    # streamed adds up to the final text (a stop string's beginning is held back, not streamed).
    text = out.new_text
    assert len(text) > 6
    stop = text[3:6]
    eng.add_request(
        "s", prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop, "\x07never"])
    )
    streamed, final = "", None
    while eng.has_unfinished_requests():
        for o in eng.step():
            streamed += o.new_text
            final = o
    assert final.finish_reason == "stop" and streamed == text[: text.index(stop)]
    kept = eng.generate(
        [prompt],
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
    )[0]
    assert kept.new_text == text[: text.index(stop) + 3]


def test_qwen2_arch_and_bf16_init_load_in_transformers(tmp_path, make_engine):
    _init(tmp_path / "q", "--arch", "qwen2", "--dtype", "bfloat16", "--tie-word-embeddings")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "q"))
    assert type(hf).__name__ == "Qwen2ForCausalLM" and hf.dtype == torch.bfloat16
    eng = make_engine(str(tmp_path / "q"), dtype="bfloat16")
    assert eng.generate(["hi"], SamplingParams(max_tokens=3, temperature=0))[0].num_output_tokens >= 1


def test_cli_module_does_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys, argparse; from pdfleet_worker import cli; p = argparse.ArgumentParser();"
        "cli.register(p.add_subparsers()); assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_if_missing_keeps_refuses_or_writes(inited, tmp_path, capsys):
    """`make demo`'s `--if-missing`: the same preset is kept byte for byte, another preset or a model init did not
    write is refused (exit 2, nothing touched), an empty directory is written."""
    import json
    import shutil

    kept = tmp_path / "kept"
    shutil.copytree(inited, kept)
    weights = (kept / "model.safetensors").read_bytes()
    assert _init(kept, "--preset", "tiny", "--if-missing") == 0
    assert "kept" in capsys.readouterr().out
    assert (kept / "model.safetensors").read_bytes() == weights

    other = tmp_path / "other"
    shutil.copytree(inited, other)
    record = json.loads((other / "tokenizer_config.json").read_text())
    record["pdfleet_init"]["preset"] = "small"
    (other / "tokenizer_config.json").write_text(json.dumps(record))
    assert _init(other, "--preset", "tiny", "--if-missing") == 2
    err = capsys.readouterr().err
    assert "holds a small llama model, not the tiny llama one" in err and f"rm -r {other}" in err
    assert (other / "model.safetensors").read_bytes() == weights
    assert _init(other, "--preset", "tiny", "--arch", "qwen2", "--if-missing") == 2

    foreign = tmp_path / "foreign"
    shutil.copytree(inited, foreign)
    del record["pdfleet_init"]
    (foreign / "tokenizer_config.json").write_text(json.dumps(record))
    assert _init(foreign, "--preset", "tiny", "--if-missing") == 2
    assert "did not write" in capsys.readouterr().err

    fresh = tmp_path / "fresh"
    assert _init(fresh, "--preset", "tiny", "--seed", "3", "--if-missing") == 0
    assert (fresh / "model.safetensors").read_bytes() == weights  # the same seed as `inited`
