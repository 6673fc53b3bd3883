"""Threads that fit the pod (issue 26): a pdfleet worker started exactly as its rendered pod starts it, against the
same worker with `pdfleet up`'s tuned threads and with torch's default (what HEAD's pods ran), under one load.

    .venv/bin/python bench/threads.py            # 9 rounds of 10 s per variant (about 5 minutes)
    .venv/bin/python bench/threads.py --quick    # 1 round of 8 s

The rendered worker: examples/local-tiny.yaml made colocated on the `cpu` class and rendered by kube.render; its
container's args and env, unchanged but for what only a cluster has (the model path, the engine config file, the
token file, 127.0.0.1 and a free port) and the downward-API field values (PDFLEET_CPU_REQUEST: the rendered CPU
request, POD_IP). The tuned worker: the same args with `pdfleet up`'s `--num-threads 1` and OMP_NUM_THREADS=1
(local/supervisor.py). Torch's default: the same args with `--num-threads N`, N = this process's cores (HEAD's
pods passed no flag, and torch took one thread per visible core). The model is `pdfleet model init --preset tiny`
(what `pdfleet up examples/local-tiny.yaml` serves). The client, in this process beside the worker, keeps
--streams requests open (closed loop, random token-id prompts, `ignore_eos`, --output-tokens each) for --duration
seconds and counts the tokens that stream in within it. The three workers run side by side, idle but for the
one under load, which takes the load in turn for --duration seconds, in a rotating order each round; each ratio
is the median of the per-round ratios, listed with them.
"""

from __future__ import annotations

import _sys_path  # noqa: F401  -- first: keeps bench/operator.py from shadowing the stdlib (see it)

# isort: split
import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402
import yaml  # noqa: E402

from pdfleet_operator.local.ports import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PDFLEET = [sys.executable, "-m", "pdfleet_operator.cli"]


def rendered_worker() -> tuple[dict, dict]:
    """The colocated worker container of examples/local-tiny.yaml on the `cpu` class, and its ConfigMap."""
    from pdfleet_operator.api import AcceleratorClass, InferenceDeployment
    from pdfleet_operator.decide import inventory, placement
    from pdfleet_operator.kube import render

    doc = yaml.safe_load((ROOT / "examples" / "local-tiny.yaml").read_text())
    spec = doc["spec"]
    spec["disaggregation"] = False
    spec["colocated"] = {"acceleratorClasses": ["cpu"], "minReplicas": 1, "maxReplicas": 1}
    spec.pop("prefill")
    spec.pop("decode")
    dep = InferenceDeployment.model_validate(doc)
    classes = {
        d["metadata"]["name"]: AcceleratorClass.model_validate(d).spec
        for d in yaml.safe_load_all((ROOT / "examples" / "acceleratorclasses.yaml").read_text())
        if d
    }
    nodes = [{"metadata": {"name": "n", "labels": {}}, "status": {"allocatable": {"cpu": "64", "memory": "256Gi"}}}]
    plan = placement.plan(dep.spec, classes, inventory.build(nodes, []))
    objs = render.render(render.Owner(dep.name, "default", "uid"), dep.spec, plan, classes, revision=1)
    pool = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-colocated-cpu"))
    (container,) = pool["spec"]["template"]["spec"]["containers"]
    return container, next(o for o in objs if o["kind"] == "ConfigMap")


def pod_command(container: dict, config: dict, model: Path, workdir: Path, port: int) -> tuple[list[str], dict]:
    """The container's args and env with the cluster's paths and addresses replaced by this machine's."""
    from pdfleet_operator.api import parse_quantity
    from pdfleet_operator.kube import render

    engine = workdir / "engine.json"
    engine.write_text(config["data"][render.CONFIG_KEY])
    token = workdir / "token"
    token.write_text("threads-bench-token-" + "x" * 16 + "\n")
    subst = {
        "--model": str(model),
        "--engine-config": str(engine),
        "--host": "127.0.0.1",
        "--port": str(port),
        "--auth-token-file": str(token),
    }
    args = list(container["args"])
    for flag, value in subst.items():
        args[args.index(flag) + 1] = value
    request = parse_quantity(container["resources"]["requests"]["cpu"])
    fields = {"status.podIP": "127.0.0.1", "metadata.name": "bench-0", "metadata.labels['pdfleet.io/revision']": "1"}
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    for e in container["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e["valueFrom"]:
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:  # resourceFieldRef requests.cpu, divisor 1m
            env[e["name"]] = str(int(request * 1000))
    env["HOME"] = str(workdir)
    return [*PDFLEET, *args], env


def variant_command(name: str, base: list[str], env: dict) -> tuple[list[str], dict]:
    argv = list(base)
    if name == "rendered":
        assert argv[argv.index("--num-threads") + 1] == "auto", "the rendered pod sizes its threads"
        return argv, dict(env)
    n = "1" if name == "tuned" else str(len(os.sched_getaffinity(0)))
    argv[argv.index("--num-threads") + 1] = n
    out = dict(env)
    if name == "tuned":
        out.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # as local/supervisor.py starts a worker
    return argv, out


async def load(
    url: str, token: str, streams: int, duration: float, prompt_tokens: int, output_tokens: int, seed: int
) -> dict:
    """Closed loop: `streams` streaming requests open at all times; tokens counted as they arrive in the window."""
    rng = random.Random(seed)
    counted = {"tokens": 0, "requests": 0, "errors": 0}
    headers = {"Authorization": f"Bearer {token}"}
    began = time.monotonic()
    stop_at = began + duration

    async def one(client: httpx.AsyncClient) -> None:
        while time.monotonic() < stop_at:
            body = {
                "model": "tiny",
                "prompt": [rng.randrange(10, 1000) for _ in range(prompt_tokens)],
                "stream": True,
                "max_tokens": output_tokens,
                "ignore_eos": True,
                "temperature": 0,
            }
            try:
                async with client.stream(
                    "POST", f"{url}/v1/completions", json=body, headers=headers, timeout=httpx.Timeout(300, read=300)
                ) as r:
                    if r.status_code != 200:
                        counted["errors"] += 1
                        continue
                    async for line in r.aiter_lines():
                        if time.monotonic() > stop_at:
                            return
                        if line.startswith("data: {"):
                            counted["tokens"] += 1
                    counted["requests"] += 1
            except httpx.HTTPError:
                counted["errors"] += 1

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=streams + 4)) as client:
        await asyncio.gather(*(one(client) for _ in range(streams)))
    return {
        "tok_s": counted["tokens"] / duration,
        "requests": counted["requests"],
        "errors": counted["errors"],
        "wall_s": time.monotonic() - began,
    }


