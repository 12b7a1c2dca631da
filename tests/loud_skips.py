"""A pytest plugin (loaded by tests/conftest.py): a test that cannot run where it is (no root for
the emulated cluster, no C compiler for grace/native) is skipped with its reason, and the run ends
with a section naming every check it did not make. Under CI (``CI`` set, as .ci/run runs), where
everything must run, a skipped test fails the run."""

from __future__ import annotations

import os

import pytest

_SKIPPED: list = []


def under_ci() -> bool:
    """Whether ``CI`` says this is CI (``true``, ``1``, ``yes``)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def pytest_runtest_logreport(report):
    """Record a skipped test and its reason (an expected failure is not a skip)."""
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _SKIPPED.append((report.nodeid, reason.removeprefix("Skipped: ")))


def pytest_sessionfinish(session, exitstatus):
    """Under CI, a run that skipped a test fails."""
    if _SKIPPED and under_ci() and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    """The section naming every check the run did not make, and why."""
    if not _SKIPPED:
        return
    ci = " (CI runs everything: this run fails)" if under_ci() else ""
    terminalreporter.section(f"NOT CHECKED HERE: {len(_SKIPPED)} tests skipped{ci}", sep="!",
                             red=True, bold=True)
    for nodeid, reason in _SKIPPED:
        terminalreporter.write_line(f"{nodeid}: {reason}")
