"""The router's cost per streamed token (issue 28: "a router that costs little per token"); run by hand.

    .venv/bin/python bench/router.py                                   # HEAD's router alone, 5 repetitions
    git worktree add /tmp/router-base <commit>                         # a baseline: the router of another commit
    .venv/bin/python bench/router.py --baseline-tree /tmp/router-base  # both, alternating, with ratios
    .venv/bin/python bench/router.py --smoke                           # a check, not a measurement

A stub upstream (this script run with --stub, in its own process) speaks what the router reads of a vLLM server
(`/health`, `/v1/models`, `/metrics`) or of a pdfleet worker (`/load`, --engine pdfleet) and streams vLLM-shaped SSE
chunks (one chunk of one token per stream per step, a usage chunk when `stream_options.include_usage` asks, then
`[DONE]`) from pre-built bytes, so that the router, not the engine, is what a token costs. The client (this process)
speaks raw HTTP/1.1 over asyncio, opens --concurrency keep-alive connections to `pdfleet router --workers
ENGINE@stub`, and checks every answer: --max-tokens token chunks, the usage chunk's completion_tokens, `[DONE]`.

Two modes, each a fresh router per measurement:
    paced      the stub waits --step-ms between steps, as an engine does: what a token costs the router while it keeps
               up (each event arrives on its own, nothing coalesces), the CPU it takes from the engine beside it; the
               headline (`router_cpu_ms_per_token`)
    saturated  the stub emits as fast as it can (--saturated-requests): the router is the bottleneck; its tokens/s.
               NOTE: a router that falls behind reads several events at once, and one that passes them on together
               can then outrun `direct` (the client reading the stub's one-event writes itself)
The router's CPU (user + system of its threads, /proc) over the client's run, divided by the tokens the client got,
is its CPU ms per streamed token. `direct` (the client against the stub itself, no router) is the reference.

With --baseline-tree, the router of that checkout (PYTHONPATH=TREE/workers:TREE/operator, checked before use) runs
beside this checkout's, alternating (a rotating order per repetition); each ratio is the median of per-repetition
ratios (HEAD / baseline of the same repetition) with min and max. The 1-minute load average before and after every
run is reported (the machine is shared: claim nothing the spread does not allow).

Ends with one JSON line: `router_cpu_ms_per_token` (paced), `router_tokens_per_s` (saturated),
`router_cpu_ms_per_token_saturated`, `direct_tokens_per_s`, and with a baseline `*_vs_base` ratios and ranges.
"""

from __future__ import annotations

import _sys_path  # noqa: F401  -- first: keeps bench/operator.py from shadowing the stdlib (see it)

# isort: split
import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from pdfleet_operator.local.ports import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SERVED = "bench"
MODES = ("saturated", "paced")
START_TIMEOUT_S = 120.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5, help="repetitions of every router (fresh processes each time)")
    p.add_argument("--modes", default=",".join(MODES), help=f"which of {', '.join(MODES)} to run")
    p.add_argument("--concurrency", type=int, default=16, help="streams open at once")
    p.add_argument("--requests", type=int, default=64, help="requests per paced measurement")
    p.add_argument(
        "--saturated-requests", type=int, default=256, help="requests per saturated measurement (a few seconds)"
    )
    p.add_argument("--max-tokens", type=int, default=128, help="token chunks per request")
    p.add_argument("--step-ms", type=float, default=20.0, help="paced: the stub's time between steps")
    p.add_argument("--chat", action="store_true", help="/v1/chat/completions instead of /v1/completions")
    p.add_argument("--engine", choices=("vllm", "pdfleet"), default="vllm", help="what the stub answers probes as")
    p.add_argument("--baseline-tree", help="a checkout (git worktree) whose router runs beside this one's")
    p.add_argument("--no-direct", action="store_true", help="skip the client-against-stub ceiling")
    p.add_argument("--smoke", action="store_true", help="a check, not a measurement: 1 repetition, small runs")
    p.add_argument("--stub", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the stub's own process
    a = p.parse_args(argv)
    if a.smoke:
        a.reps, a.requests, a.saturated_requests, a.concurrency, a.max_tokens, a.step_ms = 1, 8, 8, 4, 16, 5.0
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not a.modes or not set(a.modes) <= set(MODES):
        p.error(f"--modes: choose from {', '.join(MODES)}")
    if a.baseline_tree and not (Path(a.baseline_tree) / "workers" / "pdfleet_worker").is_dir():
        p.error(f"--baseline-tree: {a.baseline_tree} holds no workers/pdfleet_worker (a checkout of this repository)")
    if min(a.reps, a.concurrency, a.requests, a.saturated_requests, a.max_tokens) < 1:
        p.error("--reps, --concurrency, --requests, --saturated-requests and --max-tokens must be at least 1")
    return a


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load1() -> float:
    return os.getloadavg()[0]


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process's live threads, to the nanosecond (/proc/PID/task/*/schedstat; the
    clock ticks of /proc/PID/stat are 10 ms, too coarse for a short run)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total / 1e9


