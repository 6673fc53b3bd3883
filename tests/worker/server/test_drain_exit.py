"""Issue 24, rule 10: a worker SIGTERMed while busy exits 0, never by SIGABRT ("terminate called without an active
exception": the interpreter's teardown under a thread still inside torch). Real processes: SIGTERM while the model
loads, and while KV pulls read a prefill worker's leases."""

from __future__ import annotations

import signal
import threading

import httpx

from pdfleet_worker.kv_transfer.params import KVTransferParams
from pdfleet_worker.kv_transfer.tcp import TcpKVConnector
from tests.worker.processes import MODEL, wait_until, worker


def exited_cleanly(w, timeout: float = 60.0) -> None:
    code = w.proc.wait(timeout=timeout)
    log = w.log()
    assert "terminate called" not in log, log
    assert code == 0, f"{w.name} exited with {code}:\n{log}"


def test_sigterm_while_the_model_loads_exits_0(logdir, model_dir):
    # two torch threads: the load runs parallel kernels (the kernel probe, the warm-up) when SIGTERM comes
    w = worker(logdir, model_dir, "prefill", "--num-threads", "2", name="sigterm-loading")
    w.start()
    try:

        def loading() -> bool:
            try:
                body = httpx.get(f"{w.url}/ready", timeout=2).json()
            except httpx.HTTPError:
                return False
            return body.get("loaded") is False and body.get("alive") is True

        wait_until(loading, timeout=60, interval=0.02, what="the server up with the model still loading")
        w.signal(signal.SIGTERM)
        exited_cleanly(w)
    finally:
        w.kill()


def test_sigterm_while_kv_pulls_read_the_leases_exits_0(logdir, model_dir):
    w = worker(
        logdir,
        model_dir,
        "prefill",
        "--num-threads",
        "2",
        "--kv-lease",
        "60s",
        "--drain-timeout",
        "0.5s",
        "--num-kv-blocks",
        "1024",
        name="sigterm-pulled",
    )
    w.start().wait_ready()
    stop = threading.Event()
    pulls = [0]
    try:
        params = []
        for i in range(4):
            answer = httpx.post(
                f"{w.url}/v1/completions",
                timeout=60,
                json={
                    "model": MODEL,
                    "prompt": [5 + i] * 900,
                    "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True},
                },
            )
            params.append(KVTransferParams.from_json(answer.json()["kv_transfer_params"]))

        def pull(p: KVTransferParams) -> None:
            conn = TcpKVConnector()
            blocks = list(range(len(p.prompts[0].block_ids)))
            while not stop.is_set():
                try:
                    conn.pull(p, p.prompts[0], 0, blocks, p.compat_hash, 10)
                    pulls[0] += 1
                except Exception:  # refused or cut once the worker stops: what the test waits for
                    pass

        threads = [threading.Thread(target=pull, args=(p,), daemon=True) for p in params * 2]
        for t in threads:
            t.start()
        wait_until(lambda: pulls[0] >= 16, timeout=60, what="pulls running")
        # the leases are never acked: the drain waits out its 0.5 s for them, then stops under the running pulls
        w.signal(signal.SIGTERM)
        exited_cleanly(w)
    finally:
        stop.set()
        w.kill()