def start(argv: list[str], env: dict, port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(argv, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"worker not ready:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=9, help="rounds (each variant measured once per round)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of load per measurement")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of load before each measurement")
    p.add_argument("--model", help="model directory (default: made with pdfleet model init --preset tiny)")
    p.add_argument("--quick", action="store_true", help="1 repetition of 8 s")
    a = p.parse_args(argv)
    if a.quick:
        a.reps, a.duration, a.warmup = 1, 8.0, 2.0
    work = Path(tempfile.mkdtemp(prefix="pdfleet-threads-"))
    model = Path(a.model) if a.model else work / "tiny"
    if not a.model:
        subprocess.run([*PDFLEET, "model", "init", str(model), "--preset", "tiny"], check=True, capture_output=True)
    container, config = rendered_worker()
    names = ["rendered", "tuned", "torch-default"]
    rows: dict[str, list[dict]] = {n: [] for n in names}
    procs, urls, logs = {}, {}, {}
    try:
        # NOTE: every variant is started once and they take the load in turn, a short window each, so that the
        # ratios compare moments seconds apart on a machine whose load moves by the minute; an idle worker's
        # engine loop sleeps, so the ones waiting take no CPU.
        for name in names:
            port = free_port()
            base, env = pod_command(container, config, model, work, port)
            argv_v, env_v = variant_command(name, base, env)
            logs[name] = work / f"{name}.log"
            procs[name] = start(argv_v, env_v, port, logs[name])
            urls[name] = f"http://127.0.0.1:{port}"
        token = (work / "token").read_text().split()[0]
        for name in names:
            asyncio.run(load(urls[name], token, a.streams, a.warmup, a.prompt_tokens, a.output_tokens, seed=99))
        for rep in range(a.reps):
            for name in names[rep % 3 :] + names[: rep % 3]:
                r = asyncio.run(
                    load(urls[name], token, a.streams, a.duration, a.prompt_tokens, a.output_tokens, seed=rep)
                )
                line = next((x for x in logs[name].read_text().splitlines() if "torch thread(s)" in x), "")
                r["threads"] = line.split("torch thread(s)")[0].split()[-1] if line else "?"
                rows[name].append(r)
                print(
                    f"rep {rep} {name:14s} {r['tok_s']:8.1f} tok/s  threads {r['threads']:>2}  "
                    f"{r['requests']} requests, {r['errors']} errors",
                    flush=True,
                )
    finally:
        for proc in procs.values():
            stop(proc)
    ratio = {
        f"{n}_vs_tuned": [x["tok_s"] / t["tok_s"] for x, t in zip(rows[n], rows["tuned"])]
        for n in names
        if n != "tuned"
    }
    print()
    for n in names:
        print(
            f"{n:14s} median {statistics.median(x['tok_s'] for x in rows[n]):8.1f} tok/s  "
            f"{[round(x['tok_s'], 1) for x in rows[n]]}"
        )
    for k, v in ratio.items():
        print(f"{k:26s} {statistics.median(v):6.3f}  {[round(x, 3) for x in v]}")
    out = {
        "rendered_vs_tuned": round(statistics.median(ratio["rendered_vs_tuned"]), 3),
        "torch_default_vs_tuned": round(statistics.median(ratio["torch-default_vs_tuned"]), 3),
        **{f"{n.replace('-', '_')}_tok_s": round(statistics.median(x["tok_s"] for x in rows[n]), 1) for n in names},
        "rendered_threads": rows["rendered"][0]["threads"],
        "cores": len(os.sched_getaffinity(0)),
        "streams": a.streams,
        "reps": a.reps,
        "duration_s": a.duration,
        "output_tokens": a.output_tokens,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
