"""The membership store's values are hints: an outsider without the job's secret, with a raw
TCPStore client, rewrites, deletes and replays them, and the job trains on (gossip_ext.membership
.ledger, .trust; docs/elastic.md, Security). Real processes over gloo on 127.0.0.1
(tests/elastic_job.py), and the store's own calls where a race is what is tested."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from elastic_job import SILENT_S, STEPS, Job, free_port

from gossip_ext.errors import TamperedStoreError
from gossip_ext.membership import epochs, service, trust

SECRET = "a job secret, 16 bytes or more"
DILOCO = ("--mode", "diloco")


def _secret_file(tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    return {trust.SECRET_FILE_ENV: str(path)}


def _an_earlier_jobs_nonce(tmp_path) -> str:
    """``job`` as the service of an earlier job of the same secret wrote it."""
    earlier = Job(tmp_path / "earlier", env=_secret_file(tmp_path))
    try:
        raw = dist.TCPStore(
            "127.0.0.1", earlier.port, is_master=False, timeout=timedelta(seconds=5)
        )
        return raw.get(trust.JOB_KEY).decode()
    finally:
        earlier.close()


@pytest.mark.slow("two elastic jobs' services, four workers, one of them joining after the attacks")
def test_counters_overwritten_lists_deleted_and_an_old_nonce_written_back_stop_nothing(tmp_path):
    old_nonce = _an_earlier_jobs_nonce(tmp_path)
    job = Job(tmp_path / "job", env=_secret_file(tmp_path))
    try:
        for name in ("w0", "w1"):
            job.start(name, "--min-workers", "2", "--step-seconds", "0.25", *DILOCO)
        # One that trains a few steps and leaves: its departure is what a deleted list forgets.
        job.start("short", "--steps", "6", "--step-seconds", "0.1", *DILOCO)
        job.workers["short"].wait(60)
        job.wait_for_step("w0", 8)
        raw = dist.TCPStore("127.0.0.1", job.port, is_master=False, timeout=timedelta(seconds=5))
        # The counters the protocol used to add to: the service dropped every client that added
        # to a key set to something else.
        raw.set("events", "x")
        raw.set("worker_ids", "x")
        # The sealed lists wiped: who registered, who is gone, the changes announced.
        for key in ("gone", "registered", "changes"):
            raw.delete_key(key)
        # An earlier job's nonce written back: a joiner that took it trained alone.
        raw.set(trust.JOB_KEY, old_nonce)
        job.start("w2", "--step-seconds", "0.2", "--init-seed", "7", *DILOCO)
        job.wait(150)
        results = {name: job.result(name) for name in ("w0", "w1", "w2")}
    finally:
        job.close()
    for name, result in results.items():
        assert result["error"] is None and result["removed"] is None, (name, job.log(name))
        assert result["final_step"] == STEPS, (name, job.log(name))
    # The joiner joined this job (not a job of its own), and the one that left stayed gone.
    assert results["w2"]["steps"][-1]["world_size"] == 3, results["w2"]["steps"][-3:]
    assert results["w0"]["steps"][-1]["world_size"] == 3, results["w0"]["steps"][-3:]
    assert len({r["worker_id"] for r in results.values()}) == 3


def _open_service() -> tuple[str, threading.Event, dist.TCPStore]:
    stop, port = threading.Event(), free_port()
    threading.Thread(
        target=service.serve,
        args=("127.0.0.1", port, stop, SECRET.encode()),
        daemon=True,
    ).start()
    end = time.monotonic() + 10
    while True:
        try:
            raw = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))
            return f"127.0.0.1:{port}", stop, raw
        except Exception:  # noqa: BLE001 - not listening yet
            assert time.monotonic() < end, "the service did not start"
            time.sleep(0.05)


class _AlwaysJunk:
    """A store whose every compare_set finds an outsider's value: one that wins every race."""

    def __init__(self, store):
        self.store = store

    def compare_set(self, key, expected, desired):
        return b"junk"


