"""benchmarks/results.py: what a recorded section says reproduces the run, settings included."""

import os
import sys

import pytest

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


def test_a_benchmark_rewrites_its_own_section_and_leaves_the_others(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import results

    path = tmp_path / "RESULTS.md"
    path.write_text(
        "# Benchmark results\n\n## Round time (2026-01-01)\n\nold round table\n\n"
        "## Memory, cpu (2026-01-02)\n\nmemory table\n"
    )
    monkeypatch.setattr(results, "RESULTS", str(path))
    results.write_section("Round time", "## Round time (2026-02-01)\n\nnew round table\n")
    results.write_section("Soak (short)", "## Soak (short) (2026-02-02)\n\nsoak table\n")
    results.write_section("Memory, cpu", "## Memory, cpu (2026-02-03)\n\nnew memory table\n")
    text = path.read_text()
    assert text == (
        "# Benchmark results\n\n## Round time (2026-02-01)\n\nnew round table\n\n"
        "## Memory, cpu (2026-02-03)\n\nnew memory table\n\n"
        "## Soak (short) (2026-02-02)\n\nsoak table\n"
    )
    with pytest.raises(ValueError, match="must start with '## Soak"):
        results.write_section("Soak", "## Memory (x)\n")


def test_gossip_ext_results_sends_the_sections_alone_to_another_file(monkeypatch, tmp_path):
    # tools/gpu_check.sh collects each GPU benchmark's section so, ready to paste.
    import importlib

    monkeypatch.syspath_prepend(BENCHMARKS)
    path = tmp_path / "kernels.md"
    monkeypatch.setenv("GOSSIP_EXT_RESULTS", str(path))
    import results

    try:
        results = importlib.reload(results)
        results.write_section("Kernels, cuda", "## Kernels, cuda (2026-02-01)\n\ntable\n")
        results.write_section("NCCL round", "## NCCL round (2026-02-01)\n\nround table\n")
        assert path.read_text() == (
            "## Kernels, cuda (2026-02-01)\n\ntable\n\n## NCCL round (2026-02-01)\n\nround table\n"
        )
        assert results.RESULTS_MD.endswith(os.path.join("benchmarks", "RESULTS.md"))
    finally:
        monkeypatch.delenv("GOSSIP_EXT_RESULTS")
        importlib.reload(results)
