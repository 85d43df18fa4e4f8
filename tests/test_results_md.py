"""benchmarks/RESULTS.md is a document for users: its summary first, written from the comparison
sections below it; every benchmark's section short, with the date, the machine and the command
that reproduce it (as benchmarks/results.py's record writes them); one current section per
benchmark that exists, never a log of runs.

The file's length follows from that: it grows with the benchmarks, and each benchmark's section
replaces its last. A cap on the whole file's lines (raised three times as benchmarks came) guarded
the same thing less well, so it is gone: what keeps the file a read of a few minutes is the
section cap and the rule that a section belongs to a benchmark of benchmarks/."""

import os
import re

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
MAX_SECTION_LINES = 40


@pytest.fixture
def results(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    import results

    return results


def _sections(text: str) -> list[str]:
    """Every "## " section, from its heading to the next, without the blank lines that end it."""
    return [s.rstrip("\n") for s in re.split(r"^(?=## )", text, flags=re.M) if s.startswith("## ")]


@pytest.fixture
def text():
    with open(os.path.join(BENCHMARKS, "RESULTS.md"), encoding="utf-8") as f:
        return f.read()


def test_its_summary_comes_first_and_every_section_is_a_benchmark_that_exists(text, results):
    assert text.startswith("# Benchmark results\n")
    assert _sections(text)[0].startswith(f"## {results.SUMMARY} (")
    assert text.count(f"## {results.SUMMARY} (") == 1
    titles = [section.splitlines()[0].rsplit(" (", 1)[0] for section in _sections(text)]
    assert len(titles) == len(set(titles)), "a benchmark's section replaces its last"
    for section in _sections(text)[1:]:
        ran = re.findall(r"python (benchmarks/\w+\.py)", section)
        assert ran, f"{section.splitlines()[0]}: its command runs no benchmark of benchmarks/"
        for path in ran:
            assert os.path.exists(os.path.join(os.path.dirname(BENCHMARKS), path)), path


def test_the_summary_says_what_the_sections_below_it_say(text, results):
    assert results.with_summary(text) == text, "rerun results.with_summary on RESULTS.md"


def test_every_section_is_short_and_names_its_date_machine_and_command(text):
    sections = _sections(text)[1:]
    assert len(sections) >= 10, "every benchmark keeps its section"
    wrong = []
    for section in sections:
        lines = section.splitlines()
        heading = lines[0]
        if len(lines) > MAX_SECTION_LINES:
            wrong.append(f"{heading}: {len(lines)} lines, over {MAX_SECTION_LINES}")
        if not re.match(r"## .+ \(\d{4}-\d{2}-\d{2}( \d{2}:\d{2} \w+)?\)$", heading):
            wrong.append(f"{heading}: no date in the heading")
        if not any(line.startswith("Machine: ") for line in lines[1:4]):
            wrong.append(f"{heading}: no 'Machine: ' line under the heading")
        if not any(re.match(r"Command: `[^`]+`", line) for line in lines[1:5]):
            wrong.append(f"{heading}: no 'Command: `...`' line under the heading")
    assert wrong == []


SECTION = """## Time to it (2026-01-02 03:04 UTC)

Machine: a CPU, 2 cores, Linux; torch 2.0.
Command: `python benchmarks/lm_compare.py`

Byte-level transformer of 1M parameters (2 layers), batch 8.
Every system runs 960 steps but DDP, which runs 480.

| system | lr | 4 workers, 1 Gbit/s | 8 workers, 1 Gbit/s |
|---|---|---|---|
| alone | 0.002 | not reached; 9 ms | not reached; 12 ms |
| ddp | 0.002 | 20.0 s (1.00x); 90 ms | 40.0 s (1.00x); 90 ms |
| powersgd_r4 | 0.002 | 12.0 s (0.60x); 50 ms | not reached; 50 ms |
| torchft_diloco H=16 | 0.004 | 30.0 s (1.50x); 40 ms | not reached; 40 ms |
| sgp_bf16 | 0.008 | 9.0 s (0.45x); 30 ms | not reached; 30 ms |
| overlap_sgp | 0.008 | 11.0 s (0.55x); 30 ms | not run |
"""


def test_the_summary_reads_each_setting_of_a_table_of_systems(results):
    rows = results.summary_rows("# Benchmark results\n\n" + SECTION)
    assert rows == [
        "| 4 workers, 1 Gbit/s | Byte-level transformer of 1M parameters | Time to it (2026-01-02) "
        "| 20.0 s | 4.3 s | sgp_bf16: 9.0 s (0.45x) | sgp_bf16: 9.0 s (0.45x) "
        "| powersgd_r4: 12.0 s (0.60x) |",
        "| 8 workers, 1 Gbit/s | Byte-level transformer of 1M parameters | Time to it (2026-01-02) "
        "| 40.0 s | 5.8 s | ddp: 40.0 s (1.00x) | none of them reached it "
        "| none of them reached it |",
    ]


def test_the_summary_gives_the_bound_only_where_the_section_has_alone_and_ddps_steps(results):
    # The bound is DDP's 480 steps at alone's 9 ms (4.3 s): without the row, or without the
    # words that give DDP's steps, there is none.
    without_alone = "\n".join(line for line in SECTION.splitlines() if "| alone |" not in line)
    rows = results.summary_rows(without_alone)
    assert [row.split(" | ")[4] for row in rows] == ["-", "-"]
    without_steps = SECTION.replace("Every system runs 960 steps but DDP, which runs 480.\n", "")
    assert [row.split(" | ")[4] for row in results.summary_rows(without_steps)] == ["-", "-"]
    assert [row.split(" | ")[4] for row in results.summary_rows(SECTION)] == ["4.3 s", "5.8 s"]


def test_the_summary_repeats_the_bound_a_goals_table_states(results):
    # A goals table states the bound from the unrounded step times (4.4 s here, where the
    # rounded 9 ms would give 4.3 s): the summary gives the section's own figure.
    goals = (
        "| setting | goal | communication-free bound | met |\n|---|---|---|---|\n"
        "| 4 workers, 1 Gbit/s | <= 1.15x the bound | 4.4 s | no |\n\n"
    )
    stated = SECTION.replace("| system | lr |", goals + "| system | lr |", 1)
    assert [row.split(" | ")[4] for row in results.summary_rows(stated)] == ["4.4 s", "5.8 s"]


def test_the_summary_goes_first_and_is_replaced_in_place(results):
    other = "## Soak (2026-01-01)\n\nMachine: m.\nCommand: `python benchmarks/soak.py`\n"
    text = results.with_summary(f"# Benchmark results\n\nIntro.\n\n{other}\n{SECTION}")
    assert text.startswith(f"# Benchmark results\n\nIntro.\n\n## {results.SUMMARY} (")
    assert text.index("## Soak") > text.index("| 4 workers, 1 Gbit/s |")
    assert results.with_summary(text) == text
    faster = text.replace("| 9.0 s (0.45x); 30 ms | not reached", "| 5.0 s (0.25x); 30 ms | nr")
    assert "sgp_bf16: 5.0 s (0.25x)" in results.with_summary(faster)
    assert results.with_summary(faster).count(f"## {results.SUMMARY} (") == 1
    # Without a table of systems there is nothing to summarize, and the text stays as it is.
    alone = f"# Benchmark results\n\n{other}"
    assert results.with_summary(alone) == alone


def test_a_recorded_section_brings_the_summary_up_to_date(results, monkeypatch, tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text("# Benchmark results\n\nIntro.\n")
    monkeypatch.setattr(results, "RESULTS", str(path))
    results.write_section("Time to it", SECTION)
    text = path.read_text()
    assert _sections(text)[0].startswith(f"## {results.SUMMARY} (")
    assert "| sgp_bf16: 9.0 s (0.45x) |" in text and text.endswith(SECTION)


# What each benchmark writes stays within the limits at its default settings: made-up results of
# the default systems, settings and sizes, reported through the benchmark's own code.


def _section(path, title: str) -> list[str]:
    section = next(s for s in _sections(path.read_text()) if s.startswith(f"## {title} ("))
    return section.splitlines()


@pytest.fixture
def recorded(results, monkeypatch, tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text("# Benchmark results\n")
    monkeypatch.setattr(results, "RESULTS", str(path))
    return path


def _rows(names) -> dict[str, dict]:
    """Every system reaches its final 2.9 bpb, DDP's among them, at its own pace."""
    return {
        name: {
            "lr": 2e-3,
            "step_ms": 100.0 + i,
            "wire_bytes_per_step": 1e6,
            "final_bpb": 2.9,
            "peak_rss_mib": 400.0,
            "params": 440_000,
            "history": {
                "step": [480, 960],
                "time": [10.0 + i, 20.0 + i],
                "heldout_bpb": [3.5, 2.9],
            },
        }
        for i, name in enumerate(names)
    }


def test_the_comparisons_write_sections_within_the_limit(recorded, tmp_path, monkeypatch):
    import diloco_compare
    import lm_compare
    import streaming_compare

    from harness.compare import runner

    protocol = runner.Protocol(steps=960, ddp_steps=480)
    plot = ["--plot", str(tmp_path / "plot.png")]
    args = lm_compare.parse_args(plot)
    assert len(args.systems) == 18, "the default: every system but the other comparisons' DiLoCos"
    settings = [(4, 1e8), (4, 1e9), (8, 1e8), (8, 1e9)]
    rows = _rows(args.systems)
    lm_compare.report_all(args, protocol, dict.fromkeys(settings, rows), echo=False)
    args = diloco_compare.parse_args(plot)
    per_h = [diloco_compare.row_name(s, h) for h in args.sync_every for s in diloco_compare.PER_H]
    rows = _rows([*diloco_compare.ONCE, *per_h])
    diloco_compare.report_all(args, protocol, {(8, 1e9): rows, (8, 1e8): rows})
    rows = _rows([*streaming_compare.ONCE, *streaming_compare.PER_H])
    streaming_compare.report_all(streaming_compare.parse_args(plot), protocol, {(8, 1e8): rows})
    for title in (lm_compare.TITLE, diloco_compare.TITLE, streaming_compare.TITLE):
        assert len(_section(recorded, title)) <= MAX_SECTION_LINES, title
    summary = _section(recorded, "Summary")
    assert len([line for line in summary if line.startswith("| 8 workers, 100 Mbit/s |")]) == 3
    assert "| ddp: 21.0 s (1.00x) |" in "\n".join(summary), "DDP first: it is first here"


def test_the_cluster_benchmark_writes_a_section_within_the_limit(results, recorded):
    import cluster

    def mode(step, to_target):
        return {"step": step, "wire": 0.4, "steps": 40, "wall": 60.0, "to_target": to_target}

    runs = {}
    for n in (4, 8):
        for rate in (1e9, 1e10):
            modes = {"compute": mode(0.6, None), "ddp": mode(2.0, (18, 40.0))}
            modes.update({name: mode(1.2, (20, 25.0)) for name in cluster.MODES[1:]})
            round_ = {"seconds": 0.9, "bytes": 1e8, "wire": 0.8}
            runs[(n, rate)] = {
                "link": {"pair": 0.96, "ring": 0.94},
                "round": {"float32": round_, "bfloat16": round_},
                "modes": modes,
            }
    results.record("Emulated cluster", "What the workers ran.\n\n" + cluster.report(runs))
    lines = _section(recorded, "Emulated cluster")
    assert len(lines) <= MAX_SECTION_LINES
    assert (
        "- every gossip mode's step within 1.1x max(compute, wire) (goal): met in 0 of 20 rows"
        in (lines)
    )


def test_the_kernel_benchmark_writes_a_section_within_the_limit(results, recorded):
    import kernels
    import torch

    rows = []
    for name in ("float32", "bfloat16", "float16"):
        dtype = kernels.DTYPES[name]
        cases = kernels.make_cases(1001, dtype, torch.device("cpu"), "scalar", check=False)[0]
        for n in (1_000_000, 10_000_000, 25_000_000):
            for case in cases:
                timing = {"fused_ms": 1.0, "unfused_ms": 2.0, "copy_ms": 1.0, "fused_gbs": 50.0}
                timing.update(unfused_gbs=25.0, copy_gbs=50.0, of_copy=1.0, speedup=2.0)
                rows.append({"op": case.name, "dtype": name, "n": n, **timing})
    table = kernels.short_table(rows, 0.8)
    results.record("Push-sum kernels, cpu", f"{table}\n\n{kernels.summary(rows, 0.8)}")
    lines = _section(recorded, "Push-sum kernels, cpu")
    assert len(lines) <= MAX_SECTION_LINES
    assert (
        "| copy | float32 | 1.000 ms; 50.0 GB/s | 1.000 ms; 50.0 GB/s | 1.000 ms; 50.0 GB/s |"
        in (lines)
    )
