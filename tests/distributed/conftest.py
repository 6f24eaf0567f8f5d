"""Every test leaves no process behind: whatever a test started (see disthelp.Tree) and is still
running when it ends, passed or failed, is killed. The test gate's helper (tests/gate/gate.py) is
imported from the source tree."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gate"))

import disthelp  # noqa: E402  (needs the gate helper on the path)


@pytest.fixture(autouse=True)
def no_leftover_processes():
    yield
    disthelp.kill_all_trees()


@pytest.fixture(scope="session", autouse=True)
def temporaries():
    yield
    disthelp.remove_temporaries()
