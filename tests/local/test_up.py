"""`pdfleet up` end to end: real router and worker processes serving the openai SDK, a queue surge growing the decode
pool and its shrink after the stabilization window, a kill -9 restarted with back-off, SIGTERM leaving no process and no
port behind, and the demo's bursty run printing its summary last."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from pdfleet_operator.decide import autoscaler
from pdfleet_operator.local.ports import port_free
from tests.local.conftest import UpProcess, pid_alive, run_token, write_spec
from tests.support.components import free_port

pytestmark = pytest.mark.slow

# Short windows so that growth and shrink both happen within seconds.
FAST = {
    "autoscaling.interval": "1s",
    "autoscaling.scaleDownStabilization": "4s",
    "autoscaling.scaleDownDelayAfterScaleUp": "2s",
    "decode.targetQueuePerReplica": 4,
}
# Every reason a decode scale-up (1 -> more) or scale-down may carry here: the queue, prefill's backlog, the
# token rate, or a step capped at maxReplicas; down: the queue or the token rate (one replica a step, so never
# MinReplicas; the pdRatio bounds 0.125..8 never bind at these sizes, nor does capacity on `pdfleet up`).
UP_REASONS = "|".join(
    (
        autoscaler.QUEUE_ABOVE_TARGET,
        autoscaler.QUEUE_GROWING,
        autoscaler.PREFILL_BACKLOG,
        autoscaler.TOKEN_RATE_ABOVE_CAPACITY,
        autoscaler.MAX_REPLICAS,
    )
)
DOWN_REASONS = "|".join((autoscaler.QUEUE_BELOW_TARGET, autoscaler.TOKEN_RATE_BELOW_CAPACITY))


def decode_urls(run_dir) -> list[str]:
    try:
        return json.loads((run_dir / "workers.json").read_text())["decode"]
    except (OSError, ValueError, KeyError):
        return []


def healthy(port: int, role: str, run_dir) -> list[str]:
    """The workers of a role the router has in rotation (its /workers, behind the run's token)."""
    workers = httpx.get(f"http://127.0.0.1:{port}/workers", headers=run_token(run_dir), timeout=5).json()["workers"]
    return [w["url"] for w in workers if w["role"] == role and w["healthy"]]


def wait_for(predicate, timeout: float, what: str, up: UpProcess):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} not reached within {timeout}s; output:\n{up.output()[-6000:]}")


