"""`python -m faulty_server serve ...`: flashserve whose model runner raises, like a CUDA error
would, on a step holding a prompt that starts with FAULT_TOKEN. Only tests start it.

The patch is made at import, not under `__main__`: the engine core is a spawned process, which
imports this module (as `__mp_main__`) before it loads the model."""

from __future__ import annotations

import sys
from typing import Any

from flashserve.__main__ import main
from flashserve.worker.runner import ModelRunner

FAULT_TOKEN = 4242


def _faulty(launch: Any) -> Any:
    def launch_or_fail(self: ModelRunner, out: Any, previous: Any = None) -> Any:
        if any(r.num_computed_tokens == 0 and r.new_token_ids[:1] == [FAULT_TOKEN] for r in out.requests):
            raise RuntimeError("injected device fault")
        return launch(self, out, previous)

    return launch_or_fail


ModelRunner.launch = _faulty(ModelRunner.launch)  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main())
