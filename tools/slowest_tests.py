"""Where the suite's time goes, from a run's JUnit file (the test command's build/pytest-times.xml).

Every test over 15 s on the 2-core machine carries ``@pytest.mark.slow("why")``, and the marked
tests together stay under 5 minutes (docs/testing.md). tests/conftest.py writes each mark's reason
and the tested commit into the JUnit file; this script reads them back and prints the slowest
tests, the tests over 15 s without a mark and the marked tests' total. With --write-docs it also
rewrites the table of the 30 slowest tests in docs/testing.md, between its two marker comments.

  python3 tools/slowest_tests.py [build/pytest-times.xml] [--top N] [--write-docs]

It exits non-zero only when the JUnit file is missing or unreadable: the time limits are the test
command's to enforce (its CPU budgets, tools/run_tests.sh), this script says where the time went.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_XML = ROOT / "build" / "pytest-times.xml"
DOCS = ROOT / "docs" / "testing.md"
BEGIN = "<!-- slowest tests: begin (written by tools/slowest_tests.py --write-docs) -->"
END = "<!-- slowest tests: end -->"

SLOW_S = 15.0  # a test past this needs a slow mark
MARKED_GOAL_S = 300.0  # what the marked tests together may take
DOCS_ROWS = 30


@dataclass(frozen=True)
class TestTime:
    node_id: str
    seconds: float
    slow_reason: str | None  # None: no slow mark
    outcome: str  # passed, failed, error or skipped


@dataclass(frozen=True)
class Run:
    tests: list[TestTime]  # slowest first
    wall_s: float  # pytest's own total
    started: str  # when the run began, as the JUnit file says
    commit: str


def _node_id(classname: str, name: str) -> str:
    """pytest's node id from JUnit's classname (dotted: folders, module, classes) and name."""
    parts = classname.split(".")
    # The longest prefix that is a file of the checkout is the module; the rest are classes.
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if (ROOT / path).is_file():
            return "::".join([path, *parts[cut:], name])
    return "::".join(["/".join(parts) + ".py", name])


def _outcome(case: ElementTree.Element) -> str:
    for outcome in ("failure", "error", "skipped"):
        if case.find(outcome) is not None:
            return {"failure": "failed"}.get(outcome, outcome)
    return "passed"


def read_run(path: Path) -> Run:
    """The tests of a JUnit file, slowest first. Raises FileNotFoundError or ValueError naming
    the file when it is missing or not a JUnit file of pytest's."""
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no such JUnit file (the test command writes build/pytest-times.xml; "
            "pytest writes one with --junitxml=PATH)"
        )
    try:
        root = ElementTree.parse(path).getroot()
    except ElementTree.ParseError as error:
        raise ValueError(f"{path}: not readable as XML ({error})") from None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    if root.tag not in ("testsuite", "testsuites") or not suites:
        raise ValueError(f"{path}: not a JUnit file (its root is <{root.tag}>, no <testsuite>)")
    tests = []
    for case in root.iter("testcase"):
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        node_id = _node_id(case.get("classname", ""), case.get("name", ""))
        tests.append(
            TestTime(node_id, float(case.get("time", 0)), properties.get("slow"), _outcome(case))
        )
    tests.sort(key=lambda test: (-test.seconds, test.node_id))
    commits = {
        p.get("value")
        for suite in suites
        for p in suite.iterfind("properties/property")
        if p.get("name") == "commit"
    }
    return Run(
        tests=tests,
        wall_s=sum(float(s.get("time", 0)) for s in suites),
        started=suites[0].get("timestamp", ""),
        commit=", ".join(sorted(commits)) or "not recorded",
    )


def unmarked_slow(run: Run) -> list[TestTime]:
    """The tests over SLOW_S seconds that carry no slow mark, slowest first."""
    return [t for t in run.tests if t.seconds > SLOW_S and t.slow_reason is None]


def marked_total_s(run: Run) -> float:
    return sum(t.seconds for t in run.tests if t.slow_reason is not None)


