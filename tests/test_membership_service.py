"""python -m gossip_ext.membership as a user starts it: its ready line is its own, on stdout, and
torch's log lines stay on stderr, also where c10d warns that a host name cannot be looked up."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

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
