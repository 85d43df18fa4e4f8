"""Who may take part in an elastic job (gossip_ext.membership.trust and .admission): an outsider
who reaches the membership service's port, without the job's secret, can neither join, remove a
member, split the job nor read the model; a worker of another job is refused before it registers
and the members train on. Real processes over gloo on 127.0.0.1 (tests/elastic_job.py)."""

from __future__ import annotations

import io
import os
import pickle
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from elastic_job import HEARTBEAT_S, SILENT_S, STEPS, Job, free_port
from membership_worker import MODES
from torch import nn

import gossip_ext
from gossip_ext.flat_keywords import from_flat
from gossip_ext.membership import admission, elastic, epochs, handoff, service, trust

SECRET = "a job secret, 16 bytes or more"
DILOCO = ("--mode", "diloco")


class _Marker:
    """A pickle that, loaded, creates a file: the proof that a payload ran."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


# ----------------------------------------------------------------------------- an outsider


def _outsider_attacks(address: str, marker: Path) -> None:
    """Each move of the table in docs/elastic.md#security, by a process that holds no secret."""
    host, port = epochs.parse_address(address)
    raw = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))
    # Joining, without a secret or with another one: refused before it registers.
    for secret in (None, b"another secret, of 16 bytes"):
        with pytest.raises(PermissionError, match="secret"):
            elastic.ElasticWorker(address, 1, timedelta(seconds=3), "gloo", secret=secret)
    # Removing both members, twice, with and without a forged seal.
    for entry in ("0:died;1:died;", "0:died~" + "0" * 64 + ";"):
        raw.append("gone", entry)
        raw.add("events", 1)
    raw.compare_set("gone/0", "", "outsider")  # a claim on the announcement of worker 0
    # Splitting the job: the next epochs written first, with the members alone or the outsider.
    raw.set("epoch/1", "99|0")
    raw.set("epoch/2", "99|0,1,7")
    # Ids handed out again, a forged readiness, and a pickle where a replica's leader speaks.
    raw.set("worker_ids", "0")
    raw.set("ready/7", "1")
    raw.set("replica/0/told/1", pickle.dumps(_Marker(marker)))
    raw.set("fingerprint/extra", pickle.dumps(_Marker(marker)))


def _finished(job: Job, name: str) -> dict:
    result = job.result(name)
    assert result["error"] is None and result["removed"] is None, (name, job.log(name))
    assert result["final_step"] == STEPS, (name, job.log(name))
    return result


def _joins_with(address: str, module: nn.Module, **options) -> None:
    """A GossipDataParallel of ``module`` joining the job at ``address`` (with its secret and,
    unless ``options`` say otherwise, its timings)."""
    membership = {"job": "", "heartbeat_s": HEARTBEAT_S, "silent_s": SILENT_S}
    membership.update((k, options.pop(k)) for k in list(options) if k in membership)
    gossip_ext.GossipDataParallel(
        module,
        membership=gossip_ext.Elastic(address, secret=SECRET, **membership),
        timeout=timedelta(seconds=5),
        **options,
    )


