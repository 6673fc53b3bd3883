"""TTFT through prefill/decode disaggregation vs colocated serving on loopback, and KV pull bandwidth vs a raw loopback
socket measured in the same run (TCP connector, and NIXL where installed).

    python bench/pd.py [--preset tiny|small] [--prompt-tokens 2000] [--reps 15] [--wire-reps 30] [--threads 2]
                       [--nixl auto|on|off] [--pd-min-prompt-tokens 256] [--short-prompts 16,64,128] [--short-reps 100]
                       [--route-reps 1200]

Starts real processes (a prefill, a decode and a colocated worker, and one router with the PD
pool as tier `default` and the colocated worker as tier `colo`; with NIXL a second prefill/decode
pair on `--kv-connector nixl`), sends each path the same kind of request (a fresh random prompt
every time, so no prefix cache helps), and reports medians.
Targets: PD adds at most (KV bytes / measured loopback bandwidth) + 20 ms to TTFT; a KV pull moves
its bytes at >= 50% of a raw loopback socket's bandwidth (`kv_pull_vs_socket`: per repetition, one
pull next to one raw copy of the same bytes, the median of the ratios); a prompt shorter than the router's
--pd-min-prompt-tokens, which the router sends straight to the decode worker, reaches its first token no later than
through the router's colocated tier on the same worker (`short_route_vs_colocated`, the 95% interval of its median
under 1 + SHORT_ROUTE_MARGIN; see short_route), with the same against a colocated worker of its own reported
(`short_prompt_ttft_vs_colocated`; see short_prompts).
Ends with one JSON line.

What the two sides of that ratio time, like for like: the pull is the decode worker's own
pdfleet_kv_transfer_seconds (request frame, the prefill worker's lease and layout check, header, every
byte in the destination blocks) on a connection its pool kept from the pull before; the raw copy is
sendall of the same byte count from this process to a child that receives into a buffer it allocated
once, plus a 1-byte ack, on one connection set up before the timing. Each is one TCP connection with
one round trip; connection set-up is outside both. Each end of either runs in a session of its own
(RawSocket), so the kernel's per-session CPU shares treat them alike on a busy machine.
"""

from __future__ import annotations

import _sys_path  # noqa: F401  -- first: keeps bench/operator.py from shadowing the stdlib (see it)

# isort: split
import argparse  # noqa: E402
import functools  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys
import tempfile  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from pdfleet_operator.local.ports import free_port  # noqa: E402

PDFLEET = [sys.executable, "-m", "pdfleet_operator.cli"]


