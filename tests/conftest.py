import os

import pytest

# A skipped test names what it did not check, and fails the run under CI (tests/loud_skips.py).
from tests.loud_skips import (  # noqa: F401
    pytest_runtest_logreport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: a long run (minutes): left out of `make test`, run by `make test-slow` "
                   "and by CI (.ci/run runs both)")


@pytest.fixture(scope="session")
def gloo_run(tmp_path_factory):
    """tests/workers/torch_train.py on 2 Gloo workers, every scenario: one run for the session."""
    from tests.launch import ROOT, horovodrun

    out = tmp_path_factory.mktemp("gloo")
    horovodrun(os.path.join(ROOT, "tests", "workers", "torch_train.py"), str(out))
    return out


@pytest.fixture(scope="session")
def tf_run(tmp_path_factory):
    """tests/workers/tf_train.py on 2 Gloo workers, every scenario: one run for the session."""
    from tests.launch import ROOT, horovodrun

    out = tmp_path_factory.mktemp("tf")
    horovodrun(os.path.join(ROOT, "tests", "workers", "tf_train.py"), str(out))
    return out
