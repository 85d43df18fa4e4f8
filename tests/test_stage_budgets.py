"""The test command's summary (tools/run_tests.sh): each stage's wall and CPU time beside its
budgets (wall and CPU); a stage over its wall budget is named, one whose CPU time passes
CPU_LIMIT_PERCENT of its CPU budget fails the command after the summary, the pytest stage with
its 10 slowest tests. Checked on stand-in stages: sourcing the script defines its machinery and runs
none of its stages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "run_tests.sh"

# A child process that spends `seconds` of CPU time, whatever the load.
BURN = "import sys, time\nwhile time.process_time() < float(sys.argv[1]): pass"

JUNIT = """<testsuites><testsuite name="pytest" tests="2" time="9.0">
<testcase classname="tests.test_a" name="test_slow" time="7.5" />
<testcase classname="tests.test_b" name="test_quick" time="1.5" />
</testsuite></testsuites>"""


def _stages(body: str, tmp_path: Path) -> subprocess.CompletedProcess:
    (tmp_path / "times.xml").write_text(JUNIT)
    script = (
        f'source "{SCRIPT}"\nPYTEST_TIMES="{tmp_path / "times.xml"}"\ntrap summary EXIT\n'
        f'burn() {{ "$PYTHON" -c "{BURN}" "$1"; }}\n{body}'
    )
    return subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
    )


def _cpu_limit_percent() -> int:
    """The figure at the top of the script, which a full run's CPU column tunes."""
    lines = SCRIPT.read_text().splitlines()
    settings = [i for i, line in enumerate(lines) if "CPU_LIMIT_PERCENT=" in line]
    assert len(settings) == 1 and settings[0] < lines.index("stage() {"), settings
    return int(lines[settings[0]].split("=")[1])


LIMIT = _cpu_limit_percent()


def test_stages_within_their_cpu_limit_pass_and_one_over_its_wall_budget_is_named(tmp_path):
    under = LIMIT / 100 - 0.3  # seconds of CPU, under the limit of a 1 s budget
    body = (
        'stage 100 100 "idle"\nsleep 0.1\nstage 1 1 "sleepy"\nsleep 2.1\n'
        f'stage 1 1 "busy"\nburn {under}\n'
    )
    ran = _stages(body, tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    rows = {line.split("  ")[0].strip(): line for line in ran.stdout.splitlines()}
    assert "cpu  0 min 00 s  (budgets  1 min 40 s, cpu  1 min 40 s)" in rows["idle"]
    assert rows["sleepy"].endswith("cpu  0 min 00 s  (budgets  0 min 01 s, cpu  0 min 01 s)  OVER")
    assert (
        f"cpu  0 min {round(under):02d} s  (budgets  0 min 01 s, cpu  0 min 01 s)" in rows["busy"]
    )
    assert "CPU OVER" not in ran.stdout and "FAILED" not in ran.stdout
    assert "over budget: sleepy" in ran.stdout
    assert "(budget  1 min 42 s)" in rows["all"]


def test_a_stage_past_its_cpu_limit_fails_the_command_after_the_summary(tmp_path):
    over = LIMIT / 100 + 0.2  # seconds of CPU, over the limit of a 1 s budget
    ran = _stages(f'stage 100 100 "idle"\ntrue\nstage 1 1 "busy"\nburn {over}\n', tmp_path)
    assert ran.returncode == 1
    summary, failure = ran.stdout.split("FAILED: ")
    busy_row = next(line for line in summary.splitlines() if line.startswith("busy "))
    assert busy_row.endswith(f"CPU OVER {LIMIT}%")
    assert "idle" not in failure
    assert failure.startswith(
        f'"busy" took  0 min {round(over):02d} s of CPU, over {LIMIT}% of its CPU budget of '
        " 0 min 01 s"
    )
    assert "test_slow" not in ran.stdout  # not the pytest stage: no list of tests


def test_the_pytest_stage_past_its_cpu_limit_names_its_10_slowest_tests(tmp_path):
    body = 'pytest_stage="pytest"\nstage 0 0 "pytest"\nburn 0.1\n'
    ran = _stages(body, tmp_path)
    assert ran.returncode == 1
    failure = ran.stdout.split('FAILED: "pytest"')[1]
    assert "the 2 slowest of 2 tests:" in failure
    assert failure.index("tests/test_a.py::test_slow") < failure.index("test_quick")


def test_a_failing_stage_keeps_its_own_exit_status(tmp_path):
    ran = _stages('stage 0 0 "busy and failing"\nburn 0.1\nexit 3\n', tmp_path)
    assert ran.returncode == 3
    assert 'FAILED: "busy and failing"' in ran.stdout


def test_the_cpu_limit_is_of_the_stage_s_own_cpu_budget_not_its_wall_budget(tmp_path):
    # A parallel build on 2 cores spends about twice its wall time in CPU: its CPU budget says so.
    ran = _stages('stage 1 10 "parallel build"\nburn 2\n', tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    row = next(line for line in ran.stdout.splitlines() if line.startswith("parallel build "))
    assert row.endswith("(budgets  0 min 01 s, cpu  0 min 10 s)  OVER"), row
    assert "FAILED" not in ran.stdout
