"""A pytest plugin (loaded by tests/conftest.py): a test that cannot run where it is (no root for
the emulated cluster, no C compiler for grace/native) is skipped with its reason, and the run ends
with a section naming every check it did not make. Under CI (``CI`` set, as .ci/run runs), where
everything must run, a skipped test fails the run."""

from __future__ import annotations

import os

import pytest

_SKIPPED: list = []


def pytest_runtest_logreport(report):
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _SKIPPED.append((report.nodeid, reason.removeprefix("Skipped: ")))


def pytest_sessionfinish(session, exitstatus):
    if _SKIPPED and os.environ.get("CI") and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if not _SKIPPED:
        return
    ci = " (CI runs everything: this run fails)" if os.environ.get("CI") else ""
    terminalreporter.section(f"NOT CHECKED HERE: {len(_SKIPPED)} tests skipped{ci}", sep="!",
                             red=True, bold=True)
    for nodeid, reason in _SKIPPED:
        terminalreporter.write_line(f"{nodeid}: {reason}")
