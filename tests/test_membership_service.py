"""python -m gossip_ext.membership as a user starts it: its ready line is its own, on stdout, and
torch's log lines stay on stderr, also where c10d warns that a host name cannot be looked up. And
the store protocol the workers speak through it (gossip_ext.membership.epochs): announcements,
a joiner of a finished job, the heartbeats' looks and silences, the step boundary's reads."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gossip_ext.membership import elastic, epochs, trust
from gossip_ext.membership import service as membership_service

ROOT = Path(__file__).resolve().parent.parent
READY_LINE = re.compile(
    re.escape(f"{membership_service.PREFIX} {membership_service.READY} ")
    + r"127\.0\.0\.1:(\d+), ready; .+"
)


def _start(prefix: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    command = [sys.executable, "-m", "gossip_ext.membership", "--host", "127.0.0.1", "--port", "0"]
    environment = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.Popen(
        [*prefix, *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=environment,
    )  # fmt: skip


def _first_line(service: subprocess.Popen, timeout_s: float = 30.0) -> str:
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(service.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not line:
        service.kill()
        pytest.fail(f"no line on stdout within {timeout_s} s; stderr:\n{service.communicate()[1]}")
    return line[0]


def _stop(service: subprocess.Popen) -> tuple[str, str]:
    service.send_signal(signal.SIGTERM)
    out, err = service.communicate(timeout=30)
    assert service.returncode == 0, (service.returncode, err)
    return out, err


def test_the_ready_line_comes_first_on_stdout_once_the_store_serves():
    service = _start([])
    try:
        line = _first_line(service)
        match = READY_LINE.fullmatch(line.strip())
        assert match, line
        store = dist.TCPStore(
            "127.0.0.1", int(match.group(1)), is_master=False, timeout=timedelta(seconds=10)
        )
        store.set("probe", "1")
        assert store.get("probe") == b"1"
        del store
    finally:
        out, err = _stop(service)
    assert out == "", out  # nothing else on stdout
    assert membership_service.READY not in err, err


def _listening_addresses(port: int) -> set[str]:
    """The local addresses a socket listens on at ``port`` (/proc/net/tcp, IPv4)."""
    found = set()
    for row in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = row.split()[1], row.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            found.add(".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0)))
    return found


def test_the_service_listens_on_the_host_it_is_given_and_says_so():
    # Before, the store listened on every interface whatever --host said.
    service = _start([])
    try:
        match = READY_LINE.fullmatch(_first_line(service).strip())
        assert match
        assert _listening_addresses(int(match.group(1))) == {"127.0.0.1"}
        assert "no job secret is set" in match.group(0)  # an open job says so
    finally:
        _stop(service)


def _no_network_prefix() -> list[str] | None:
    """A command prefix that runs its command in a network namespace of its own, with only the
    loopback interface up (no DNS server answers there); None where that cannot be made."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return None
    prefix = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]
    if subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        return None
    return prefix


@pytest.mark.skipif(
    _no_network_prefix() is None, reason="needs unshare -n (a network namespace of its own)"
)
@pytest.mark.parametrize("log_level", [None, "ERROR"])
def test_without_a_network_torchs_warnings_stay_on_stderr(log_level):
    # The machine: c10d's reverse lookup of the store's own connection fails (err=-3) and
    # it logs a warning before the service could print anything.
    env = None if log_level is None else {"TORCH_CPP_LOG_LEVEL": log_level}
    service = _start(_no_network_prefix(), env)
    try:
        line = _first_line(service)
        assert READY_LINE.fullmatch(line.strip()), line
    finally:
        out, err = _stop(service)
    assert out == "", out
    assert membership_service.READY not in err, err
    if log_level == "ERROR":
        assert "[c10d]" not in err, err  # what the service's documentation promises


# ----------------------------------------------------------------------------- the store protocol


def test_a_worker_found_dead_by_several_neighbours_is_announced_once():
    # Two neighbours of worker 2 confirm its silence at the same time: one epoch change, not two
    # (each announcement bumps ``events``, and every bump forms an epoch).
    server = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{server.port}"
    neighbours = []
    for worker in (0, 1):
        client = epochs.MembershipClient(address, timedelta(seconds=5))
        client.worker = worker
        neighbours.append(client)
    before = neighbours[0].events()
    neighbours[0].announce_gone([2], "its round failed in epoch 0")
    neighbours[1].announce_gone([2, 3], "its round failed in epoch 0")  # 3 is news: announced
    neighbours[1].announce_gone([2], "did not reach epoch 1 in time")
    assert neighbours[0].events() == before + 2
    assert neighbours[1].gone() == {
        2: "its round failed in epoch 0",
        3: "its round failed in epoch 0",
    }
    assert neighbours[0]._text("gone").count("2:") == 1


def _ended_job(members_left: list[int]):
    """A membership service whose epoch 0 had workers 0 and 1, of which ``members_left`` left."""
    server = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = f"127.0.0.1:{server.port}"
    member = epochs.MembershipClient(address, timedelta(seconds=5))
    for worker in (0, 1):  # registered as register() does, without heartbeats of their own
        assert member.claim(f"id/{worker}", f"token {worker}") == f"token {worker}"
    server.append("registered", "0,1,")
    member.propose(0, [0, 1], member.events())
    server.set("latest", "0")
    member.announce_gone(members_left, epochs.LEFT)
    return server, address


