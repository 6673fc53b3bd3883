"""A rendered vLLM pod, started as kubelet would start it, serves (issue 26): the local vLLM runtime (.venv-vllm)
runs with the container's args and env and nothing else, as uid 10001 with no passwd entry, under a read-only root
filesystem where only the rendered emptyDirs are writable, inside a memory cgroup of the rendered limit, and
answers a completion.

What differs from a cluster, on purpose: the interpreter is `.venv-vllm/bin/python -m
vllm.entrypoints.openai.api_server --model DIR` (this CPU wheel's `vllm serve` looks up another distribution name;
the args are the rendered ones), the port is a free one (the host's network is shared), and the model volume is a
local directory bound read-only where the PVC would be mounted.

What HEAD rendered, run the same way, did not start: with no VLLM_CPU_KVCACHE_SPACE vLLM's CPU backend asks for
its memory fraction of the node's memory for KV (0.85 x 19.6 GiB = 16.65 GiB here), not of the pod's 8 GiB limit,
and refused ("Engine core initialization failed") on this machine, whose free memory was less; on an idle node it
would allocate past the limit. HEAD also set no USER and HOME=/tmp:
this wheel's torch (2.13) falls back to `uid_10001` when getpwuid() fails, so that part started here; the vLLM
builds the issue saw crash in getpwuid() call getpass.getuser() unguarded, and test_render_engines checks the
USER, LOGNAME, HOME and cache variables that keep them off that path.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdfleet_operator.api import InferenceDeployment, parse_quantity
from pdfleet_operator.decide import inventory, placement
from pdfleet_operator.kube import render
from tests.kube.cluster import classes, example_deployments, standard_nodes
from tests.support import pod_sandbox, vllm
from tests.support.components import free_port

START_TIMEOUT_S = 420.0  # torch.compile of the tiny model on 2 shared cores: 1-3 minutes


def _rendered_pod(model_dir: Path) -> dict:
    """examples/local-vllm.yaml with its weights on a PVC and the tiny model's architecture, rendered."""
    doc = json.loads(json.dumps(example_deployments()["local-vllm"]))
    cfg = json.loads((model_dir / "config.json").read_text())
    doc["spec"]["model"]["source"] = {"pvc": {"claimName": "models", "path": model_dir.name}}
    doc["spec"]["model"]["architecture"] = {
        "parametersBillions": 0.01,
        "layers": cfg["num_hidden_layers"],
        "kvHeads": cfg["num_key_value_heads"],
        "headDim": cfg["head_dim"],
    }
    dep = InferenceDeployment.model_validate({**doc, "metadata": {**doc["metadata"], "namespace": "team-a"}})
    cls = classes()
    plan = placement.plan(dep.spec, cls, inventory.build(standard_nodes(), []))
    objs = render.render(render.Owner("local-vllm", "team-a", "uid"), dep.spec, plan, cls, revision=1)
    return next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "local-vllm-colocated-cpu")


@pytest.mark.slow
def test_the_rendered_vllm_pod_starts_and_serves_as_a_uid_without_a_passwd_entry_on_a_read_only_root(tmp_path) -> None:
    pod_sandbox.require()
    python = vllm.vllm_python()
    pvc = tmp_path / "pvc"
    model = pvc / "tiny"
    subprocess.run(
        [sys.executable, "-m", "pdfleet_operator.cli", "model", "init", str(model), "--preset", "tiny"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    for path in (pvc, model, *model.iterdir()):  # what the pod's fsGroup would read on a PVC
        path.chmod(0o755 if path.is_dir() else 0o644)

    deployment = _rendered_pod(model)
    template = deployment["spec"]["template"]
    (container,) = template["spec"]["containers"]
    assert container["command"] == ["vllm", "serve"] and container["args"][0] == "/models/tiny"
    assert 10001 not in [int(line.split(":")[2]) for line in Path("/etc/passwd").read_text().splitlines() if line]
    port = free_port()
    args = list(container["args"][1:])
    args[args.index("--port") + 1] = str(port)
    argv = [python, "-m", vllm.ENTRYPOINT, "--model", container["args"][0], *args]
    pod = pod_sandbox.Pod(
        container,
        template["spec"],
        volume_sources={"model": str(pvc)},
        field_values={
            "status.podIP": "127.0.0.1",
            "metadata.name": "local-vllm-colocated-cpu-0",
            "metadata.labels['pdfleet.io/revision']": "1",
        },
    )
    log = tmp_path / "vllm.log"
    limit = parse_quantity(container["resources"]["limits"]["memory"])
    with pod_sandbox.memory_cgroup(int(limit)) as cgroup:
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                pod_sandbox.command(pod, argv, tmp_path / "sandbox", cgroup),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        _serve_and_stop(proc, port, log, cgroup)


def _serve_and_stop(proc: subprocess.Popen, port: int, log: Path, cgroup: pod_sandbox.MemoryCgroup) -> None:
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, (
                f"vLLM exited with {proc.returncode}:\n{log.read_text(errors='replace')[-5000:]}"
            )
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"not healthy after {START_TIMEOUT_S}s:\n{log.read_text()[-5000:]}"
            time.sleep(1)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=120,
            json={"model": "tiny", "prompt": "hello from a pod", "max_tokens": 8, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        status = Path(f"/proc/{proc.pid}/status").read_text()
        assert "Uid:\t10001\t10001\t10001\t10001" in status, "it ran as the pod's uid"
        text = log.read_text(errors="replace")
        assert "getpwuid" not in text and "Read-only file system" not in text, text[-3000:]
        assert str(cgroup.path.name) in Path(f"/proc/{proc.pid}/cgroup").read_text(), "it ran in the pod's cgroup"
        assert cgroup.oom_kills() == 0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