def test_up_serves_the_sdk_scales_with_a_surge_restarts_a_killed_worker_and_stops_clean(tmp_path, model_dir):
    spec = write_spec(tmp_path, model_dir, **FAST)
    port, run_dir = free_port(), tmp_path / "run"
    up = UpProcess([str(spec), "--port", str(port), "--run-dir", str(run_dir)], cwd=tmp_path)
    try:
        up.wait_line(r"fleet ready after", timeout=120)
        # the banner's lines follow the ready line, read by UpProcess's thread a moment later
        up.wait_line(re.escape(f"curl http://127.0.0.1:{port}/v1/completions"), timeout=10)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        done = client.completions.create(model="tiny", prompt="Hello", max_tokens=8)
        assert done.usage.completion_tokens == 8 and done.choices[0].text
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
        assert sum(1 for c in chat if c.choices and c.choices[0].delta.content is not None) >= 1
        assert len(decode_urls(run_dir)) == 1

        # A surge: far more concurrent long streams (24) than one decode replica's target (4) of running +
        # waiting. It is sustained (each stream that ends is replaced) until the scale-up shows, then 8 of them
        # (two replicas' target: the pool keeps one new replica) until a new replica is ready and in the router's
        # rotation (decode-1 or decode-2: when 1 -> 3 starts both at once and the pool then shrinks to 2, the one
        # left is whichever is ready first, and on a busy machine that can be decode-2);
        # then stopped, and every stream is checked. One wave of 24 x 300 tokens takes about 2 s on a quiet CI
        # machine, which a faster one can run between two 1 s ticks, and a wave that ends while the new replica still
        # starts (a loaded machine) lets the pool shrink before it is ready. The 8 leave the cores to its start.
        scaled, stop = threading.Event(), threading.Event()

        def streams(i: int) -> list[int]:
            counts = []
            while not stop.is_set() and not (i >= 8 and scaled.is_set()):
                out = client.completions.create(
                    model="tiny",
                    prompt=f"surge {i}",
                    max_tokens=300,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                counts.append([c.usage.completion_tokens for c in out if c.usage][-1])
            return counts

        mark = len(up.lines)
        started = time.monotonic()
        with ThreadPoolExecutor(24) as pool:
            futures = [pool.submit(streams, i) for i in range(24)]
            try:
                up.wait_line(rf"scale\s+decode 1 -> [23] \(({UP_REASONS}):", timeout=60, after=mark)
                scaled.set()
                scaled_s = time.monotonic() - started
                wait_for(lambda: len(decode_urls(run_dir)) >= 2, 10, "a second decode worker in the router's list", up)
                up.wait_line(r"decode-[1-9]\d*\s+ready", timeout=120, after=mark)
                wait_for(
                    lambda: len(healthy(port, "decode", run_dir)) >= 2,
                    10,
                    "the router routing to the new decode worker",
                    up,
                )
            finally:
                scaled.set()
                stop.set()
                quiet = len(up.lines)
            surge_s = time.monotonic() - started
            finished = [n for f in futures for n in f.result(timeout=180)]
        print(
            f"surge: {len(finished)} streams over {surge_s:.1f}s: scaled up after {scaled_s:.1f}s, a new decode "
            "replica ready and routed to after the rest"
        )
        assert len(finished) >= 24 and set(finished) == {300}, f"every surge stream finished: {finished}"
        # Quiet again: after the stabilization window the pool drains back to minReplicas.
        up.wait_line(rf"scale\s+decode \d -> \d \(({DOWN_REASONS}):", timeout=60, after=quiet)
        wait_for(lambda: len(decode_urls(run_dir)) == 1, 60, "decode back to one worker", up)
        wait_for(
            lambda: healthy(port, "decode", run_dir) == decode_urls(run_dir),
            10,
            "the router dropping drained workers",
            up,
        )
        up.wait_line(r"decode-\d+\s+stopped: drained and exited", timeout=60, after=quiet)
        lines = [line for line in up.lines if re.search(r"scale\s+decode", line)]
        assert len(lines) >= 2, lines

        # kill -9 the prefill worker: restarted after a 1 s back-off, the event shown, serving again.
        pid = int(up.wait_line(r"prefill-0\s+started: pid (\d+)", timeout=1).group(1))
        mark = len(up.lines)
        os.kill(pid, signal.SIGKILL)
        up.wait_line(rf"prefill-0\s+crashed: pid {pid} killed by SIGKILL; restarting in 1s", timeout=15, after=mark)
        up.wait_line(r"prefill-0\s+restarted: pid \d+", timeout=15, after=mark)
        up.wait_line(r"prefill-0\s+ready", timeout=60, after=mark)
        for _ in range(30):  # the router's probe puts it back within a second or so
            try:
                assert (
                    client.completions.create(model="tiny", prompt="again", max_tokens=4).usage.completion_tokens == 4
                )
                break
            except openai.APIStatusError:
                time.sleep(0.5)
        else:
            raise AssertionError(f"no completion after the restart:\n{up.output()[-4000:]}")

        pids, ports = up.pids(), up.ports() | {port}
        assert len(pids) >= 5, pids  # router, prefill-0 twice, decode-0, a new decode replica (at least)
        up.signal(signal.SIGTERM)
        assert up.wait(60) == 0, up.output()[-4000:]
        summary = up.summary()
        assert "scaling   " in summary and "decode    1 -> " in summary and "prefill-0" in summary, summary
        assert not [p for p in pids if pid_alive(p)], "every child process is gone"
        assert all(port_free(p) for p in ports), "every port is free again"
    finally:
        up.stop()


def test_bursty_load_scales_up_and_down_and_prints_the_summary_last(tmp_path, model_dir):
    """What `make demo` runs, shortened: bursty load through the router, then the summary as the last lines."""
    # NOTE: the load is open-loop (Poisson arrivals at a set rate), so the queue it builds is the arrival rate x
    # each request's time, which shrinks on a faster machine. At a target of 1 running+waiting request per decode
    # replica, the burst's 18 requests/s of ~128 tokens ask for a second replica unless a token takes under
    # 0.5 ms (the target of 4 needed 1.9 ms: a quiet 2-core CI machine runs 24 streams at ~8 ms a token, a few
    # at perhaps 4, so a machine twice as fast could have missed it; now it takes ten times).
    spec = write_spec(tmp_path, model_dir, **{**FAST, "decode.targetQueuePerReplica": 1})
    report = tmp_path / "report.json"
    up = UpProcess(
        [
            str(spec),
            "--port",
            str(free_port()),
            "--load",
            "bursty",
            "--duration",
            "20",
            "--rate",
            "3",
            "--burst",
            "6",
            "--output-tokens",
            "128",
            "--report",
            str(report),
        ],
        cwd=tmp_path,
    )
    try:
        assert up.wait(240) == 0, up.output()[-6000:]
    finally:
        up.stop()
    summary = up.summary()
    for needle in ("requests  ", "TTFT      p50", "per 1M generated tokens", "scaling   ", "cpu $0.1/unit-h"):
        assert needle in summary, (needle, summary)
    doc = json.loads(report.read_text())
    assert doc["completed"] > 0 and doc["ttft_p50_s"] > 0 and doc["cost_per_1m_tokens"] > 0
    assert doc["scale_events"]["up"] >= 1 and doc["scale_events"]["down"] >= 1, summary
    ups = [c for c in doc["scale_events"]["changes"] if c["desired"] > c["current"]]
    assert all(c["reason"] and c["message"] for c in doc["scale_events"]["changes"])
    assert re.search(r"\d+ -> \d+\s+\w+: ", summary) and ups


def test_a_killed_pdfleet_up_takes_its_children_with_it(tmp_path, model_dir):
    """Even SIGKILL, which pdfleet up cannot catch, leaves no orphan: each child gets SIGTERM when its parent dies."""
    spec = write_spec(tmp_path, model_dir)
    port = free_port()
    up = UpProcess([str(spec), "--port", str(port)], cwd=tmp_path)
    try:
        up.wait_line(r"fleet ready after", timeout=120)
        pids = up.pids()
        assert len(pids) == 3 and all(pid_alive(p) for p in pids)
        up.signal(signal.SIGKILL)
        up.wait(10)
        wait_for(lambda: not [p for p in pids if pid_alive(p)], 30, "every child gone after its parent was killed", up)
        wait_for(lambda: port_free(port), 10, "the router's port free", up)
    finally:
        up.stop()


def test_up_reads_the_queues_from_prometheus_when_given_one(tmp_path, model_dir, prometheus_factory):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    prom = prometheus_factory(
        extra_scrape_configs=[
            {
                "job_name": "pdfleet-up",
                "file_sd_configs": [{"files": [str(run_dir / "prometheus-targets.json")], "refresh_interval": "1s"}],
            }
        ]
    )
    spec = write_spec(tmp_path, model_dir, **FAST)
    up = UpProcess(
        [str(spec), "--port", str(free_port()), "--run-dir", str(run_dir), "--prometheus", prom.url], cwd=tmp_path
    )
    try:
        up.wait_line(r"fleet ready after", timeout=120)
        up.wait_line(rf"metrics\s+prometheus {prom.url} \(pdfleet\): available", timeout=60)
        series = prom.query(
            'count by (pdfleet_role) (vllm:num_requests_waiting{pdfleet_deployment="local-tiny",namespace="default"})'
        )
        assert {s["metric"]["pdfleet_role"] for s in series} == {"prefill", "decode"}
        up.signal(signal.SIGTERM)
        assert up.wait(60) == 0, up.output()[-4000:]
        assert "scaling   0 up, 0 down" in up.summary()
    finally:
        up.stop()