def test_an_outsider_neither_joins_removes_splits_nor_runs_code_and_a_bad_worker_is_refused(
    tmp_path,
):
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o600)
    job = Job(tmp_path / "job", env={trust.SECRET_FILE_ENV: str(secret_file)})
    marker = tmp_path / "payload_ran"
    try:
        # Paced so that they still train when the last worker joins, after every refusal.
        for name in ("w0", "w1"):
            job.start(name, "--min-workers", "2", "--step-seconds", "0.3", *DILOCO)
        job.wait_for_step("w0", 3)
        address = f"127.0.0.1:{job.port}"
        _outsider_attacks(address, marker)
        # Workers of another job: another shape, algorithm, job name or membership timings (one
        # that waits longer for a silent worker than the others), each refused alone.
        net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        wider = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        # The job's own algorithm (its "diloco" mode), for a worker that differs in its timings
        # alone.
        algorithm = dict(zip(("gossip", "outer"), from_flat(MODES["diloco"])[:2]))
        refusals = [
            (wider, {}, "parameter '0.weight': the job has shape (16, 8) torch.float32"),
            (net, {"gossip": gossip_ext.SGP()}, "configuration.gossip: the job has None"),
            (net, {"job": "another"}, "job: the job has '', this worker has 'another'"),
            (net, {"silent_s": SILENT_S + 1, **algorithm}, f"membership.silent_s: the job has "
             f"{SILENT_S}, this worker has {SILENT_S + 1}"),
            (net, {"heartbeat_s": HEARTBEAT_S / 2, **algorithm}, f"membership.heartbeat_s: the "
             f"job has {HEARTBEAT_S}, this worker has {HEARTBEAT_S / 2}"),
        ]  # fmt: skip
        for module, options, words in refusals:
            with pytest.raises(admission.JobMismatchError, match="refused before joining") as no:
                _joins_with(address, module, **options)
            assert words in str(no.value), str(no.value)
            if "membership." in words:  # the timings alone differ
                assert no.value.differences == (words,), no.value.differences
        # One that differs where the fingerprint does not look (its outer learning rate) gets
        # into an epoch: the configuration check there takes it out alone.
        odd = job.start("odd", "--mode", "diloco_other_lr", "--step-seconds", "0.2")
        odd.wait(60)
        # A worker of the job joins after all of it, taking the members' model.
        job.start("w2", "--step-seconds", "0.2", "--init-seed", "7", *DILOCO)
        job.wait()
        results = [_finished(job, n) for n in ("w0", "w1", "w2")]
    finally:
        job.close()
    assert not marker.exists(), "a payload from the network ran"
    # No member was removed and the job never split: every epoch had both members (and for an
    # epoch, the odd one), and the last one all three; the ids handed out again were not taken
    # twice. (The outsider's bumps
    # of the ``events`` counter make the members form epochs again with the same members: a
    # flood, which costs time, not the job.)
    for result in results:
        assert {s["world_size"] for s in result["steps"]} <= {2, 3}, result["steps"]
        assert result["steps"][-1]["world_size"] == 3
    assert len({r["worker_id"] for r in results}) == 3
    assert odd.returncode != 0
    assert "ConfigurationMismatch" in job.log("odd") and "outer.rule" in job.log("odd")
    log = job.log("w0") + job.log("w1")
    assert "not sealed with this job's secret" in log, log
    for key in ("'gone'", "'epoch/1'"):
        assert key in log, (key, log)


# ----------------------------------------------------------------------------- the secret


def _serve(secret: bytes | None) -> tuple[str, threading.Event]:
    stop, port = threading.Event(), free_port()
    serving = threading.Thread(
        target=service.serve, args=("127.0.0.1", port, stop, secret), daemon=True
    )
    serving.start()
    end = time.monotonic() + 10
    while True:
        try:
            dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=1))
            return f"127.0.0.1:{port}", stop
        except Exception:  # noqa: BLE001 - not listening yet
            assert time.monotonic() < end, "the service did not start"
            time.sleep(0.05)


