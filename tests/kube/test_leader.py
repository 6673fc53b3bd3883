"""Leader election on a Lease (kube.leader) against the API emulator: acquire, renew, take over only after the lease
duration on the taker's own clock, release, conflicts, and the holder giving up when it cannot renew."""

from __future__ import annotations

import asyncio
import time

import kmock
import pytest

from pdfleet_operator.kube import client, leader


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def elector(kube, identity: str, clock, **timing: float) -> leader.LeaderElector:
    config = leader.LeaseConfig(
        "kube-system",
        "pdfleet-operator",
        identity,
        **{"lease_duration": 15, "renew_deadline": 10, "retry_period": 2, **timing},
    )
    return leader.LeaderElector(
        client.Api(kube.url, headers={"Authorization": "Bearer emulator-token"}), config, clock=clock
    )


def run(coro):
    return asyncio.run(coro)


def test_one_holder_a_standby_takes_over_after_the_lease_duration_and_a_release_hands_over_at_once(kube) -> None:
    async def scenario() -> None:
        ca, cb = Clock(), Clock()
        a, b = elector(kube, "a", ca), elector(kube, "b", cb)
        assert await a.try_acquire_or_renew() is True  # created
        assert await b.try_acquire_or_renew() is False
        ca.now += 2
        assert await a.try_acquire_or_renew() is True  # renewed: a new record
        cb.now += 14
        assert await b.try_acquire_or_renew() is False  # b saw a new record 0 s ago (its own clock): wait
        cb.now += 14
        assert await b.try_acquire_or_renew() is False  # 14 s since b observed the record: still a's
        cb.now += 1.5
        assert await b.try_acquire_or_renew() is True  # a did not renew for 15.5 s of b's clock: b takes it
        assert await a.try_acquire_or_renew() is False and a.holding is False
        lease = kube.get("leases.coordination.k8s.io", "pdfleet-operator", "kube-system")
        assert lease["spec"]["holderIdentity"] == "b" and lease["spec"]["leaseTransitions"] == 1
        assert lease["spec"]["leaseDurationSeconds"] == 15
        await b.release()
        assert "holderIdentity" not in kube.get("leases.coordination.k8s.io", "pdfleet-operator", "kube-system")["spec"]
        assert await a.try_acquire_or_renew() is True  # released: taken at once, no waiting
        for e in (a, b):
            await e.api.close()

    run(scenario())


def test_two_standbys_racing_for_an_expired_lease_cannot_both_win(kube) -> None:
    async def scenario() -> None:
        clocks = [Clock(), Clock(), Clock()]
        old, x, y = (elector(kube, n, c) for n, c in zip(("old", "x", "y"), clocks))
        assert await old.try_acquire_or_renew()
        for e, c in ((x, clocks[1]), (y, clocks[2])):
            assert not await e.try_acquire_or_renew()
            c.now += 16
        won = await asyncio.gather(x.try_acquire_or_renew(), y.try_acquire_or_renew())
        # one wins: the loser's PUT carries a stale resourceVersion (409), or it reads the winner's fresh record
        assert sorted(won) == [False, True]
        for e in (old, x, y):
            await e.api.close()

    run(scenario())


def test_a_holder_that_cannot_renew_gives_up_after_the_renew_deadline(kube) -> None:
    async def scenario() -> list[str]:
        a = elector(kube, "a", time.monotonic, lease_duration=1.0, renew_deadline=0.3, retry_period=0.05)
        assert await a.acquire()
        kube.emulator["put", kmock.resource("coordination.k8s.io", "v1", "leases")] << 503
        lost: list[str] = []
        await asyncio.wait_for(a.keep(lost.append), 10)
        await a.api.close()
        return lost

    lost = run(scenario())
    assert lost == ["could not renew Lease kube-system/pdfleet-operator for 0.3 s"]


def test_timings_are_checked() -> None:
    with pytest.raises(ValueError, match="retry-period"):
        leader.LeaseConfig("ns", "n", "me", lease_duration=10, renew_deadline=10, retry_period=2)
    with pytest.raises(ValueError, match="namespace"):
        leader.LeaseConfig("", "n", "me")


