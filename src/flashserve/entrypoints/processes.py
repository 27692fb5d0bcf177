"""What every child process of `flashserve serve` does first: name itself, follow its parent."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15

# Names as `ps -o comm` and /proc/<pid>/comm show them (at most 15 characters).
ENGINE_CORE_NAME = "flashserve-core"
DP_ENGINE_CORE_NAME = "flashserve-dp{}"  # engine core i of --data-parallel-size > 1 (15 characters at most)
FRONTEND_NAME = "flashserve-api{}"


def become_child(name: str, log_level: str) -> None:
    """Names the process, asks Linux to send it SIGTERM when its parent (the supervisor) dies,
    so that nothing outlives a supervisor killed with SIGKILL, and leaves the supervisor's process
    group, so that a Ctrl+C at the terminal reaches the supervisor only, which then stops the
    children in order."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl: the pipe's EOF still ends the process
            pass