def test_a_worker_and_its_service_must_agree_on_the_secret():
    sealed, stop_sealed = _serve(SECRET.encode())
    open_job, stop_open = _serve(None)
    try:
        timeout = timedelta(seconds=3)
        with pytest.raises(PermissionError, match="started with a job secret, and this worker"):
            epochs.MembershipClient(sealed, timeout, None)
        with pytest.raises(PermissionError, match="another secret than this worker's"):
            epochs.MembershipClient(sealed, timeout, b"x" * 16)
        with pytest.raises(PermissionError, match="was started without one"):
            epochs.MembershipClient(open_job, timeout, SECRET.encode())
        # A silence shorter than the default's: wait_while_beating keeps the client's timings.
        timings = epochs.Timings(heartbeat_s=0.1, silent_s=0.5)
        client = epochs.MembershipClient(sealed, timeout, SECRET.encode(), timings)
        assert client.seal.authenticated
        # What the job's workers write carries its key: moved to another key, it is ignored.
        client.put("epoch/3", "5|0,1")
        moved = client.store.get("epoch/3")
        client.store.set("epoch/4", moved)
        assert client.epoch(3) == epochs.Epoch(3, (0, 1), 5)
        assert client.epoch(4) is None
        # A replica's leader speaks through sealed keys: a pickle there is never read, and a
        # follower waits on as if nothing were written, until the leader's heartbeat is silent.
        marker = Path(os.environ.get("TMPDIR", "/tmp")) / f"payload_ran_{os.getpid()}"
        client.store.set("replica/0/told/1", pickle.dumps(_Marker(marker)))
        client.events()  # the counter every job has from its first registration
        waiting = time.monotonic()
        with pytest.raises(TimeoutError, match="heartbeat of worker 0 stopped for 0.5 s"):
            client.wait_while_beating("replica/0/told/1", 0)
        assert time.monotonic() - waiting < epochs.SILENT_S
        assert not marker.exists()
        with pytest.warns(UserWarning, match="anyone who reaches the membership service's port"):
            admission.admit(epochs.MembershipClient(open_job, timeout), {"job": ""})
    finally:
        stop_sealed.set()
        stop_open.set()


def test_the_secret_comes_from_the_argument_the_environment_or_a_file(tmp_path, monkeypatch):
    monkeypatch.delenv(trust.SECRET_ENV, raising=False)
    monkeypatch.delenv(trust.SECRET_FILE_ENV, raising=False)
    assert trust.job_secret() is None
    monkeypatch.setenv(trust.SECRET_ENV, SECRET)
    assert trust.job_secret() == SECRET.encode()
    assert trust.job_secret(b"given, of sixteen bytes") == b"given, of sixteen bytes"
    monkeypatch.delenv(trust.SECRET_ENV)
    (tmp_path / "s").write_text(f"  {SECRET}\n")
    monkeypatch.setenv(trust.SECRET_FILE_ENV, str(tmp_path / "s"))
    (tmp_path / "s").chmod(0o644)  # as written: readable by every user of the machine
    with pytest.raises(ValueError, match="readable by other users.*chmod 600"):
        trust.job_secret()
    (tmp_path / "s").chmod(0o600)
    assert trust.job_secret() == SECRET.encode()
    monkeypatch.setenv(trust.SECRET_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="GOSSIP_EXT_JOB_SECRET_FILE='.*missing' cannot be read"):
        trust.job_secret()
    with pytest.raises(ValueError, match="at least 16 bytes"):
        trust.job_secret("short")
    for guessable in ("aaaaaaaaaaaaaaaaaaaaaaaa", "abababababababababababab"):
        with pytest.raises(ValueError, match="bits of entropy"):
            trust.job_secret(guessable)
    with pytest.raises(TypeError, match=r"\(secret=...\): secret must be a str or bytes, got int"):
        gossip_ext.Elastic("h:1", secret=12345678901234567890)
    assert SECRET not in repr(gossip_ext.Elastic("h:1", secret=SECRET))
    assert "secret" not in gossip_ext.Elastic("h:1", secret=SECRET).describe()


def test_a_handoff_loads_tensors_and_plain_values_only(tmp_path):
    # What a joiner does with a donor's bytes: a payload that would run code is refused, not run.
    marker = tmp_path / "payload_ran"
    payload = io.BytesIO()
    torch.save({"module": _Marker(marker)}, payload)
    with pytest.raises(pickle.UnpicklingError):
        handoff.load_handoff(payload.getvalue(), torch.device("cpu"))
    assert not marker.exists()
    state = {"module": {"w": torch.ones(2)}, "steps": 3, "outer": {"n": (1, 2.0)}}
    payload = io.BytesIO()
    torch.save(state, payload)
    loaded = handoff.load_handoff(payload.getvalue(), torch.device("cpu"))
    assert torch.equal(loaded["module"]["w"], torch.ones(2)) and loaded["outer"] == {"n": (1, 2.0)}