class Proc:
    def __init__(self, args: list[str], env: dict[str, str], log: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            PDFLEET + args + ["--host", "127.0.0.1", "--port", str(self.port)],
            stdout=open(log, "wb"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.log = log

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited {self.proc.returncode}: {open(self.log).read()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
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


@functools.cache
def client() -> httpx.Client:
    """The one client every timed request goes through, its connections kept alive as any real client keeps them.
    NOTE: httpx.post/httpx.stream build a client per call, ~20 ms of this process's CPU here (its SSL context), and
    that sat inside every timed window: a no-op request to a worker measured 22-33 ms, of which the worker's share is
    a few ms, and a ratio of two TTFTs was diluted towards 1 by the same constant on both sides."""
    return httpx.Client(timeout=300)


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def ttft(url: str, tier: str | None, prompt: list[int], max_tokens: int, local: bool | None = None) -> float:
    """Seconds from sending the request to the first streamed event, via the router (tier set) or straight to a
    worker (tier None). `local`: whether the router must have had the decode worker compute the prompt itself
    (its `x-pdfleet-prefill: local`), checked when not None."""
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"x-pdfleet-tier": tier} if tier else {}
    t0 = time.perf_counter()
    with client().stream("POST", f"{url}/v1/completions", json=body, headers=headers) as resp:
        assert resp.status_code == 200, resp.read()
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                first = time.perf_counter() - t0
                break
        for _ in lines:
            pass
    # NOTE: checked outside the timed window, which only the paths with a `local` to check would otherwise pay
    if local is not None and (resp.headers.get("x-pdfleet-prefill") == "local") != local:
        raise RuntimeError(
            f"a {len(prompt)}-token prompt came back with x-pdfleet-prefill "
            f"{resp.headers.get('x-pdfleet-prefill')!r}: expected {'local' if local else 'a prefill worker'}"
        )
    return first


_RECEIVER = """
import socket, sys
n = int(sys.argv[1]); port = int(sys.argv[2])
s = socket.create_connection(("127.0.0.1", port)); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = bytearray(n); view = memoryview(buf)
while s.recv_into(view[:1], 1, socket.MSG_PEEK):
    got = 0
    while got < n:
        k = s.recv_into(view[got:])
        if not k: raise SystemExit("closed")
        got += k
    s.sendall(b"k")
"""


class RawSocket:
    """A raw TCP copy of nbytes from this process to a child on loopback (sendall/recv_into into a buffer the
    child allocated once, one byte back as the ack): the wire without framing, tensors or a worker."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self._srv = socket.socket()
        self._srv.bind(("127.0.0.1", 0))
        self._srv.listen(1)
        # NOTE: a session of its own, as each worker has (Proc): with the kernel's autogroup scheduling a busy
        # machine shares CPU time per session, and a receiver in this process's session would get a share
        # the pull's two ends do not (or lack one they have).
        self._child = subprocess.Popen(
            [sys.executable, "-c", _RECEIVER, str(nbytes), str(self._srv.getsockname()[1])], start_new_session=True
        )
        self._conn, _ = self._srv.accept()
        self._conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._data = memoryview(bytearray(os.urandom(1 << 20)) * max(1, -(-nbytes // (1 << 20))))[:nbytes]

    def copy(self) -> float:
        """Seconds for one copy and its ack."""
        t0 = time.perf_counter()
        self._conn.sendall(self._data)
        assert self._conn.recv(1) == b"k"
        return time.perf_counter() - t0

    def close(self) -> None:
        self._conn.close()
        self._srv.close()
        self._child.wait(timeout=30)


def loopback_gbps(nbytes: int, reps: int) -> float:
    """Best GB/s of a raw TCP copy of nbytes between two processes on loopback."""
    raw = RawSocket(nbytes)
    try:
        return nbytes / min(raw.copy() for _ in range(reps)) / 1e9
    finally:
        raw.close()


def pull_seconds(prefill: str, decode: str, prompt: list[int], max_tokens: int) -> float:
    """One PD request driven as the router drives it; the decode worker's own measure of its pull (the
    pdfleet_kv_transfer_seconds it adds: connect, request, the bytes into the destination blocks)."""
    secs0 = metric(decode, "pdfleet_kv_transfer_seconds_sum")
    count0 = metric(decode, "pdfleet_kv_transfer_seconds_count")
    b = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    params = httpx.post(f"{prefill}/v1/completions", json=b, timeout=300).json()["kv_transfer_params"]
    r = httpx.post(
        f"{decode}/v1/completions", json=dict(b, kv_transfer_params=params, max_tokens=max_tokens), timeout=300
    )
    assert r.status_code == 200, r.text
    assert metric(decode, "pdfleet_kv_transfer_seconds_count") == count0 + 1, "the pull failed (recomputed)"
    return metric(decode, "pdfleet_kv_transfer_seconds_sum") - secs0


def nixl_installed() -> bool:
    return any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu12"))


def spread(xs: list[float], digits: int = 3) -> dict:
    q1, _, q3 = statistics.quantiles(xs, n=4) if len(xs) > 1 else (xs[0], None, xs[0])
    return {
        "median": round(statistics.median(xs), digits),
        "min": round(min(xs), digits),
        "q1": round(q1, digits),
        "q3": round(q3, digits),
        "max": round(max(xs), digits),
    }


ROUTES = ("short_prompt", "prefill_pool")  # pdfleet_router_pd_routes_total{route}
# The router's colocated tier over the decode worker: the short route's TTFT against colocated serving on the same
# worker process (short_route). NOTE: the router does not care which role a colocated tier's worker has, and a
# decode-role worker computes a plain request's prompt exactly as a `both` one does (no role-specific step work;
# the two roles answer alike warm, decode_vs_colocated_direct).
SAME_WORKER_TIER = "colo-on-decode"
# "No worse than colocated" is a non-inferiority claim: two paths that do the same work can never show an interval
# below 1.0, so the target is met when the 95% interval of the median stays under 1 + this margin. 1% of the tiny
# preset's ~6 ms TTFT is ~60 us; a route through the prefill pool costs +70-120% here (the 256-token prompts).
SHORT_ROUTE_MARGIN = 0.01


def pd_routes(router: str, tier: str) -> dict[str, float]:
    return {r: metric(router, "pdfleet_router_pd_routes_total", tier=tier, route=r) for r in ROUTES}


MIN_VERDICT_REPS = 5  # NOTE: fewer repetitions on this shared machine say nothing, whichever side they fall on
# From this many ratios on, the verdict is the median's: its 95% confidence interval (order statistics, no
# assumption about the distribution) on one side of the target. A short-prompt ratio comes from two repetitions
# of one request per length and path, ~10 ms each on the tiny preset, and single requests swing by 2x on a 2-core
# machine whatever their route, so "every ratio on one side" never happens at any number of repetitions while the
# median can still be pinned.
CI_VERDICT_REPS = 30


def median_ci(xs: list[float], conf: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval of the median of `xs`: the k-th smallest and k-th largest value for
    the largest k with P(Binomial(n, 1/2) < k) <= (1 - conf) / 2; min and max where no k qualifies."""
    xs, n = sorted(xs), len(xs)
    k, below = 0, 0.0  # below: P(Binomial(n, 1/2) <= k - 1)
    while k < n // 2 and below + math.comb(n, k) / 2**n <= (1 - conf) / 2:
        below += math.comb(n, k) / 2**n
        k += 1
    return (xs[0], xs[-1]) if k == 0 else (xs[k - 1], xs[n - k])


def verdict(xs: list[float], target: float = 1.0) -> str:
    """At most `target` is met. Met or missed where every repetition, of at least MIN_VERDICT_REPS, is on one side of
    the target, or, from CI_VERDICT_REPS repetitions, where the 95% confidence interval of their median is."""
    lo, hi = min(xs), max(xs)
    if len(xs) < MIN_VERDICT_REPS:
        return f"no verdict ({len(xs)} repetitions, fewer than {MIN_VERDICT_REPS})"
    if hi <= target:
        return f"met (every repetition <= {target})"
    if lo > target:
        return f"missed (every repetition > {target})"
    if len(xs) >= CI_VERDICT_REPS:
        c_lo, c_hi = median_ci(xs)
        ci = f"the median's 95% interval {c_lo:.3f} .. {c_hi:.3f}"
        if c_hi <= target:
            return f"met ({ci} <= {target}; repetitions {lo:.3f} .. {hi:.3f})"
        if c_lo > target:
            return f"missed ({ci} > {target}; repetitions {lo:.3f} .. {hi:.3f})"
        return f"no verdict ({ci} straddles {target}; repetitions {lo:.3f} .. {hi:.3f})"
    return f"no verdict (repetitions {lo:.3f} .. {hi:.3f} straddle {target})"


def ratio_keys(name: str, xs: list[float]) -> dict:
    """`name` (median of the per-repetition ratios), `name_min`, `name_max` and `name_spread`."""
    sp = spread(xs)
    return {name: sp["median"], f"{name}_min": sp["min"], f"{name}_max": sp["max"], f"{name}_spread": sp}


def short_prompts(
    router: str,
    colo: str,
    decode: str,
    lengths: list[int],
    long: int,
    reps: int,
    max_tokens: int,
    prompt,
    route_reps: int = 0,
) -> dict:
    """Disaggregate only where it pays, measured: prompts shorter than the router's --pd-min-prompt-tokens go through
    the PD tier straight to the decode worker, which computes them itself; the same lengths go to the colocated
    worker through the same router (tier `colo`) and straight to it, and to the decode worker straight (diagnostic:
    worker against worker, no router), and a `long`-token prompt (the shortest the
    router sends to the prefill pool) through both tiers for contrast. Per repetition every length once per path,
    each request a fresh prompt, the order of the paths reversed every other repetition; the ratios are of each
    repetition's median TTFTs, paired across the two orders (short_summary). Then, `route_reps` times, the short route
    against the colocated tier over the decode worker itself (short_route: the route's own cost, the worker process
    held fixed). Raises RuntimeError if any request took another route than the one it measures."""
    paths = {
        "pd": lambda p: ttft(router, "default", p, max_tokens, local=len(p) < long),
        "colo": lambda p: ttft(router, "colo", p, max_tokens),
        "direct": lambda p: ttft(colo, None, p, max_tokens),
        # NOTE: the decode worker without the router: tells the route's cost from the two worker processes' own speed
        "decode": lambda p: ttft(decode, None, p, max_tokens),
    }
    routes0 = pd_routes(router, "default")
    pulls0 = metric(decode, "pdfleet_kv_transfer_seconds_count")
    for n in lengths + [long]:  # warm-up: the decode worker's first local prefills, every path once per length
        for send in paths.values():
            send(prompt(n))
    short = {name: [] for name in paths}  # per path, per repetition: {length: seconds}
    longs = {"pd": [], "colo": []}
    for rep in range(reps):
        order = list(paths) if rep % 2 == 0 else list(reversed(paths))
        times = warm_timed(paths, order, lengths, prompt)
        for name in order:
            if name in longs:
                paths[name](prompt(long))
                longs[name].append(paths[name](prompt(long)))
        for name in paths:
            short[name].append(times[name])
    route = short_route(router, lengths, route_reps, max_tokens, prompt) if route_reps else {}
    taken = {r: int(v - routes0[r]) for r, v in pd_routes(router, "default").items()}
    pulls = int(metric(decode, "pdfleet_kv_transfer_seconds_count") - pulls0)
    sent = (2 * reps + 1) * len(lengths) + ((2 * route_reps + 1) * len(lengths) if route_reps else 0)
    want = {"short_prompt": sent, "prefill_pool": 2 * reps + 1}
    if taken != want or pulls != want["prefill_pool"]:
        raise RuntimeError(
            f"the router routed {taken} and the decode worker pulled KV {pulls} times; expected {want} and "
            f"{want['prefill_pool']} pulls: the short-prompt figures would measure another path"
        )

    return short_summary(short, longs, lengths, long) | route | {"short_prompt_routes": taken, "short_reps": reps}


def short_route(router: str, lengths: list[int], reps: int, max_tokens: int, prompt) -> dict:
    """The short route against colocated serving on one worker process: the PD tier's short prompts (straight to the
    decode worker) and the same lengths through the router's colocated tier over that same decode worker
    (SAME_WORKER_TIER), each timed request right after an untimed one on its path, the order reversed every other
    repetition. Across two processes (short_prompts' `colo` path) the ratio also measures which process happens to be
    warmer: 0.6-15% between a decode and a colocated worker in one run, against 0.4% in isolation (HISTORY.md).
    Holding the process fixed leaves the route: the router's routing decision against a colocated request's path.
    One ratio per length and pair of repetitions (the geometric mean over the two orders); the target's verdict
    (`short_prompt_verdict`) is the median's 95% interval under 1 + SHORT_ROUTE_MARGIN."""
    paths = {
        "pd": lambda p: ttft(router, "default", p, max_tokens, local=True),
        "same": lambda p: ttft(router, SAME_WORKER_TIER, p, max_tokens),
    }
    for n in lengths:  # warm-up
        for send in paths.values():
            send(prompt(n))
    times: dict[str, list[dict[int, float]]] = {name: [] for name in paths}
    for rep in range(reps):
        got = warm_timed(paths, list(paths) if rep % 2 == 0 else list(reversed(paths)), lengths, prompt)
        for name in paths:
            times[name].append(got[name])
    return route_summary(times, lengths)


def warm_timed(paths: dict, order: list[str], lengths: list[int], prompt) -> dict[str, dict[int, float]]:
    """One repetition: per length, per path in `order`, an untimed request and then the timed one ({path: {length:
    seconds}}). NOTE: every timed request right after an untimed one of the same length on the same path, so each
    meets its worker as a worker in a fleet meets its own steady stream of requests: warm. Without it a request to
    the worker the previous request had used ran 3-4 ms faster than one to the other (the tiny preset's weights stay
    in a last-level cache that another process's request evicts), and the ratio measured the order of the paths;
    with it, a decode-role and a colocated worker answered alike (1.004, interval 0.98-1.04, bench/HISTORY.md,
    fourteenth session)."""
    times: dict[str, dict[int, float]] = {name: {} for name in order}
    for n in lengths:
        for name in order:
            paths[name](prompt(n))
            times[name][n] = paths[name](prompt(n))
    return times


def route_summary(times: dict[str, list[dict[int, float]]], lengths: list[int]) -> dict:
    """short_route's keys from per-repetition TTFTs ({length: seconds} per repetition, paths `pd` and `same`)."""
    per = [{n: p[n] / q[n] for n in lengths} for p, q in zip(times["pd"], times["same"])]
    ratios = [math.sqrt(a[n] * b[n]) for a, b in zip(per[0::2], per[1::2]) for n in lengths] or [
        r[n] for r in per for n in lengths
    ]
    target = 1 + SHORT_ROUTE_MARGIN
    lo, hi = median_ci(ratios)
    return {
        **ratio_keys("short_route_vs_colocated", ratios),
        "short_route_interval": [round(lo, 4), round(hi, 4)],
        "short_route_margin": SHORT_ROUTE_MARGIN,
        "short_prompt_verdict": verdict(ratios, target),
        "short_route_ttft_ms": {
            name: round(statistics.median(t for rep in reps for t in rep.values()) * 1e3, 3)
            for name, reps in times.items()
        },
        "short_route_reps": len(per),
    }


def short_summary(short: dict[str, list[dict[int, float]]], longs: dict[str, list[float]], lengths, long) -> dict:
    """The short-prompt keys from per-path, per-repetition TTFTs (short: {length: seconds} per repetition)."""

    def per_rep(a: str, b: str) -> list[float]:
        return [statistics.median(x.values()) / statistics.median(y.values()) for x, y in zip(short[a], short[b])]

    def per_pair(xs: list[float]) -> list[float]:
        """One ratio per two repetitions, one in each order of the paths (their geometric mean): whatever order
        effect the warm-up requests of short_prompts leave, each pair holds it once each way (without them the
        per-repetition ratios split into clusters around 0.74 and 1.30)."""
        return [math.sqrt(a * b) for a, b in zip(xs[0::2], xs[1::2])] or xs

    vs_colo = per_pair(per_rep("pd", "colo"))
    return {
        **ratio_keys("short_prompt_ttft_vs_colocated", vs_colo),
        # NOTE: across two worker processes; the target's verdict is short_route's (short_prompt_verdict)
        "short_prompt_across_workers_verdict": verdict(vs_colo),
        **ratio_keys("long_prompt_ttft_vs_colocated", [a / b for a, b in zip(longs["pd"], longs["colo"])]),
        "short_prompt_ttft_vs_colocated_direct": round(statistics.median(per_pair(per_rep("pd", "direct"))), 3),
        "colocated_router_vs_direct": round(statistics.median(per_pair(per_rep("colo", "direct"))), 3),
        "short_prompt_router_vs_decode_direct": round(statistics.median(per_pair(per_rep("pd", "decode"))), 3),
        "decode_vs_colocated_direct": round(statistics.median(per_pair(per_rep("decode", "direct"))), 3),
        "short_prompt_ttft_vs_colocated_by_tokens": {
            str(n): round(statistics.median(x[n] / y[n] for x, y in zip(short["pd"], short["colo"])), 3)
            for n in lengths
        },
        "short_prompt_ttft_ms": {
            name: round(statistics.median(t for rep in reps for t in rep.values()) * 1e3, 2)
            for name, reps in short.items()
        },
        "long_prompt_ttft_ms": {name: round(statistics.median(xs) * 1e3, 2) for name, xs in longs.items()},
        "short_prompt_tokens": lengths,
        "long_prompt_tokens": long,
    }


def print_short(out: dict) -> None:
    ms = out["short_prompt_ttft_ms"]
    print(
        f"short prompts ({', '.join(map(str, out['short_prompt_tokens']))} tokens; the router's threshold "
        f"{out['long_prompt_tokens']}), {out['short_reps']} alternating reps:"
    )
    print(f"{'TTFT ratio (short: per pair of reps)':<40}{'median':>10}{'min':>10}{'q1':>10}{'q3':>10}{'max':>10}")
    for label, key in (
        ("PD short route / colocated, via router", "short_prompt_ttft_vs_colocated"),
        (f"PD pool ({out['long_prompt_tokens']} tok) / colocated", "long_prompt_ttft_vs_colocated"),
    ):
        sp = out[key + "_spread"]
        print(f"{label:<40}" + "".join(f"{sp[k]:>10}" for k in ("median", "min", "q1", "q3", "max")))
    print(
        f"median short TTFT ms: PD {ms['pd']}, colocated via router {ms['colo']}, colocated direct {ms['direct']}, "
        f"decode worker direct {ms['decode']}; router / direct: colocated {out['colocated_router_vs_direct']}, PD "
        f"short route {out['short_prompt_router_vs_decode_direct']}; decode / colocated worker, direct "
        f"{out['decode_vs_colocated_direct']}; PD / colocated by length "
        f"{out['short_prompt_ttft_vs_colocated_by_tokens']}; routes {out['short_prompt_routes']}"
    )
    print(f"short prompts' TTFT <= colocated, across the two workers: {out['short_prompt_across_workers_verdict']}")
    if "short_route_vs_colocated" in out:
        sp, ms, (lo, hi) = (
            out["short_route_vs_colocated_spread"],
            out["short_route_ttft_ms"],
            out["short_route_interval"],
        )
        print(
            f"the short route / colocated on the same (decode) worker, {out['short_route_reps']} alternating reps: "
            f"median {sp['median']} (95% interval {lo} .. {hi}; q1 {sp['q1']}, q3 {sp['q3']}); median TTFT ms "
            f"{ms['pd']} / {ms['same']}"
        )
        print(
            f"short prompts' TTFT no worse than colocated (margin {out['short_route_margin']:.0%}): "
            f"{out['short_prompt_verdict']}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: `pdfleet model init --preset` into a temp dir)")
    ap.add_argument("--preset", default="tiny", choices=("tiny", "small"))
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2, help="torch threads per worker")
    ap.add_argument("--wire-reps", type=int, default=30, help="alternating pull / raw socket (/ NIXL pull) repetitions")
    ap.add_argument(
        "--pd-min-prompt-tokens",
        type=int,
        default=256,
        metavar="N",
        help="the router's threshold: PD prompts shorter than N go straight to the decode worker (at most "
        "--prompt-tokens, above every --short-prompts length)",
    )
    ap.add_argument(
        "--short-prompts",
        default="16,64,128",
        help="comma-separated prompt lengths under the threshold, each sent every short repetition",
    )
    ap.add_argument(
        "--short-reps",
        type=int,
        default=100,
        help="alternating repetitions of the short-prompt section (0: skip it)",
    )
    ap.add_argument(
        "--route-reps",
        type=int,
        default=1200,
        help="alternating repetitions of the short route against the colocated tier over the same decode worker "
        "(the target's verdict; 0: skip it; needs --short-reps > 0)",
    )
    ap.add_argument(
        "--nixl",
        choices=("auto", "on", "off"),
        default="auto",
        help="also a prefill/decode pair on --kv-connector nixl (auto: when nixl-cu12 is installed)",
    )
    args = ap.parse_args()
    try:
        lengths = [int(x) for x in args.short_prompts.split(",")]
    except ValueError:
        ap.error(f"--short-prompts {args.short_prompts!r}: expected comma-separated token counts, e.g. 16,64,128")
    if not 0 < min(lengths) <= max(lengths) < args.pd_min_prompt_tokens <= args.prompt_tokens:
        ap.error(
            f"need 0 < --short-prompts ({args.short_prompts}) < --pd-min-prompt-tokens ({args.pd_min_prompt_tokens})"
            f" <= --prompt-tokens ({args.prompt_tokens}): short prompts under the threshold, the PD overhead's "
            "prompts through the prefill pool"
        )
    if args.short_reps < 0 or args.route_reps < 0:
        ap.error("--short-reps and --route-reps must be >= 0")
    if args.nixl == "on" and not nixl_installed():
        ap.error("--nixl on needs NIXL's Python package (pip install nixl-cu12)")
    with_nixl = args.nixl == "on" or args.nixl == "auto" and nixl_installed()

    tmp = tempfile.mkdtemp(prefix="pdfleet-bench-pd-")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    model = args.model
    if model is None:
        model = os.path.join(tmp, args.preset)
        subprocess.run(
            PDFLEET + ["model", "init", model, "--preset", args.preset], check=True, env=env, stdout=subprocess.DEVNULL
        )
    common = [
        "worker",
        "--model",
        model,
        "--served-model-name",
        "bench",
        "--num-threads",
        str(args.threads),
        "--num-kv-blocks",
        str(2 * (-(-(args.prompt_tokens + 64) // 16)) + 8),
        "--max-num-batched-tokens",
        str(args.prompt_tokens + 64),
        "--no-enable-prefix-caching",
        "--log-level",
        "warning",
    ]
    workers = [
        Proc(common + ["--role", role], env, os.path.join(tmp, f"{role}.log")) for role in ("prefill", "decode", "both")
    ]
    # NOTE: UCX on one host: shared memory (cma) and TCP on lo only (FACTS.md: otherwise it also takes the NICs).
    nixl_env = {**env, "UCX_NET_DEVICES": "lo"}
    nixl_pair = (
        [
            Proc(common + ["--role", role, "--kv-connector", "nixl"], nixl_env, os.path.join(tmp, f"{role}-nixl.log"))
            for role in ("prefill", "decode")
        ]
        if with_nixl
        else []
    )
    procs = workers + nixl_pair
    try:
        for w in procs:
            w.wait_ready()
        prefill, decode, colo = workers
        router = Proc(
            [
                "router",
                "--prefill",
                prefill.url,
                "--decode",
                decode.url,
                "--workers",
                f"colo={colo.url}",
                f"{SAME_WORKER_TIER}={decode.url}",
                "--health-interval",
                "0.5",
                "--pd-min-prompt-tokens",
                str(args.pd_min_prompt_tokens),
                "--log-level",
                "warning",
            ],
            env,
            os.path.join(tmp, "router.log"),
        )
        procs.append(router)
        router.wait_ready()
        info = httpx.get(f"{decode.url}/load").json()
        rng = random.Random(0)
        vocab = int(json.load(open(os.path.join(model, "config.json")))["vocab_size"])

        def prompt(n: int = args.prompt_tokens) -> list[int]:
            return [rng.randrange(4, vocab) for _ in range(n)]

        for tier in ("default", "colo", "default", "colo"):  # warm up both paths
            ttft(router.url, tier, prompt(), args.max_tokens)
        bytes0 = metric(decode.url, "pdfleet_kv_transfer_bytes_total", direction="received")
        secs0 = metric(decode.url, "pdfleet_kv_transfer_seconds_sum")
        pulls0 = metric(decode.url, "pdfleet_kv_transfer_seconds_count")
        pd, co = [], []
        for _ in range(args.reps):  # interleaved, so drifting machine load hits both alike
            pd.append(ttft(router.url, "default", prompt(), args.max_tokens))
            co.append(ttft(router.url, "colo", prompt(), args.max_tokens))
        pulls = metric(decode.url, "pdfleet_kv_transfer_seconds_count") - pulls0
        kv_total = metric(decode.url, "pdfleet_kv_transfer_bytes_total", direction="received") - bytes0
        kv_secs = metric(decode.url, "pdfleet_kv_transfer_seconds_sum") - secs0
        # Diagnostics, acting as the router: the decode leg alone (request with KV parameters to its
        # first event: admission, pull, import, one step) and a no-op request (what any request
        # costs on this machine right now, scheduling delays included).
        legs, noops = [], []
        for _ in range(args.reps):
            b = {
                "model": "bench",
                "prompt": prompt(),
                "max_tokens": 1,
                "temperature": 0,
                "kv_transfer_params": {"do_remote_decode": True},
            }
            params = httpx.post(f"{prefill.url}/v1/completions", json=b, timeout=300).json()["kv_transfer_params"]
            b = dict(b, kv_transfer_params=params, max_tokens=args.max_tokens, stream=True)
            t0 = time.perf_counter()
            with client().stream("POST", f"{decode.url}/v1/completions", json=b) as resp:
                lines = resp.iter_lines()
                next(line for line in lines if line.startswith("data: {"))
                legs.append(time.perf_counter() - t0)
                for _ in lines:
                    pass
            t0 = time.perf_counter()
            client().post(f"{colo.url}/v1/completions", json={"model": "bench", "prompt": [5], "max_tokens": 1})
            noops.append(time.perf_counter() - t0)
        assert pulls == args.reps, f"{pulls} pulls for {args.reps} requests"
        kv_bytes = int(kv_total / args.reps)
        short = (
            short_prompts(
                router.url,
                colo.url,
                decode.url,
                lengths,
                args.pd_min_prompt_tokens,
                args.short_reps,
                args.max_tokens,
                prompt,
                args.route_reps,
            )
            if args.short_reps
            else {}
        )
        # The wire: per repetition one TCP pull, one raw copy of the same bytes (and one NIXL pull), in turn.
        raw = RawSocket(kv_bytes)
        wire: dict[str, list[float]] = {"tcp": [], "socket": [], "nixl": []}
        try:
            for _ in range(args.wire_reps):
                wire["tcp"].append(kv_bytes / pull_seconds(prefill.url, decode.url, prompt(), args.max_tokens) / 1e9)
                wire["socket"].append(kv_bytes / raw.copy() / 1e9)
                if nixl_pair:
                    secs = pull_seconds(nixl_pair[0].url, nixl_pair[1].url, prompt(), args.max_tokens)
                    wire["nixl"].append(kv_bytes / secs / 1e9)
        finally:
            raw.close()
        if nixl_pair:
            moved = httpx.get(f"{nixl_pair[1].url}/load", timeout=10).json().get("kv_transfers", {})
            assert moved.get("nixl") == args.wire_reps, f"the NIXL pair moved {moved}, not {args.wire_reps} NIXL reads"
        tcp_ratio = [a / b for a, b in zip(wire["tcp"], wire["socket"])]
        nixl_ratio = [a / b for a, b in zip(wire["nixl"], wire["socket"])]
        cfg = json.load(open(os.path.join(model, "config.json")))
        per_block = (
            cfg["num_hidden_layers"]
            * 2
            * cfg["num_key_value_heads"]
            * info["block_size"]
            * cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
            * 4
        )  # fp32
        # The decode worker computes the last prompt token itself: the KV of P-1 tokens moves.
        expected = -(-(args.prompt_tokens - 1) // info["block_size"]) * per_block
        loop_gbps = loopback_gbps(kv_bytes, reps=max(5, args.reps))
        pd_ms, co_ms = statistics.median(pd) * 1e3, statistics.median(co) * 1e3
        # NOTE: the median of paired differences (each PD request next to a colocated one) resists
        # the drift of a shared machine better than the difference of two medians.
        diffs = sorted((a - b) * 1e3 for a, b in zip(pd, co))
        overhead = statistics.median(diffs)
        q1, _, q3 = statistics.quantiles(diffs, n=4)
        target = kv_bytes / (loop_gbps * 1e9) * 1e3 + 20
        result = {
            "pd_ttft_overhead_ms": round(overhead, 2),
            "kv_bytes": kv_bytes,
            "transfer_gbps": round(kv_total / kv_secs / 1e9, 3),
            "loopback_gbps": round(loop_gbps, 3),
            "ttft_pd_ms": round(pd_ms, 2),
            "ttft_colocated_ms": round(co_ms, 2),
            "target_ms": round(target, 2),
            "meets_target": overhead <= target,
            "prompt_tokens": args.prompt_tokens,
            "model": args.preset if not args.model else args.model,
            "reps": args.reps,
            "threads": args.threads,
            "pull_ms_mean": round(kv_secs / pulls * 1e3, 2),
            "overhead_iqr_ms": [round(q1, 1), round(q3, 1)],
            "overhead_min_ms": round((min(pd) - min(co)) * 1e3, 2),
            "decode_leg_ms": round(statistics.median(legs) * 1e3, 2),
            "noop_request_ms": round(statistics.median(noops) * 1e3, 2),
            "kv_pull_gbps": round(statistics.median(wire["tcp"]), 3),
            "socket_gbps": round(statistics.median(wire["socket"]), 3),
            "kv_pull_vs_socket": round(statistics.median(tcp_ratio), 3),
            "kv_pull_vs_socket_spread": spread(tcp_ratio),
            "kv_pull_gbps_spread": spread(wire["tcp"]),
            "socket_gbps_spread": spread(wire["socket"]),
            "kv_pull_meets_target": statistics.median(tcp_ratio) >= 0.5,
            "wire_reps": args.wire_reps,
            "pd_min_prompt_tokens": args.pd_min_prompt_tokens,
            **short,
        }
        if nixl_pair:
            result.update(
                kv_pull_gbps_nixl=round(statistics.median(wire["nixl"]), 3),
                kv_pull_nixl_vs_socket=round(statistics.median(nixl_ratio), 3),
                kv_pull_nixl_vs_socket_spread=spread(nixl_ratio),
            )
        assert expected == kv_bytes, f"moved {kv_bytes} bytes per request, expected {expected}"
        print(f"{'path':<12}{'median TTFT ms':>16}{'min':>10}{'max':>10}")
        for name, xs in (("colocated", co), ("PD", pd)):
            print(f"{name:<12}{statistics.median(xs) * 1e3:>16.1f}{min(xs) * 1e3:>10.1f}{max(xs) * 1e3:>10.1f}")
        print(
            f"KV per request {kv_bytes / 1e6:.2f} MB, pulled at {result['transfer_gbps']} GB/s "
            f"(mean pull {result['pull_ms_mean']} ms); raw loopback copy {result['loopback_gbps']} GB/s"
        )
        print(
            f"decode leg alone (KV params -> first event) {result['decode_leg_ms']} ms; a no-op request "
            f"{result['noop_request_ms']} ms"
        )
        print(
            f"{'wire, GB/s':<12}{'median':>10}{'min':>10}{'q1':>10}{'q3':>10}{'max':>10}   "
            f"({args.wire_reps} alternating reps)"
        )
        for name in ("tcp", "nixl", "socket"):
            if wire[name]:
                sp = spread(wire[name])
                print(
                    f"{name if name != 'tcp' else 'tcp pull':<12}"
                    + "".join(f"{sp[k]:>10}" for k in ("median", "min", "q1", "q3", "max"))
                )
        for name, xs in (("tcp/socket", tcp_ratio), ("nixl/socket", nixl_ratio)):
            if xs:
                sp = spread(xs)
                print(f"{name:<12}" + "".join(f"{sp[k]:>10}" for k in ("median", "min", "q1", "q3", "max")))
        print(
            f"PD overhead {overhead:.1f} ms (paired median; IQR {q1:.1f} .. {q3:.1f} ms) vs target {target:.1f} ms: "
            f"{'OK' if result['meets_target'] else 'MISSED'}"
        )
        if short:
            print_short(short)
        print(json.dumps(result))
        return 0
    finally:
        for p in reversed(procs):
            p.stop()


if __name__ == "__main__":
    sys.exit(main())
