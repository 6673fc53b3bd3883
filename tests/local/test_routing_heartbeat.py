"""`pdfleet up` with query routing and SSE heartbeats, on real processes: a deployment whose spec.routing names a second
`pdfleet up` fleet sends it the requests its rules judge simple; a stream to the router that waits longer than
spec.router.heartbeatInterval gets `: keep-alive` before its first token, and the openai SDK reads it."""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import yaml

from tests.local.conftest import UpProcess, write_spec
from tests.support.components import free_port

pytestmark = pytest.mark.slow


def _small_spec(directory, model_dir):
    path = write_spec(
        directory,
        model_dir,
        disaggregation=False,
        prefill=None,
        decode=None,
        colocated={"acceleratorClasses": ["cpu"], "minReplicas": 1, "maxReplicas": 1},
    )
    doc = yaml.safe_load(path.read_text())
    doc["metadata"]["name"] = "local-small"
    doc["spec"]["model"]["name"] = "tiny-small"
    out = directory / "small.yaml"
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


# The hold: far longer than any plausible machine generates before the test lets it go (1,900 tokens; maxModelLen
# is 2048 in the spec that serves it).
HOLD = {"model": "tiny", "prompt": "x " * 20, "max_tokens": 1900, "ignore_eos": True, "stream": True}


def _behind_a_hold(url: str, read):
    """read(release) with a long stream holding the only decode slot (maxNumSeqs 1) from before it starts until
    it sets `release`: the hold counts as decoding once its third token has come (the first can be prefill's)."""
    decoding, release = threading.Event(), threading.Event()

    def hold() -> int:
        tokens = 0
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=HOLD, timeout=120) as resp:
                assert resp.status_code == 200, resp.read()
                for line in resp.iter_lines():
                    tokens += line.startswith("data: {")
                    if tokens >= 3:
                        decoding.set()
                    if release.is_set():
                        break
        finally:
            decoding.set()
        return tokens

    with ThreadPoolExecutor(1) as pool:
        holding = pool.submit(hold)
        assert decoding.wait(120), "the hold decoding"
        try:
            assert not holding.done(), f"the hold ended before the test let it go: {holding.result()} tokens"
            result = read(release)
        finally:
            release.set()
        assert 3 <= holding.result(timeout=120) < HOLD["max_tokens"], "the hold held the slot until released"
    return result


class _Tee(httpx.BaseTransport):
    """An httpx transport that hands `seen` each chunk of a response body as its reader reads it."""

    def __init__(self, seen):
        self.inner, self.seen = httpx.HTTPTransport(), seen

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        resp = self.inner.handle_request(request)
        return httpx.Response(
            resp.status_code,
            headers=resp.headers,
            stream=_TeeStream(resp.stream, self.seen),
            extensions=resp.extensions,
            request=request,
        )

    def close(self) -> None:
        self.inner.close()


class _TeeStream(httpx.SyncByteStream):
    def __init__(self, inner, seen):
        self.inner, self.seen = inner, seen

    def __iter__(self):
        for chunk in self.inner:
            self.seen(chunk)
            yield chunk

    def close(self) -> None:
        self.inner.close()


def test_routing_and_heartbeats_through_pdfleet_up(tmp_path, model_dir):
    small_dir, big_dir = tmp_path / "small", tmp_path / "big"
    small_dir.mkdir()
    big_dir.mkdir()
    small_port, big_port = free_port(), free_port()
    small = UpProcess([str(_small_spec(small_dir, model_dir)), "--port", str(small_port)], cwd=small_dir)
    # one sequence at a time, so a second request waits (queued) while the first generates
    big_spec = write_spec(
        big_dir,
        model_dir,
        **{
            "routing": {"target": "local-small", "rules": {"maxTokens": 8}},
            "router.heartbeatInterval": "20ms",
            "engine.maxNumSeqs": 1,
            "model.maxModelLen": 2048,
            "prefill.maxReplicas": 1,
            "decode.maxReplicas": 1,
        },
    )
    refused = UpProcess([str(big_spec), "--port", str(big_port)], cwd=big_dir)
    assert refused.wait(60) != 0 and "pass its router as --routing-target" in refused.output()
    big = None
    try:
        small.wait_line(r"fleet ready after", timeout=120)
        run_dir = big_dir / "run"
        big = UpProcess(
            [
                str(big_spec),
                "--port",
                str(big_port),
                "--routing-target",
                f"http://127.0.0.1:{small_port}",
                "--run-dir",
                str(run_dir),
            ],
            cwd=big_dir,
        )
        big.wait_line(r"fleet ready after", timeout=120)
        url = f"http://127.0.0.1:{big_port}"
        simple = httpx.post(
            f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 4}, timeout=60
        )
        assert simple.json()["model"] == "tiny-small" and simple.headers["x-pdfleet-route"] == "small"
        complex_ = httpx.post(
            f"{url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 16}, timeout=60
        )
        assert complex_.json()["model"] == "tiny" and complex_.headers["x-pdfleet-route"] == "default"

        # A long stream holds the only decode slot until the test lets it go, so the stream sent behind it waits
        # however fast the machine is: its first line must be `: keep-alive` (20 ms without an event). Once that
        # line has come, the hold is closed (the router aborts it at the worker) and the queued stream runs.
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 12, "stream": True}

        def raw(release: threading.Event) -> list[str]:
            lines = []
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
                for line in resp.iter_lines():
                    if line:
                        lines.append(line)
                        release.set()
            return lines

        lines = _behind_a_hold(url, raw)
        first_data = next(i for i, line in enumerate(lines) if line.startswith("data:"))
        assert first_data >= 1 and set(lines[:first_data]) == {": keep-alive"}, lines[:5]
        assert lines[-1] == "data: [DONE]"

        # The same wait read by the openai SDK: its first bytes are a keep-alive, and it reads the stream whole.
        def sdk(release: threading.Event) -> tuple[bytes, list]:
            seen = []

            def tee(chunk: bytes) -> None:
                seen.append(chunk)
                release.set()

            with openai.OpenAI(
                base_url=f"{url}/v1",
                api_key="-",
                max_retries=0,
                timeout=120,
                http_client=httpx.Client(transport=_Tee(tee), timeout=120),
            ) as client:
                chunks = list(
                    client.completions.create(
                        model="tiny", prompt="Hello", max_tokens=12, stream=True, stream_options={"include_usage": True}
                    )
                )
            return b"".join(seen), chunks

        seen, chunks = _behind_a_hold(url, sdk)
        assert seen.startswith(b": keep-alive"), seen[:200]
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
