"""``python -m gossip_ext.info``, as a user runs it: the version, what the extension was built
against beside what runs, the CPU kernels chosen, and each transport with whether it runs here,
each read back against torch's own answers."""

from __future__ import annotations

import subprocess
import sys

import torch
import torch.distributed as dist

import gossip_ext
from gossip_ext import info
from gossip_ext._torch_check import _C


def test_the_command_prints_the_versions_the_kernels_and_the_transports():
    printed = subprocess.run(
        [sys.executable, "-m", "gossip_ext.info"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    lines = printed.splitlines()
    assert lines[0] == f"gossip_ext {gossip_ext.__version__}"
    assert lines[1].startswith(f"built against: torch {_C.built_with_torch()}")
    assert f"running: torch {torch.__version__}" in printed
    assert f"CPU kernels: {_C.cpu_kernels_isa()}" in printed
    for name in ("process_group", "host_staging", "nccl"):
        assert any(line.strip().startswith(name) for line in lines), (name, printed)


def test_each_transport_says_whether_it_runs_here_as_torch_sees_this_machine():
    transports = {t["name"]: t for t in info.report()["transports"]}
    gloo = dist.is_gloo_available()
    gpu = torch.cuda.is_available()
    assert transports["process_group"]["runs_here"] == gloo
    assert transports["host_staging"]["runs_here"] == (gloo and gpu)
    nccl = transports["nccl"]
    assert nccl["compiled_in"] == hasattr(_C, "NcclTransport")
    assert nccl["runs_here"] == (nccl["compiled_in"] and gpu and dist.is_nccl_available())
    for t in transports.values():
        assert t["runs_here"] or t["why"], t  # a transport that cannot run says why


def test_a_cpu_build_says_it_has_no_cuda_and_a_cuda_build_names_its_versions():
    built = info.report()["built_with"]
    assert built["torch"] == _C.built_with_torch()
    if hasattr(_C, "NcclTransport"):
        assert built["cuda"] and built["nccl"] and built["cuda_archs"], built
        assert "CUDA " + built["cuda"] in info.format_report(info.report())
    else:
        assert built["cuda"] is None and built["nccl"] is None, built
        assert "no CUDA (a CPU build)" in info.format_report(info.report())
        assert "not in this build" in info.format_report(info.report())
