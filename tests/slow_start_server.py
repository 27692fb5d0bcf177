"""`python -m slow_start_server serve ...`: flashserve whose engine core starts loading the model
only once the file named by FLASHSERVE_TEST_LOAD_GATE exists, so that a test sees the server while
it starts. Only tests start it.

The patch is made at import, not under `__main__`: the engine core is a spawned process, which
imports this module (as `__mp_main__`) before it loads the model. It is made only where the
variable is set, so that a test process importing GATE_ENV from here loads models as usual."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import flashserve.entrypoints.stack as stack
from flashserve.__main__ import main

GATE_ENV = "FLASHSERVE_TEST_LOAD_GATE"


def _gated(load_engine: Any) -> Any:
    def load_when_open(*args: Any, **kwargs: Any) -> Any:
        while not os.path.exists(os.environ[GATE_ENV]):
            time.sleep(0.05)
        return load_engine(*args, **kwargs)

    return load_when_open


if GATE_ENV in os.environ:
    stack.load_engine = _gated(stack.load_engine)  # type: ignore[assignment]

if __name__ == "__main__":
    sys.exit(main())
