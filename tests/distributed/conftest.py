"""Every test leaves no process behind: whatever a test started (see disthelp.Tree) and is still
running when it ends, passed or failed, is killed."""
import pytest

import disthelp


@pytest.fixture(autouse=True)
def no_leftover_processes():
    yield
    disthelp.kill_all_trees()
