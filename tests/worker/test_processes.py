"""The test harness's ports: a child process given a port chosen for it must be able to listen there, or start again
on another (CI once lost three tests to a worker whose port, inside the kernel's ephemeral range, was taken while it
imported torch)."""

from __future__ import annotations

import socket

import pytest

from pdfleet_operator.local import ports
from tests.support.components import free_port
from tests.worker.processes import start_all, worker


def test_free_ports_lie_below_the_kernels_ephemeral_range_and_are_never_handed_out_twice():
    floor = ports.ephemeral_floor()
    got = [free_port() for _ in range(50)]
    assert len(set(got)) == 50
    assert all(1024 <= p < floor for p in got), (floor, got)
    for p in got[:5]:  # nobody listens there: a child can bind it
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", p))


def test_free_port_takes_the_kernels_choice_where_the_range_leaves_no_room_below(monkeypatch):
    real = ports.ephemeral_floor()
    monkeypatch.setattr(ports, "ephemeral_floor", lambda: 1500)
    got = ports.free_port()
    assert got >= real  # what bind(0) gave, not a draw from the 476 ports below 1500
    assert ports.port_free(got, reuse=False)


def _hold(port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_a_worker_whose_chosen_port_was_taken_starts_on_another(logdir, model_dir):
    w = worker(logdir, model_dir, "both", name="port-taken")
    taken = w.port
    with _hold(taken):
        try:
            start_all(w)
            assert w.port != taken and w.alive()
            assert w.load()["running"] == 0  # it answers where its handle says it is
        finally:
            w.stop()


def test_a_worker_given_a_taken_port_fails_with_the_reason(logdir, model_dir):
    port = free_port()
    w = worker(logdir, model_dir, "both", name="port-given", port=port)
    with _hold(port):
        with pytest.raises(RuntimeError, match="address already in use"):
            start_all(w)
    assert w.port == port