@pytest.mark.parametrize("members_left", [[0, 1], [1]])
def test_a_joiner_of_a_job_whose_members_all_left_is_told_so_at_once(members_left):
    server, address = _ended_job(members_left)
    joiner = elastic.ElasticWorker(address, 1, timedelta(seconds=2), "gloo")
    start = time.monotonic()
    try:
        if members_left == [0, 1]:
            # Not the timeout's "are they training?": no member is left to take it in.
            with pytest.raises(RuntimeError) as error:
                joiner.join()
            assert time.monotonic() - start < 1.0
            assert str(error.value).startswith("gossip_ext: worker 2 cannot join the job at ")
            assert "every member of its epoch 0 is gone (worker 0: left the job, worker 1: " in (
                str(error.value)
            )
        else:
            # Worker 0 is still in the job: the joiner waits for it, up to its timeout.
            with pytest.raises(TimeoutError, match="to form epoch 1 with it"):
                joiner.join()
            assert time.monotonic() - start >= 2.0
    finally:
        joiner.client.heartbeat.stop()


class _CountingStore:
    """A store that counts the requests that read beats."""

    def __init__(self, store):
        self.store, self.reads = store, 0

    def check(self, keys):
        self.reads += 1
        return self.store.check(keys)

    def compare_set(self, key, expected, desired):
        return self.store.compare_set(key, expected, desired)

    def multi_get(self, keys):
        self.reads += 1
        return self.store.multi_get(keys)


def test_a_look_at_the_heartbeats_is_two_requests_and_a_worker_that_never_beat_is_silent():
    # Also: a beat an outsider forged (unsealed, or an old sealed count written back) is no beat.
    # Two requests whatever the number of workers (whether every key is there, then all of them
    # at once): a key that is not there (an outsider deleted it) is then read without waiting.
    server = torch.distributed.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    seal = trust.HmacSeal(b"a job secret of 16+ bytes", "nonce")
    # Shorter than the defaults (a silence of 1.5 s), which the looks would take if the watch
    # kept module constants rather than the job's timings.
    timings = epochs.Timings(heartbeat_s=0.05, silent_s=0.4)
    count = 5
    server.set("beat/1", seal.seal("beat/1", str(count)))  # worker 2 never beat: no key yet
    server.set("beat/3", seal.seal("beat/3", "7"))
    store = _CountingStore(server)
    beats = epochs.Beats(store, seal, [1, 2, 3], timings)
    store.reads = 0
    start = time.monotonic()
    looks, silent = 0, []
    while not silent:
        time.sleep(timings.heartbeat_s)
        count += 1
        server.set("beat/1", seal.seal("beat/1", str(count)))  # worker 1 beats; 2 and 3 do not
        forged = seal.seal("beat/3", "6") if looks % 2 else str(count)  # an old count, unsealed
        server.set("beat/3", forged)
        silent = beats.silent([1, 2, 3])
        looks += 1
    elapsed = time.monotonic() - start
    assert silent == [2, 3]
    # No wait for a missing key, nor for the default silence.
    assert timings.silent_s < elapsed < timings.silent_s + 1.0 < epochs.SILENT_S, elapsed
    assert store.reads == 2 * looks, (store.reads, looks)
    # A beat an outsider deleted is read as none, at once: no wait for the key to come back.
    server.delete_key("beat/1")
    began = time.monotonic()
    assert beats.unchanged([1, 2, 3]) == [1, 2, 3]
    assert time.monotonic() - began < 1.0
    server.set("beat/1", seal.seal("beat/1", str(count + 1)))
    assert beats.unchanged([1, 2, 3]) == [2, 3]


class _NoRequests:
    """A store that fails any request: what a step boundary must not make."""

    def __getattr__(self, name):
        raise AssertionError(f"a step boundary asked the membership service ({name})")


def test_a_step_boundary_asks_the_service_nothing_and_sees_a_change_from_the_watch():
    server = torch.distributed.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    address = f"127.0.0.1:{server.port}"
    worker = elastic.ElasticWorker(address, 1, timedelta(seconds=5), "gloo")
    worker.client.register()  # worker 0; events 1
    try:
        worker.epoch = epochs.Epoch(0, (0, 1), events=worker.client.events())
        worker.client.watch.follow(worker.epoch, [1], lambda why: None, lambda workers: [])
        asked, worker.client.store = worker.client.store, _NoRequests()
        start = time.monotonic()
        while time.monotonic() - start < 3 * epochs.HEARTBEAT_S:
            assert not worker.changed()
            time.sleep(0.01)
        server.append("registered", "1,")  # worker 1 registered (an open job: unsealed)
        changed = time.monotonic()
        while not worker.changed():
            # The watch looks every HEARTBEAT_S; a loaded machine may hold a look back a little.
            assert time.monotonic() - changed < 1.0, "the watch did not see the change"
            time.sleep(0.01)
    finally:
        worker.client.store = asked
        worker.client.watch.stop()
        worker.client.heartbeat.stop()
