"""`pdfleet up` with query routing and SSE heartbeats, on real processes: a deployment whose spec.routing names a second `pdfleet up` fleet sends it the requests its rules judge simple; a stream to the router that waits longer than spec.router.heartbeatInterval gets `: keep-alive` before its first token, and the openai SDK reads it."""
from __future__ import annotations

import signal
import threading

import httpx
import openai
import pytest
import yaml

from tests.local.conftest import UpProcess, run_token, write_spec
from tests.serving.conftest import wait_until
from tests.support.components import free_port

pytestmark = pytest.mark.slow


def _small_spec(directory, model_dir):
    path = write_spec(directory, model_dir, disaggregation=False, prefill=None, decode=None,
                      colocated={"acceleratorClasses": ["cpu"], "minReplicas": 1, "maxReplicas": 1})
    doc = yaml.safe_load(path.read_text())
    doc["metadata"]["name"] = "local-small"
    doc["spec"]["model"]["name"] = "tiny-small"
    out = directory / "small.yaml"
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def test_routing_and_heartbeats_through_pdfleet_up(tmp_path, model_dir):
    small_dir, big_dir = tmp_path / "small", tmp_path / "big"
    small_dir.mkdir()
    big_dir.mkdir()
    small_port, big_port = free_port(), free_port()
    small = UpProcess([str(_small_spec(small_dir, model_dir)), "--port", str(small_port)], cwd=small_dir)
    # one sequence at a time, so a second request waits (queued) while the first generates
    big_spec = write_spec(big_dir, model_dir, **{"routing": {"target": "local-small", "rules": {"maxTokens": 8}},
                                                 "router.heartbeatInterval": "20ms", "engine.maxNumSeqs": 1,
                                                 "prefill.maxReplicas": 1, "decode.maxReplicas": 1})
    refused = UpProcess([str(big_spec), "--port", str(big_port)], cwd=big_dir)
    assert refused.wait(60) != 0 and "pass its router as --routing-target" in refused.output()
    big = None
    try:
        small.wait_line(r"fleet ready after", timeout=120)
        run_dir = big_dir / "run"
        big = UpProcess([str(big_spec), "--port", str(big_port), "--routing-target", f"http://127.0.0.1:{small_port}",
                         "--run-dir", str(run_dir)], cwd=big_dir)
        big.wait_line(r"fleet ready after", timeout=120)
        url = f"http://127.0.0.1:{big_port}"
        simple = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert simple.json()["model"] == "tiny-small" and simple.headers["x-pdfleet-route"] == "small"
        complex_ = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 16},
                              timeout=60)
        assert complex_.json()["model"] == "tiny" and complex_.headers["x-pdfleet-route"] == "default"

        # a long generation holds the only decode slot; the stream behind it waits longer than 20 ms
        long = {"model": "tiny", "prompt": "x " * 20, "max_tokens": 900, "ignore_eos": True}

        def decoding() -> bool:
            workers = httpx.get(f"{url}/workers", headers=run_token(run_dir), timeout=10).json()["workers"]
            return any(w["role"] == "decode" and w["load"].get("running") == 1 for w in workers)

        hold = threading.Thread(target=lambda: httpx.post(f"{url}/v1/completions", json=long, timeout=120))
        hold.start()
        wait_until(decoding, timeout=60, what="the long request decoding")
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 12, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
            lines = [line for line in resp.iter_lines() if line]
        hold.join()
        first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
        assert first_data >= 1 and set(lines[:first_data]) == {": keep-alive"}, lines[:5]
        assert lines[-1] == "data: [DONE]"

        hold = threading.Thread(target=lambda: httpx.post(f"{url}/v1/completions", json=long, timeout=120))
        hold.start()
        wait_until(decoding, timeout=60, what="the long request decoding")
        with openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=120) as client:
            chunks = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=12, stream=True,
                                                    stream_options={"include_usage": True}))
        hold.join()
        assert chunks[-1].usage.completion_tokens == 12
        metrics = httpx.get(f"{url}/metrics").text
        assert 'pdfleet_router_routed_requests_total{reason="rules",route="small"} 1.0' in metrics
        for up in (big, small):
            up.signal(signal.SIGTERM)
            assert up.wait(60) == 0, up.output()[-3000:]
    finally:
        for up in (refused, big, small):
            if up is not None:
                up.stop()