def test_the_lease_thread_renews_while_the_callers_loop_is_blocked_and_releases_on_stop(kube) -> None:
    # NOTE: a renew deadline of seconds, not tenths: a loaded machine can stall this process (the Lease thread and
    # the emulator's) for half a second, and a holder that gave up here would be the machine, not the code.
    config = leader.LeaseConfig(
        "kube-system", "pdfleet-operator", "t", lease_duration=4.0, renew_deadline=2.0, retry_period=0.1
    )
    lost: list[str] = []
    thread = leader.LeaseThread(
        lambda: client.Api(kube.url, headers={"Authorization": "Bearer emulator-token"}), config, lost.append
    )
    thread.start()
    assert thread.acquired.wait(10)
    lease = "leases.coordination.k8s.io"
    first = kube.get(lease, "pdfleet-operator", "kube-system")["spec"]["renewTime"]
    # This thread busy (as a loop taking in 500 objects) for longer than the renew deadline: the Lease thread still
    # renews, and a holder that could not would have given up by now.
    time.sleep(config.renew_deadline + 0.5)
    assert kube.get(lease, "pdfleet-operator", "kube-system")["spec"]["renewTime"] > first and lost == []
    thread.stop()
    assert thread.done.is_set()
    assert "holderIdentity" not in kube.get(lease, "pdfleet-operator", "kube-system")["spec"]


def test_a_holder_that_finds_another_holder_stops_at_once(kube) -> None:
    async def scenario() -> list[str]:
        # (a renew deadline far longer than the test: only finding b, not a slow renewal, can end `keep`)
        a = elector(kube, "a", time.monotonic, lease_duration=10.0, renew_deadline=6.0, retry_period=0.05)
        assert await a.acquire()
        lease = kube.get("leases.coordination.k8s.io", "pdfleet-operator", "kube-system")
        kube.patch("leases.coordination.k8s.io", "pdfleet-operator", {"spec": {"holderIdentity": "b"}}, "kube-system")
        assert lease["spec"]["holderIdentity"] == "a"
        lost: list[str] = []
        await asyncio.wait_for(a.keep(lost.append), 10)
        await a.api.close()
        return lost

    assert run(scenario()) == ["Lease kube-system/pdfleet-operator is held by b"]


def test_the_holder_publishes_its_receiver_url_in_the_lease_and_a_standby_sees_it_only_while_unexpired(kube) -> None:
    def annotations() -> dict:
        lease = kube.get("leases.coordination.k8s.io", "pdfleet-operator", "kube-system")
        return lease["metadata"].get("annotations") or {}

    async def scenario() -> None:
        ca, cb = Clock(), Clock()
        url = leader.receiver_url("10.1.2.3", 9443)
        assert url == "http://10.1.2.3:9443"
        a = elector(kube, "a", ca, alertmanager_url=url)
        b = elector(kube, "b", cb)  # no receiver (or no POD_IP): publishes nothing
        assert await a.try_acquire_or_renew() is True  # created with the annotation
        assert annotations()[leader.ALERTMANAGER_URL_ANNOTATION] == url
        assert b.leader_url() is None  # not read yet
        assert await b.try_acquire_or_renew() is False
        assert b.leader_url() == url and a.leader_url() is None  # a's own URL is not "another leader"
        ca.now += 2
        assert await a.try_acquire_or_renew() is True  # renewed: still published
        assert annotations()[leader.ALERTMANAGER_URL_ANNOTATION] == url
        cb.now += 14.9
        assert b.leader_url() == url  # 14.9 s of b's clock since it saw the record: unexpired
        cb.now += 0.2
        assert b.leader_url() is None  # expired on b's clock: no leader known
        assert await b.try_acquire_or_renew() is False  # a's renewal is a new record: seen now, unexpired again
        assert b.leader_url() == url
        cb.now += 16
        assert await b.try_acquire_or_renew() is True  # b takes over and removes a's URL: it publishes none
        assert leader.ALERTMANAGER_URL_ANNOTATION not in annotations()
        assert await a.try_acquire_or_renew() is False and a.leader_url() is None
        await b.release()
        c = elector(kube, "c", Clock(), alertmanager_url="http://10.9.9.9:1")
        assert await c.try_acquire_or_renew() is True
        assert annotations()[leader.ALERTMANAGER_URL_ANNOTATION] == "http://10.9.9.9:1"
        assert await a.try_acquire_or_renew() is False and a.leader_url() == "http://10.9.9.9:1"
        await c.release()  # released: the URL goes with the holder
        assert leader.ALERTMANAGER_URL_ANNOTATION not in annotations()
        assert await b.try_acquire_or_renew() is True  # b takes the released Lease, publishing none
        assert await a.try_acquire_or_renew() is False and a.leader_url() is None
        for e in (a, b, c):
            await e.api.close()

    run(scenario())
    assert leader.receiver_url(None, 9443) is None and leader.receiver_url("10.1.2.3", None) is None
    assert leader.receiver_url("fd00::7", 9443) == "http://[fd00::7]:9443"