def _duration(seconds: float) -> str:
    whole = round(seconds)
    return f"{whole // 60} min {whole % 60:02d} s" if whole >= 60 else f"{seconds:.1f} s"


def _date(started: str) -> str:
    try:
        when = datetime.fromisoformat(started)
    except ValueError:
        return started or "an unrecorded date"
    if when.tzinfo is None:  # pytest writes the local time without its zone before pytest 8
        return when.strftime("%Y-%m-%d %H:%M")
    return when.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def slowest(run: Run, top: int) -> list[str]:
    lines = [f"the {min(top, len(run.tests))} slowest of {len(run.tests)} tests:"]
    for test in run.tests[:top]:
        mark = f"  [slow: {test.slow_reason}]" if test.slow_reason else ""
        lines.append(f"  {test.seconds:7.2f} s  {test.node_id}{mark}")
    return lines


def report(run: Run, top: int) -> str:
    """What the test command prints after pytest."""
    marked = [t for t in run.tests if t.slow_reason is not None]
    lines = slowest(run, top)
    unmarked = unmarked_slow(run)
    lines.append(f"tests over {SLOW_S:.0f} s without a slow mark: {len(unmarked) or 'none'}")
    lines += [f"  {test.seconds:7.2f} s  {test.node_id}" for test in unmarked]
    over = ", OVER the goal" if marked_total_s(run) >= MARKED_GOAL_S else ""
    lines.append(
        f"marked slow: {len(marked)} tests, {_duration(marked_total_s(run))} together "
        f"(goal: under {_duration(MARKED_GOAL_S)}{over})"
    )
    return "\n".join(lines)


def docs_table(run: Run) -> str:
    """The section between BEGIN and END in docs/testing.md."""
    marked = [t for t in run.tests if t.slow_reason is not None]
    lines = [
        f"From the run of {_date(run.started)} at {run.commit}: {len(run.tests)} tests in "
        f"{_duration(run.wall_s)} (pytest's total); {len(marked)} marked slow, "
        f"{_duration(marked_total_s(run))} together; {len(unmarked_slow(run))} over "
        f"{SLOW_S:.0f} s without a mark.",
        "",
        "| | test | time | slow, because |",
        "|---|---|---|---|",
    ]
    for rank, test in enumerate(run.tests[:DOCS_ROWS], 1):
        reason = (test.slow_reason or "").replace("|", "\\|")
        outcome = "" if test.outcome == "passed" else f" ({test.outcome})"
        lines.append(f"| {rank} | `{test.node_id}`{outcome} | {test.seconds:.1f} s | {reason} |")
    return "\n".join(lines)


def write_docs(run: Run, docs: Path = DOCS) -> None:
    text = docs.read_text()
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(
            f"{docs}: needs the two marker lines, once each, in order:\n{BEGIN}\n{END}"
        )
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    docs.write_text(f"{head}{BEGIN}\n{docs_table(run)}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("xml", nargs="?", type=Path, default=DEFAULT_XML, help="a JUnit file")
    parser.add_argument("--top", type=int, default=10, help="how many slowest tests to list")
    parser.add_argument(
        "--slowest-only", action="store_true", help="list the slowest tests and nothing else"
    )
    parser.add_argument(
        "--write-docs", action="store_true", help=f"rewrite the table in {DOCS.relative_to(ROOT)}"
    )
    parser.add_argument("--commit", help="the commit the run tested, where the file lacks it")
    args = parser.parse_args(argv)
    try:
        run = read_run(args.xml)
    except (FileNotFoundError, ValueError) as error:
        print(f"tools/slowest_tests.py: {error}", file=sys.stderr)
        return 1
    if args.commit:
        run = Run(run.tests, run.wall_s, run.started, args.commit)
    if args.slowest_only:
        print("\n".join(slowest(run, args.top)))
        return 0
    print(report(run, args.top))
    if args.write_docs:
        write_docs(run)
        print(f"wrote the {DOCS_ROWS} slowest tests into {DOCS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
