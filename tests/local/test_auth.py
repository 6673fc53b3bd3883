"""`pdfleet up --auth`: the client key it prints (and writes to its run directory) works with the openai SDK, the
printed curl line and `pdfleet load`; no key or a wrong one is a 401 in OpenAI's shape; the token between its router and
workers is new every run and guards the workers. Without --auth the printed lines are the README's (no key)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import stat
import subprocess

import httpx
import openai
import pytest

from tests.local.conftest import PDFLEET, UpProcess, run_token, write_spec
from tests.support.components import free_port
from tests.worker.processes import wait_until

pytestmark = pytest.mark.slow


def test_up_with_auth_prints_a_key_that_works_and_refuses_requests_without_it(tmp_path, model_dir):
    spec = write_spec(tmp_path, model_dir)
    port, run_dir = free_port(), tmp_path / "run"
    up = UpProcess([str(spec), "--port", str(port), "--run-dir", str(run_dir), "--auth"], cwd=tmp_path)
    try:
        up.wait_line(r"fleet ready after", timeout=120)
        # the banner's lines follow the ready line, read by UpProcess's thread a moment later
        key = up.wait_line(r"client API key: (sk-pdfleet-\S+) \(in (\S+);", timeout=10)
        assert key.group(2) == str(run_dir / "api-key")
        key = key.group(1)
        for name in ("api-key", "auth-token"):
            assert stat.S_IMODE((run_dir / name).stat().st_mode) == 0o600, name
        assert (run_dir / "api-key").read_text().strip() == key
        base = f"http://127.0.0.1:{port}"

        # The key it printed, as the SDK sends it; and the printed curl line as printed.
        with openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120) as client:
            assert [m.id for m in client.models.list().data] == ["tiny"]
            assert client.completions.create(model="tiny", prompt="Hello", max_tokens=4).usage.completion_tokens == 4
        curl = up.wait_line(r"^\s*(curl .*)$", timeout=10).group(1)
        assert f"Authorization: Bearer {key}" in curl
        done = subprocess.run(
            shlex.split(curl) + ["-s", "-w", "\n%{http_code}"], capture_output=True, text=True, timeout=60
        )
        assert done.stdout.rstrip().endswith("200"), done.stdout
        python = up.wait_line(r"^\s*(python -c .*)$", timeout=10).group(1)
        assert f"api_key='{key}'" in python

        # No key, a wrong key, the SDK's placeholder: 401 invalid_api_key, before any work.
        for api_key in ("-", "sk-pdfleet-wrong"):
            with openai.OpenAI(base_url=f"{base}/v1", api_key=api_key, max_retries=0, timeout=30) as client:
                with pytest.raises(openai.AuthenticationError) as raised:
                    client.completions.create(model="tiny", prompt="Hello", max_tokens=4)
            assert raised.value.status_code == 401 and raised.value.code == "invalid_api_key"
        bare = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 4})
        assert bare.status_code == 401 and bare.json()["error"] == {
            "message": bare.json()["error"]["message"],
            "type": "invalid_request_error",
            "code": "invalid_api_key",
            "param": None,
        }
        # counted once each answer is sent (the counting middleware's finally), so read until it shows
        wait_until(
            lambda: 'pdfleet_router_requests_total{code="401",tier="default"} 3.0' in httpx.get(f"{base}/metrics").text,
            timeout=10,
            what="the three 401s counted",
        )

        # The client key is not the deployment token: the workers and /workers want the run's own token.
        workers = httpx.get(f"{base}/workers", headers=run_token(run_dir)).json()["workers"]
        assert httpx.get(f"{base}/workers", headers={"Authorization": f"Bearer {key}"}).status_code == 401
        for w in workers:
            assert httpx.get(f"{w['url']}/load", headers={"Authorization": f"Bearer {key}"}).status_code == 401
            assert httpx.get(f"{w['url']}/load", headers=run_token(run_dir)).status_code == 200

        # pdfleet load: with the key (PDFLEET_API_KEY, as the printed line has it) it completes; without, nothing does.
        load = PDFLEET + ["load", "--url", base, "--rate", "2", "--duration", "2", "--output-tokens", "8"]
        ok = subprocess.run(
            load, capture_output=True, text=True, timeout=120, env={**os.environ, "PDFLEET_API_KEY": key}
        )
        assert ok.returncode == 0 and re.search(r"\b[1-9]\d* completed", ok.stdout), ok.stdout + ok.stderr
        refused = subprocess.run(
            load,
            capture_output=True,
            text=True,
            timeout=60,
            env={k: v for k, v in os.environ.items() if k != "PDFLEET_API_KEY"},
        )
        assert refused.returncode != 0 and "401" in refused.stderr, refused.stdout + refused.stderr

        up.signal(signal.SIGTERM)
        assert up.wait(60) == 0, up.output()[-4000:]
    finally:
        up.stop()


def test_without_auth_the_fleet_serves_without_a_key_and_prints_the_readme_lines(tmp_path, model_dir):
    spec = write_spec(tmp_path, model_dir)
    port, run_dir = free_port(), tmp_path / "run"
    up = UpProcess([str(spec), "--port", str(port), "--run-dir", str(run_dir)], cwd=tmp_path)
    try:
        up.wait_line(r"fleet ready after", timeout=120)
        url = f"http://127.0.0.1:{port}"
        # the banner's lines follow the ready line, read by UpProcess's thread a moment later
        up.wait_line(
            "^"
            + re.escape(
                f"  curl {url}/v1/completions -H 'Content-Type: application/json' -d "
                f'\'{{"model": "tiny", "prompt": "Hello", "max_tokens": 16}}\''
            )
            + "$",
            timeout=10,
        )
        assert not any("client API key" in line for line in up.lines) and not (run_dir / "api-key").exists()
        with openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=120) as client:
            assert client.completions.create(model="tiny", prompt="Hello", max_tokens=4).usage.completion_tokens == 4
        first = run_token(run_dir)
        # Still, the workers take the run's token only (a new one every run): nothing else on this machine drives them.
        for w in httpx.get(f"{url}/workers", headers=first).json()["workers"]:
            assert httpx.get(f"{w['url']}/load").status_code == 401
        up.signal(signal.SIGTERM)
        assert up.wait(60) == 0, up.output()[-4000:]
    finally:
        up.stop()
