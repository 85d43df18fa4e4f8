"""Puts tests/ on sys.path so that test modules can ``from reference import ...`` whatever the
pytest import mode, and the repository root last, so that they can ``import harness`` (the
benchmark harness, never installed) while ``import gossip_ext`` still finds an installed copy
first (tools/rehearse_build.sh runs the tests against one from outside the checkout).

It also writes into the run's JUnit file (``--junitxml``, the test command's
build/pytest-times.xml) what tools/slowest_tests.py reads beside each test's time: the reason of
its ``slow`` mark, if it has one, and the commit the run tested; and at the end it waits for the
ranks' server, so that the ranks' CPU time is counted (pytest_unconfigure)."""

import subprocess
import sys
from pathlib import Path

import pytest

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.append(_ROOT)


def slow_reason(item: pytest.Item) -> str | None:
    """The reason of ``item``'s ``@pytest.mark.slow("why")``, None if it has no such mark. A mark
    without a reason is refused: the reason is what the table of the slowest tests shows."""
    mark = item.get_closest_marker("slow")
    if mark is None:
        return None
    reason = mark.args[0] if mark.args else mark.kwargs.get("reason")
    if not isinstance(reason, str) or not reason.strip() or len(mark.args) > 1:
        raise pytest.UsageError(
            f"{item.nodeid}: @pytest.mark.slow takes one reason, a non-empty string saying why "
            f"the test needs over 15 s (got args={mark.args!r}, kwargs={mark.kwargs!r})"
        )
    return reason.strip()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # user_properties go into each test's <testcase> of the JUnit file as <property> elements.
    for item in items:
        reason = slow_reason(item)
        if reason is not None:
            item.user_properties.append(("slow", reason))


def _commit() -> str:
    """The checkout's commit, with "-dirty" where the tested files differ from it."""
    try:
        described = subprocess.run(
            ["git", "-C", _ROOT, "describe", "--always", "--dirty", "--abbrev=12"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return described.stdout.strip() if described.returncode == 0 else "unknown"


@pytest.fixture(scope="session", autouse=True)
def _commit_in_the_junit_file(request: pytest.FixtureRequest) -> None:
    if request.config.getoption("xmlpath", None):
        request.getfixturevalue("record_testsuite_property")("commit", _commit())


def pytest_unconfigure(config: pytest.Config) -> None:
    """Stops the ranks' server (tests/multiprocess.py) and waits for it. It reaps every rank it
    forked, so waiting for it brings their CPU time into pytest's own children's, which the test
    command reports for the stage (tools/run_tests.sh); a server left to stop on its own, after
    pytest, is reaped by no one the shell can see, and its ranks' CPU time with it."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    stop = getattr(server, "_stop", None)  # what CPython's own tests stop the server with
    if stop is not None:
        stop()
