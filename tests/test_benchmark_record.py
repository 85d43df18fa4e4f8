"""benchmarks/results.py: what a recorded section says reproduces the run, settings included."""

import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def _command_line(monkeypatch, env: dict[str, str]) -> str:
    monkeypatch.syspath_prepend(BENCHMARKS)
    import results

    for name in ("ATEN_CPU_CAPABILITY", "GOSSIP_EXT_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    script = os.path.join(BENCHMARKS, "kernels.py")
    monkeypatch.setattr(sys, "argv", [script, "--sizes", "1e6"])
    return results.command_line()


def test_the_command_line_carries_the_settings_that_change_a_run(monkeypatch):
    line = _command_line(
        monkeypatch, {"GOSSIP_EXT_MAX_CPU_ISA": "avx512", "ATEN_CPU_CAPABILITY": "avx2"}
    )
    assert line == (
        "ATEN_CPU_CAPABILITY=avx2 GOSSIP_EXT_MAX_CPU_ISA=avx512 "
        "python benchmarks/kernels.py --sizes 1e6"
    )


def test_the_command_line_is_plain_without_settings(monkeypatch):
    line = _command_line(monkeypatch, {"GOSSIP_EXT_MAX_CPU_ISA": ""})
    assert line == "python benchmarks/kernels.py --sizes 1e6"
