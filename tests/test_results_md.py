"""benchmarks/RESULTS.md is a document for users: its summary first, written from the comparison
sections below it; every benchmark's section short, with the date, the machine and the command
that reproduce it (as benchmarks/results.py's record writes them); the whole file short."""

import os
import re

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
MAX_SECTION_LINES = 40
MAX_LINES = 400


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


def test_the_file_is_short_and_its_summary_comes_first(text, results):
    assert len(text.splitlines()) <= MAX_LINES
    assert text.startswith("# Benchmark results\n")
    assert _sections(text)[0].startswith(f"## {results.SUMMARY} (")
    assert text.count(f"## {results.SUMMARY} (") == 1


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

| system | lr | 4 workers, 1 Gbit/s | 8 workers, 1 Gbit/s |
|---|---|---|---|
| alone | 0.002 | not reached; 9 ms | not reached; 9 ms |
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
        "| 20.0 s | sgp_bf16: 9.0 s (0.45x) | sgp_bf16: 9.0 s (0.45x) "
        "| powersgd_r4: 12.0 s (0.60x) |",
        "| 8 workers, 1 Gbit/s | Byte-level transformer of 1M parameters | Time to it (2026-01-02) "
        "| 40.0 s | ddp: 40.0 s (1.00x) | none of them reached it | none of them reached it |",
    ]


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