def test_a_claim_wins_past_deletions_and_junk_or_ends_at_the_timeout_naming_the_key():
    address, stop, raw = _open_service()
    client = epochs.MembershipClient(address, timedelta(seconds=1.5), SECRET.encode())
    spoiling = threading.Event()

    def spoil():  # deletes the key, then writes junk, as fast as it can
        while not spoiling.is_set():
            raw.delete_key("id/0")
            raw.set("id/0", "junk")

    outsider = threading.Thread(target=spoil, daemon=True)
    outsider.start()
    try:
        # A key deleted between two of the claim's requests is written afresh: no spinning.
        began = time.monotonic()
        assert client.claim("id/0", "mine") == "mine"
        assert time.monotonic() - began < 1.5
    finally:
        spoiling.set()
        outsider.join()
    # An outsider that wins every race: the claim ends at the timeout, naming the key.
    client.store = _AlwaysJunk(client.store)
    began = time.monotonic()
    try:
        with pytest.raises(TamperedStoreError, match="'id/1'") as error:
            client.claim("id/1", "mine")
        assert error.value.key == "id/1"
        assert 1.5 <= time.monotonic() - began < 3.0
    finally:
        stop.set()


def test_a_rendezvous_value_an_outsider_wrote_over_is_waited_past_until_the_members_comes():
    address, stop, raw = _open_service()
    try:
        client = epochs.MembershipClient(address, timedelta(seconds=3), SECRET.encode())
        sealed = client.rendezvous_store
        raw.set("epoch/1/group/rank_0", "junk")  # before the member's own value
        threading.Timer(0.5, sealed.set, args=("epoch/1/group/rank_0", b"address")).start()
        assert sealed.get("epoch/1/group/rank_0") == b"address"
        raw.set("epoch/1/group/rank_1", "junk")  # and a value that is never sealed
        began = time.monotonic()
        with pytest.raises(TamperedStoreError, match="rank_1"):
            sealed.get("epoch/1/group/rank_1")
        assert 3.0 <= time.monotonic() - began < 5.0
    finally:
        stop.set()


def test_the_nonce_comes_from_the_running_service_not_from_what_the_store_shows():
    address, stop, raw = _open_service()
    try:
        first = epochs.MembershipClient(address, timedelta(seconds=3), SECRET.encode())
        raw.set(trust.JOB_KEY, "an earlier job's nonce~" + "0" * 64)
        joiner = epochs.MembershipClient(address, timedelta(seconds=3), SECRET.encode())
        # Both seal alike: a value one writes the other opens.
        first.mark_ready()
        end = time.monotonic() + 2.0  # a TCPStore set is not confirmed: another client may
        while not joiner.is_ready(first.worker) and time.monotonic() < end:  # read first
            time.sleep(0.01)
        assert joiner.is_ready(first.worker)
    finally:
        stop.set()
    # A store that answers no challenge (not the job's service, or its answers deleted) ends in
    # an error naming the challenge, within the timeout.
    mute = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mute.set(trust.JOB_KEY, "a nonce~" + "0" * 64)
    began = time.monotonic()
    with pytest.raises(TamperedStoreError, match="challenge"):
        trust.seal_for_job(mute, SECRET.encode(), f"127.0.0.1:{mute.port}", timedelta(seconds=1))
    assert time.monotonic() - began < 3.0


@pytest.mark.slow("an elastic job trained through a replay three silences long")
def test_a_members_beat_written_back_over_it_removes_nobody(tmp_path):
    """The outsider copies each member's latest sealed beat and writes it back over the key a
    thousand times a second, for longer than the silence that removes a member: the beats look
    stopped, the watchers ping the members over the epoch's group, the members answer, and nobody
    is announced gone (Note [A silence is confirmed over the group])."""
    job = Job(tmp_path / "job", env=_secret_file(tmp_path))
    try:
        for name in ("w0", "w1"):
            job.start(name, "--min-workers", "2", "--step-seconds", "0.2")
        job.wait_for_step("w0", 4)
        raw = dist.TCPStore("127.0.0.1", job.port, is_master=False, timeout=timedelta(seconds=5))
        old = {w: raw.get(f"beat/{w}") for w in (0, 1)}
        end = time.monotonic() + 3 * SILENT_S
        while time.monotonic() < end:
            for w, beat in old.items():
                raw.set(f"beat/{w}", beat)
            time.sleep(0.001)
        job.wait(120)
        results = {name: job.result(name) for name in ("w0", "w1")}
        logs = {name: job.log(name) for name in ("w0", "w1")}
    finally:
        job.close()
    for name, result in results.items():
        assert result["error"] is None and result["removed"] is None, (name, logs[name])
        assert result["final_step"] == STEPS, (name, logs[name])
        assert {s["world_size"] for s in result["steps"]} == {2}, result["steps"]
    assert any("answered over the epoch's group" in log for log in logs.values()), logs
