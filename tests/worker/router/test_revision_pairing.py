"""Issue 24, rule 6: PD pairs by revision. The KV layout identifies the weights themselves (config.json, the safetensors
headers and a sample of every tensor), so two checkpoints under the same directory name never exchange KV: a mismatched
pull is refused and recomputed on the decode worker, counted; the router sends a request's prefill and decode to
workers of one revision and layout, else lets the decode worker prefill. Pure checks, then real processes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import openai
import pytest

from pdfleet_worker import metrics as m
from pdfleet_worker.engine.kv_layout import SAMPLE_BYTES, KVLayout, weights_digest
from pdfleet_worker.kv_transfer import connector as c
from pdfleet_worker.router import pairing
from tests.worker.kv_transfer.test_kv_transfer import fresh_prompt, sample
from tests.worker.processes import MODEL, pool_whole, router, start_all, wait_until, worker, worker_urls


def new_weights(model_dir: str, dest: Path, seed: int) -> str:
    """A copy of the model directory under `dest/model` whose tensors are drawn with another seed: the same config,
    tokenizer, names, shapes and offsets (a fine-tune's new revision), other values."""
    import json

    from safetensors.torch import save_file

    from pdfleet_worker.model.model_init import random_state_dict

    target = dest / "model"
    shutil.copytree(model_dir, target)
    cfg = json.loads((target / "config.json").read_text())
    save_file(random_state_dict(cfg, seed, "float32"), str(target / "model.safetensors"), metadata={"format": "pt"})
    return str(target)


@pytest.fixture(scope="module")
def revisions(model_dir, tmp_path_factory) -> tuple[str, str]:
    """Two checkpoints, both in a directory named `model`: revision 1 (the session's tiny model) and revision 2."""
    one = tmp_path_factory.mktemp("rev1") / "model"
    shutil.copytree(model_dir, one)
    two = new_weights(model_dir, tmp_path_factory.mktemp("rev2"), seed=1)
    return str(one), two


# --- pure ------------------------------------------------------------------------------------------


def test_the_digest_sees_the_weights_not_the_directory_name(revisions, tmp_path):
    one, two = revisions
    assert os.path.basename(one) == os.path.basename(two) == "model"
    assert (Path(one) / "config.json").read_bytes() == (Path(two) / "config.json").read_bytes()
    assert weights_digest(one) != weights_digest(two), "same config and headers, other tensor data"
    elsewhere = tmp_path / "renamed"
    shutil.copytree(one, elsewhere)
    assert weights_digest(str(elsewhere)) == weights_digest(one), "a copy under another name is the same weights"
    # a change within a tensor's sampled bytes changes it; the file is read only there (NOTE in kv_layout.py)
    blob = bytearray((elsewhere / "model.safetensors").read_bytes())
    blob[-1] ^= 0xFF  # the last byte of the last tensor's data
    (elsewhere / "model.safetensors").write_bytes(bytes(blob))
    assert weights_digest(str(elsewhere)) != weights_digest(one)
    assert SAMPLE_BYTES <= 64 << 10
    (elsewhere / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(ValueError, match="truncated safetensors header"):
        weights_digest(str(elsewhere))


def test_the_layout_hash_covers_weights_and_quantization():
    base = KVLayout("digest-a", "float32", "auto", 4, 4, 32, 16)
    assert base.compat_hash != KVLayout("digest-b", "float32", "auto", 4, 4, 32, 16).compat_hash
    assert base.compat_hash != KVLayout("digest-a", "float32", "auto", 4, 4, 32, 16, quantization="int8").compat_hash


def test_pairing_plans_by_revision_and_layout():
    def load(rev, compat):
        return {"revision": rev, "compat_hash": compat}

    plan = pairing.plan([load("1", "a"), load("2", "b")], [load("2", "b")])
    assert plan.paired and plan.allows(load("2", "b")) and not plan.allows(load("1", "a"))
    # the same layout under another revision is no pair (a revision may change more than the weights)
    assert not pairing.plan([load("1", "a")], [load("2", "a")]).paired
    assert not pairing.plan([load("1", "a")], [load("1", "b")]).paired
    assert pairing.plan([load(None, "a")], [load(None, "a")]).paired  # workers without --revision pair by layout
    # a worker that reports no layout (vLLM) leaves the tier unpaired, as before
    plan = pairing.plan([{"model": "x"}], [load("1", "a")])
    assert plan.paired and plan.keys is None and plan.allows({"anything": 1})
    assert pairing.same(load("1", "a"), load("1", "a")) and not pairing.same(load("1", "a"), load("2", "a"))
    # a role with no worker in rotation is not a missing pair (the router's fallbacks, or its 503, answer that)
    assert pairing.plan([], [load("1", "a")]).paired and pairing.plan([load("1", "a")], []).paired
    assert pairing.key({"compat_hash": "a", "revision": 7}) == ("7", "a")


# --- real processes ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(logdir, revisions):
    one, two = revisions
    p1 = worker(logdir, one, "prefill", "--revision", "1", "--kv-lease", "5s", name="prefill-rev1")
    p2 = worker(logdir, two, "prefill", "--revision", "2", "--kv-lease", "5s", name="prefill-rev2")
    d1 = worker(logdir, one, "decode", "--revision", "1", "--kv-on-failure", "recompute", name="decode-rev1")
    c1 = worker(logdir, one, "both", name="colo-rev1")
    c2 = worker(logdir, two, "both", name="colo-rev2")
    procs = [p1, p2, d1, c1, c2]
    start_all(*procs)
    try:
        yield {"p1": p1, "p2": p2, "d1": d1, "c1": c1, "c2": c2}
    finally:
        for proc in procs:
            proc.stop()


def greedy(url: str, prompt: list[int], **body) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=60)
    return (
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True, **body}
        )
        .choices[0]
        .text
    )


