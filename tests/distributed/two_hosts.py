"""Runs test_two_hosts.py where this machine can make network namespaces (root, `ip netns`), and reports
SKIPPED to ctest (exit 77) with the reason where it cannot: such a run is not a pass."""

import os
import shutil
import subprocess
import sys


def unavailable():
    if os.geteuid() != 0:
        return "not root: network namespaces need CAP_SYS_ADMIN"
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            return f"no `{tool}` on PATH (Debian's iproute2)"
    probe = f"lp-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


if __name__ == "__main__":
    why = unavailable()
    if why:
        print(f"SKIPPED: two hosts on one machine need network namespaces: {why}")
        sys.exit(77)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.exit(
        subprocess.call(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.join(here, "test_two_hosts.py")]
        )
    )
