"""tests/loud_skips.py: a skip names what it did not check, and fails the run under CI."""

from __future__ import annotations

import os

pytest_plugins = ["pytester"]
TESTS = os.path.dirname(os.path.abspath(__file__))


def run(pytester, monkeypatch, ci: bool, source: str):
    """A pytest of its own (a subprocess: the plugin's record is per process) over ``source``."""
    monkeypatch.setenv("PYTHONPATH", TESTS)
    if ci:
        monkeypatch.setenv("CI", "true")
    else:
        monkeypatch.delenv("CI", raising=False)
    pytester.makepyfile(source)
    return pytester.runpytest_subprocess("-p", "loud_skips")

SKIPPING = """
import pytest

@pytest.mark.skipif(True, reason="no C compiler: the loops are not compared")
def test_needs_a_compiler():
    pass

def test_runs():
    pass
"""


def test_a_skip_is_named_in_a_section_of_its_own(pytester, monkeypatch):
    result = run(pytester, monkeypatch, False, SKIPPING)
    result.assert_outcomes(passed=1, skipped=1)
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*NOT CHECKED HERE: 1 tests skipped*",
                                 "*test_needs_a_compiler: no C compiler: the loops are not compared"])


def test_under_ci_a_skip_fails_the_run(pytester, monkeypatch):
    result = run(pytester, monkeypatch, True, SKIPPING)
    result.assert_outcomes(passed=1, skipped=1)
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*CI runs everything: this run fails*"])


def test_an_expected_failure_is_not_a_skip(pytester, monkeypatch):
    source = "import pytest\n\n@pytest.mark.xfail(reason='known')\ndef test_known():\n    assert 0\n"
    result = run(pytester, monkeypatch, True, source)
    result.assert_outcomes(xfailed=1)
    assert result.ret == 0 and "NOT CHECKED" not in result.stdout.str()


def test_without_a_skip_nothing_is_said(pytester, monkeypatch):
    result = run(pytester, monkeypatch, True, "def test_runs():\n    pass\n")
    assert result.ret == 0
    assert "NOT CHECKED" not in result.stdout.str()