def test_load_reports_the_revision_and_the_weights(fleet, revisions):
    one, two = revisions
    l1, l2, ld = fleet["p1"].load(), fleet["p2"].load(), fleet["d1"].load()
    assert (l1["revision"], l2["revision"], ld["revision"]) == ("1", "2", "1")
    assert l1["weights_digest"] == ld["weights_digest"] == weights_digest(one) != l2["weights_digest"]
    assert l1["compat_hash"] == ld["compat_hash"] != l2["compat_hash"]


def test_kv_of_other_weights_is_refused_and_recomputed_on_decode(fleet):
    p2, d1 = fleet["p2"], fleet["d1"]
    prompt = fresh_prompt(40, seed=81)
    want, other = greedy(fleet["c1"].url, prompt), greedy(fleet["c2"].url, prompt)
    assert want != other, "the two revisions answer differently: a wrong KV would show"
    before = sample(d1.metrics_text(), m.KV_TRANSFER_FAILURES_TOTAL.name, reason=c.WEIGHTS_MISMATCH)
    released = p2.load()["leases_released"]
    held = httpx.post(
        f"{p2.url}/v1/completions",
        timeout=60,
        json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    ).json()
    params = held["kv_transfer_params"]
    assert (params["revision"], params["weights"]) == ("2", p2.load()["weights_digest"])
    got = greedy(d1.url, prompt, kv_transfer_params=params)
    assert got == want, "the decode worker's own weights computed the prompt"
    text = d1.metrics_text()
    assert sample(text, m.KV_TRANSFER_FAILURES_TOTAL.name, reason=c.WEIGHTS_MISMATCH) == before + 1
    assert sample(text, m.KV_TRANSFER_BYTES_TOTAL.name, direction="received") == 0, "nothing was pulled"
    # the refusal acks the lease at once (released, not left to expire)
    wait_until(lambda: p2.load()["leases_released"] == released + 1, timeout=10, what="the refused lease released")
    assert pool_whole(p2) and pool_whole(d1)


def test_the_router_pairs_by_revision_and_prefills_locally_when_no_pair_exists(fleet, logdir):
    p1, p2, d1 = fleet["p1"], fleet["p2"], fleet["d1"]
    mismatches = sample(d1.metrics_text(), m.KV_TRANSFER_FAILURES_TOTAL.name, reason=c.WEIGHTS_MISMATCH)
    both = router(logdir, "--prefill", p1.url, p2.url, "--decode", d1.url, name="router-two-revisions")
    only_new = router(logdir, "--prefill", p2.url, "--decode", d1.url, name="router-no-pair")
    try:
        start_all(both, only_new)
        client = openai.OpenAI(base_url=f"{both.url}/v1", api_key="-", max_retries=0, timeout=60)
        ids = worker_urls(both)
        for i in range(6):  # the picker would alternate between two idle prefill workers: pairing never does
            prompt = fresh_prompt(24, seed=90 + i)
            raw = client.completions.with_raw_response.create(
                model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
            )
            assert ids[raw.headers["x-pdfleet-prefill"]] == p1.url
            assert raw.parse().choices[0].text == greedy(fleet["c1"].url, prompt)
        text = httpx.get(f"{both.url}/metrics", timeout=10).text
        assert sample(text, m.ROUTER_PD_FALLBACKS_TOTAL.name, tier="default", reason="no_pair") == 0
        # revision 2's prefill worker alone has no decode partner: the decode worker computes the prompt itself
        client = openai.OpenAI(base_url=f"{only_new.url}/v1", api_key="-", max_retries=0, timeout=60)
        for i, stream in enumerate((False, True)):
            prompt = fresh_prompt(24, seed=100 + i)
            raw = client.completions.with_raw_response.create(
                model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=stream, extra_body={"ignore_eos": True}
            )
            assert raw.headers["x-pdfleet-prefill"] == "local"
            parsed = raw.parse()
            text_out = "".join(ch.choices[0].text for ch in parsed if ch.choices) if stream else parsed.choices[0].text
            assert text_out == greedy(fleet["c1"].url, prompt)
        text = httpx.get(f"{only_new.url}/metrics", timeout=10).text
        assert sample(text, m.ROUTER_PD_FALLBACKS_TOTAL.name, tier="default", reason="no_pair") == 2
        assert sample(text, m.ROUTER_LOCAL_PREFILLS_TOTAL.name, tier="default") == 2
        assert sample(text, m.ROUTER_REQUESTS_TOTAL.name, code="200", tier="default") == 2
        # no KV ever crossed revisions: the decode worker refused none, because none was offered
        assert sample(d1.metrics_text(), m.KV_TRANSFER_FAILURES_TOTAL.name, reason=c.WEIGHTS_MISMATCH) == mismatches
    finally:
        both.stop()
        only_new.stop()