# == HTTP/1.1, the little both sides need ==================================================================
async def read_head(reader: asyncio.StreamReader) -> tuple[str, dict[str, str]]:
    """The first line and the headers (lower-case names) of a request or response."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return lines[0], headers


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    if headers.get("transfer-encoding", "").lower() == "chunked":
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return b"".join(parts)
            parts.append((await reader.readexactly(size + 2))[:-2])
    return await reader.readexactly(int(headers.get("content-length", "0")))


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def response(status: str, body: bytes, content_type: str = "application/json") -> bytes:
    return f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body


# == the stub upstream =======================================================================================
def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def stub_events(chat: bool, n: int, prompt_tokens: int, usage: bool) -> list[bytes]:
    """One request's SSE events as vLLM writes them: n one-token chunks (the last with finish_reason), the usage
    chunk if asked, [DONE]."""
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{os.urandom(8).hex()}"
    head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time())}
    head["model"] = SERVED
    out = []
    for i in range(n):
        finish = "length" if i == n - 1 else None
        if chat:
            delta = {"role": "assistant", "content": " tok"} if i == 0 else {"content": " tok"}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": " tok", "logprobs": None, "finish_reason": finish, "stop_reason": None}
        out.append(sse({**head, "choices": [choice]}))
    if usage:
        counts = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + n, "completion_tokens": n}
        out.append(sse({**head, "choices": [], "usage": counts}))
    out.append(b"data: [DONE]\n\n")
    return out


class Stub:
    """The upstream: probes answered from constants, streams from pre-built events."""

    def __init__(self, step_s: float):
        self.step_s = step_s

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    line, headers = await read_head(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                body = await read_body(reader, headers)
                method, path = line.split(" ")[:2]
                if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
                    await self.stream(writer, json.loads(body), path.endswith("chat/completions"))
                else:
                    writer.write(self.probe(path))
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    def probe(self, path: str) -> bytes:
        if path == "/load":  # a pdfleet worker's, without limits (the router then leaves validation to it)
            load = {"ready": True, "model": SERVED, "models": [SERVED], "waiting": 0, "running": 0, "kv_usage": 0.0}
            return response("200 OK", json.dumps(load).encode())
        if path == "/health":
            return response("200 OK", b"")
        if path == "/v1/models":
            return response("200 OK", json.dumps({"object": "list", "data": [{"id": SERVED}]}).encode())
        if path == "/metrics":
            text = b"vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0\n"
            return response("200 OK", text, "text/plain; version=0.0.4")
        return response("404 Not Found", b'{"error":{"message":"not found","type":"not_found_error"}}')

    async def stream(self, writer: asyncio.StreamWriter, req: dict, chat: bool) -> None:
        usage = bool((req.get("stream_options") or {}).get("include_usage"))
        events = stub_events(chat, int(req["max_tokens"]), 8, usage)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for event in events:
            writer.write(chunk(event))
            await writer.drain()
            await asyncio.sleep(self.step_s)  # 0: each stream's step yields to the others, as one engine step would
        writer.write(b"0\r\n\r\n")


def run_stub(port: int, step_s: float) -> None:
    async def main() -> None:
        server = await asyncio.start_server(Stub(step_s).serve, "127.0.0.1", port, backlog=256)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# == the client ================================================================================================
class Bad(AssertionError):
    """An answer that is not what the stub sent through a working router."""


def check_stream(body: bytes, max_tokens: int, chat: bool) -> int:
    """The token chunks in one streamed answer (every one checked), Bad if any is missing or wrong."""
    events = [e for e in body.split(b"\n\n") if e and not e.startswith(b":")]
    if not events or events[-1] != b"data: [DONE]":
        raise Bad(f"the stream does not end with [DONE]: {body[-200:]!r}")
    tokens, usage = 0, None
    for event in events[:-1]:
        if not event.startswith(b"data: "):
            raise Bad(f"not a data event: {event[:200]!r}")
        obj = json.loads(event[6:])
        if "error" in obj:
            raise Bad(f"an error event: {obj}")
        if obj["choices"]:
            part = obj["choices"][0]["delta"].get("content") if chat else obj["choices"][0]["text"]
            tokens += part == " tok"
        if obj.get("usage"):
            usage = obj["usage"]
    if tokens != max_tokens or usage is None or usage["completion_tokens"] != max_tokens:
        raise Bad(f"{tokens} token chunks, usage {usage}; expected {max_tokens} and a usage chunk")
    return tokens


async def client_run(port: int, a) -> tuple[int, float]:
    """--requests streamed requests over --concurrency connections: (tokens received, seconds)."""
    path = "/v1/chat/completions" if a.chat else "/v1/completions"
    req: dict = {"model": SERVED, "max_tokens": a.max_tokens, "stream": True}
    req["stream_options"] = {"include_usage": True}  # as vLLM's benchmark client asks
    if a.chat:
        req["messages"] = [{"role": "user", "content": "hello"}]
    else:
        req["prompt"] = "hello"
    payload = json.dumps(req).encode()
    request = (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    todo = iter(range(a.requests))
    got = [0]

    async def conn() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for _ in todo:
                writer.write(request)
                line, headers = await read_head(reader)
                body = await read_body(reader, headers)
                if " 200 " not in line + " ":
                    raise Bad(f"{line}: {body[:300]!r}")
                got[0] += check_stream(body, a.max_tokens, a.chat)
        finally:
            writer.close()

    start = time.monotonic()
    await asyncio.gather(*(conn() for _ in range(min(a.concurrency, a.requests))))
    return got[0], time.monotonic() - start


# == processes ==================================================================================================
class Proc:
    """A child process of this bench, in its own session, stopped by its pid."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path):
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )

    def wait_ready(self, port: int, path: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            if http_status(port, path) == 200:
                return
            time.sleep(0.2)
        raise RuntimeError(f"not ready after {START_TIMEOUT_S:.0f}s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def http_status(port: int, path: str) -> int | None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
            return int(s.recv(64).split(b" ")[1])
    except (OSError, ValueError, IndexError):
        return None


def tree_env(tree: Path) -> dict[str, str]:
    """The environment in which `python -m pdfleet_operator.cli` imports the router of `tree`."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_PRELOAD")}
    env["PYTHONPATH"] = f"{tree / 'workers'}:{tree / 'operator'}"
    probe = subprocess.run(
        [sys.executable, "-c", "import pdfleet_worker.router.proxy as p, pdfleet_operator as o; print(p.__file__)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    where = probe.stdout.strip()
    if probe.returncode != 0 or not where.startswith(str(tree.resolve())):
        raise SystemExit(f"bench/router.py: {tree} does not provide the router ({where or probe.stderr[-500:]})")
    return env


def start_stub(step_s: float, workdir: Path) -> tuple[Proc, int]:
    port = free_port()
    argv = [sys.executable, str(Path(__file__).resolve()), "--stub", str(port), "--step-ms", str(step_s * 1e3)]
    stub = Proc(argv, dict(os.environ), workdir / f"stub-{port}.log")
    stub.wait_ready(port, "/health")
    return stub, port


def start_router(tree: Path, env: dict[str, str], engine: str, stub_port: int, workdir: Path) -> tuple[Proc, int]:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "pdfleet_operator.cli",
        "router",
        "--workers",
        f"{engine}@http://127.0.0.1:{stub_port}",
    ]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    router = Proc(argv, env, workdir / f"router-{tree.name}-{port}.log")
    try:
        router.wait_ready(port, "/ready")
    except BaseException:
        router.stop()
        raise
    return router, port


def measure(a, name: str, port: int, pid: int | None) -> dict:
    """One client run against `port`; `pid`'s CPU over it (None: no router)."""
    warm = argparse.Namespace(**{**vars(a), "requests": min(a.concurrency, a.requests)})
    asyncio.run(client_run(port, warm))  # connections, imports and first-call paths out of the measurement
    before, c0, self0 = load1(), cpu_s(pid) if pid else 0.0, resource.getrusage(resource.RUSAGE_SELF)
    tokens, wall = asyncio.run(client_run(port, a))
    c1, self1, after = cpu_s(pid) if pid else 0.0, resource.getrusage(resource.RUSAGE_SELF), load1()
    client = (self1.ru_utime + self1.ru_stime) - (self0.ru_utime + self0.ru_stime)
    row = {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "load": (before, after)}
    row["client_cpu_ms_per_token"] = client * 1e3 / tokens
    if pid:
        row["router_cpu_ms_per_token"] = (c1 - c0) * 1e3 / tokens
    progress(
        f"  {name}: {row['tokens_per_s']:.0f} tok/s"
        + (f", router {row['router_cpu_ms_per_token']:.4f} CPU ms/token" if pid else "")
        + f", client {row['client_cpu_ms_per_token']:.4f}; load {before:.1f}->{after:.1f}"
    )
    return row


def run_mode(a, mode: str, trees: dict[str, tuple[Path, dict]], workdir: Path) -> list[dict]:
    """Every repetition of one mode: {router name: row} each."""
    stub, stub_port = start_stub(0.0 if mode == "saturated" else a.step_ms / 1e3, workdir)
    if mode == "saturated":
        a = argparse.Namespace(**{**vars(a), "requests": a.saturated_requests})
    names = list(trees)
    reps = []
    try:
        for rep in range(a.reps):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            progress(f"{mode} repetition {rep + 1}/{a.reps} (load {load1():.1f})")
            got = {}
            for name in order:
                tree, env = trees[name]
                router, port = start_router(tree, env, a.engine, stub_port, workdir)
                try:
                    got[name] = measure(a, name, port, router.proc.pid)
                finally:
                    router.stop()
            if not a.no_direct:
                got["direct"] = measure(a, "direct", stub_port, None)
            reps.append(got)
    finally:
        stub.stop()
    return reps


# == the report ===================================================================================================
def spread(xs: list[float], digits: int) -> str:
    return f"{statistics.median(xs):.{digits}f} [{min(xs):.{digits}f}, {max(xs):.{digits}f}]"


def report(a, runs: dict[str, list[dict]]) -> dict:
    out: dict = {}
    rows = []
    for mode, reps in runs.items():
        sfx = "" if mode == "paced" else "_saturated"
        for name in reps[0]:
            rs = [r[name] for r in reps]
            loads = [x for r in rs for x in r["load"]]
            cpu = [r["router_cpu_ms_per_token"] for r in rs] if name != "direct" else []
            rows.append(
                (
                    f"{mode} {name}",
                    f"{spread([r['tokens_per_s'] for r in rs], 0)} tok/s",
                    (f"router CPU ms/token {spread(cpu, 4)}; " if cpu else "")
                    + f"client {spread([r['client_cpu_ms_per_token'] for r in rs], 4)}; "
                    f"load {min(loads):.1f}-{max(loads):.1f}",
                )
            )
            tag = "router" if name == "head" else name
            if mode == "saturated":
                out[f"{tag}_tokens_per_s"] = round(statistics.median(r["tokens_per_s"] for r in rs), 1)
            if cpu:
                out[f"{tag}_cpu_ms_per_token{sfx}"] = round(statistics.median(cpu), 4)
        if "base" in reps[0]:
            ratios = {
                f"router_cpu_ms_per_token{sfx}_vs_base": [
                    r["head"]["router_cpu_ms_per_token"] / r["base"]["router_cpu_ms_per_token"] for r in reps
                ],
                f"router_tokens_per_s{sfx}_vs_base": [
                    r["head"]["tokens_per_s"] / r["base"]["tokens_per_s"] for r in reps
                ],
            }
            for key, xs in ratios.items():
                out[key] = round(statistics.median(xs), 3)
                out[key + "_range"] = [round(min(xs), 3), round(max(xs), 3)]
                rows.append((f"{mode} head / base", key.split("_vs_")[0], spread(xs, 3)))
    loads = [x for reps in runs.values() for r in reps for row in r.values() for x in row["load"]]
    out.update(
        reps=a.reps,
        modes=list(runs),
        concurrency=a.concurrency,
        requests=a.requests,
        saturated_requests=a.saturated_requests,
        max_tokens=a.max_tokens,
        step_ms=a.step_ms,
        engine=a.engine,
        endpoint="chat" if a.chat else "completions",
        load_min=round(min(loads), 2),
        load_max=round(max(loads), 2),
        cores=len(os.sched_getaffinity(0)),
    )
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>32}  {note}")
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.stub is not None:
        run_stub(a.stub, a.step_ms / 1e3)
        return 0
    trees = {"head": (ROOT, tree_env(ROOT))}
    if a.baseline_tree:
        trees["base"] = (Path(a.baseline_tree), tree_env(Path(a.baseline_tree)))
    workdir = Path(tempfile.mkdtemp(prefix="pdfleet-bench-router-", dir=os.environ.get("TMPDIR", "/tmp")))
    runs = {mode: run_mode(a, mode, trees, workdir) for mode in a.modes}  # a failure keeps the logs in workdir
    shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(report(a, runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
