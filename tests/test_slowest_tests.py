"""tools/slowest_tests.py reads a run's JUnit file: each test's time, its slow mark's reason (which
tests/conftest.py writes there) and the tested commit; it sorts the tests, finds those over 15 s
without a mark, rewrites the docs' table between its markers and refuses a missing file."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import slowest_tests  # noqa: E402

# A run of five tests: one marked slow, one over 15 s unmarked, one at exactly 15 s (not over),
# one in a class of this very file (its node id names the class), one skipped.
JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="pytest" errors="0" failures="1" skipped="1"
 tests="5" time="93.5" timestamp="2026-11-29T04:33:14.901027+00:00" hostname="vm">
<properties><property name="commit" value="0123456789ab" /></properties>
<testcase classname="tests.test_elastic" name="test_kill[sync]" time="40.25">
 <properties><property name="slow" value="kills a worker and waits out its heartbeat" />
 </properties></testcase>
<testcase classname="tests.test_demo" name="test_demo_runs" time="21.5">
 <failure message="assert 1 == 2">boom</failure></testcase>
<testcase classname="tests.test_graphs" name="test_ring" time="15.0" />
<testcase classname="tests.test_slowest_tests.TestKind" name="test_in_a_class" time="0.5" />
<testcase classname="tests.gpu.test_cuda_kernels" name="test_gpu[1]" time="0.001">
 <skipped type="pytest.skip" message="needs a CUDA GPU">needs a CUDA GPU</skipped></testcase>
</testsuite></testsuites>
"""


@pytest.fixture
def junit(tmp_path: Path) -> Path:
    path = tmp_path / "pytest-times.xml"
    path.write_text(JUNIT)
    return path


def test_a_run_is_read_slowest_first_with_marks_outcomes_and_commit(junit):
    run = slowest_tests.read_run(junit)
    assert [(t.node_id, t.seconds, t.outcome) for t in run.tests] == [
        ("tests/test_elastic.py::test_kill[sync]", 40.25, "passed"),
        ("tests/test_demo.py::test_demo_runs", 21.5, "failed"),
        ("tests/test_graphs.py::test_ring", 15.0, "passed"),
        ("tests/test_slowest_tests.py::TestKind::test_in_a_class", 0.5, "passed"),
        ("tests/gpu/test_cuda_kernels.py::test_gpu[1]", 0.001, "skipped"),
    ]
    assert run.tests[0].slow_reason == "kills a worker and waits out its heartbeat"
    assert [t.slow_reason for t in run.tests[1:]] == [None] * 4
    assert (run.wall_s, run.commit, run.started[:10]) == (93.5, "0123456789ab", "2026-11-29")


def test_only_unmarked_tests_over_15_s_are_named_and_the_marked_are_summed(junit):
    run = slowest_tests.read_run(junit)
    assert [t.node_id for t in slowest_tests.unmarked_slow(run)] == [
        "tests/test_demo.py::test_demo_runs"
    ]
    assert slowest_tests.marked_total_s(run) == 40.25
    printed = slowest_tests.report(run, top=2)
    assert "the 2 slowest of 5 tests:" in printed
    assert "[slow: kills a worker and waits out its heartbeat]" in printed
    assert "tests over 15 s without a slow mark: 1\n    21.50 s  tests/test_demo.py" in printed
    assert "marked slow: 1 tests, 40.2 s together (goal: under 5 min 00 s)" in printed
    assert "test_ring" not in printed  # neither among the 2 slowest nor over 15 s
    (junit.parent / "long.xml").write_text(JUNIT.replace('time="40.25"', 'time="330.0"'))
    printed = slowest_tests.report(slowest_tests.read_run(junit.parent / "long.xml"), top=2)
    assert (
        "marked slow: 1 tests, 5 min 30 s together (goal: under 5 min 00 s, OVER the goal)"
        in printed
    )


def test_a_missing_or_unreadable_file_is_refused_naming_it(tmp_path, capsys):
    missing = tmp_path / "nowhere.xml"
    assert slowest_tests.main([str(missing)]) == 1
    assert f"{missing}: no such JUnit file" in capsys.readouterr().err
    garbled = tmp_path / "garbled.xml"
    garbled.write_text("<testsuites><testcase")
    assert slowest_tests.main([str(garbled)]) == 1
    assert f"{garbled}: not readable as XML" in capsys.readouterr().err
    other = tmp_path / "other.xml"
    other.write_text("<coverage />")
    with pytest.raises(ValueError, match="not a JUnit file"):
        slowest_tests.read_run(other)


def test_the_docs_table_is_rewritten_between_its_markers_only(junit, tmp_path):
    docs = tmp_path / "testing.md"
    docs.write_text(
        f"# Testing\n\nbefore\n{slowest_tests.BEGIN}\nold table\n{slowest_tests.END}\nafter\n"
    )
    run = slowest_tests.read_run(junit)
    slowest_tests.write_docs(run, docs)
    text = docs.read_text()
    assert text.startswith("# Testing\n\nbefore\n") and text.endswith(
        f"{slowest_tests.END}\nafter\n"
    )
    assert "old table" not in text
    assert "From the run of 2026-11-29 04:33 UTC at 0123456789ab: 5 tests in 1 min 34 s" in text
    assert "1 marked slow, 40.2 s together; 1 over 15 s without a mark." in text
    assert "| 1 | `tests/test_elastic.py::test_kill[sync]` | 40.2 s | kills a worker" in text
    assert "| 2 | `tests/test_demo.py::test_demo_runs` (failed) | 21.5 s |  |" in text
    slowest_tests.write_docs(run, docs)
    assert docs.read_text() == text  # a second write changes nothing
    docs.write_text("# Testing, without the markers\n")
    with pytest.raises(ValueError, match="needs the two marker lines"):
        slowest_tests.write_docs(run, docs)


def test_the_docs_hold_the_markers_once_each_in_order():
    text = slowest_tests.DOCS.read_text()
    assert text.count(slowest_tests.BEGIN) == 1 and text.count(slowest_tests.END) == 1
    assert text.index(slowest_tests.BEGIN) < text.index(slowest_tests.END)


MARKED = """
import pytest

@pytest.mark.slow("waits out a timeout")
def test_marked():
    pass

def test_plain():
    pass
"""


def _pytest_with_this_conftest(folder: Path, source: str) -> subprocess.CompletedProcess:
    """pytest on a file of `source`, with tests/conftest.py loaded as a plugin (the file is not
    under tests/), writing folder/times.xml."""
    (folder / "test_sample.py").write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider"]
        + ["--rootdir", str(folder), f"--junitxml={folder / 'times.xml'}", str(folder)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=folder,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "tests")),
    )


def test_the_conftest_writes_each_slow_reason_and_the_commit_into_the_junit_file(tmp_path):
    ran = _pytest_with_this_conftest(tmp_path, MARKED)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    run = slowest_tests.read_run(tmp_path / "times.xml")
    reasons = {t.node_id.rpartition("::")[2]: t.slow_reason for t in run.tests}
    assert reasons == {"test_marked": "waits out a timeout", "test_plain": None}
    assert re.fullmatch(r"[0-9a-f]{12}(-dirty)?", run.commit), run.commit


def test_a_slow_mark_without_a_reason_is_refused(tmp_path):
    ran = _pytest_with_this_conftest(tmp_path, MARKED.replace('("waits out a timeout")', ""))
    assert ran.returncode != 0
    assert "test_marked: @pytest.mark.slow takes one reason" in ran.stdout + ran.stderr
