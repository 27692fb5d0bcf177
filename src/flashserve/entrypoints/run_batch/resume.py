"""What run-batch checks in its files before a run: custom_ids that repeat in the input (refused,
as OpenAI's Batch API refuses them), and the results an earlier, interrupted run left in the output
(kept: a run resumes them, and runs only the lines without one).

A result counts as done unless the server failed to answer it (a 5xx status, or no response from
the app at all): those lines run again. A last line cut off mid-write is dropped.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

from flashserve.entrypoints.run_batch.lines import BatchRequest, LineError

# Error codes of lines that failed on the server's side: run again on resume.
_RETRIED_ERRORS = frozenset({"internal_error"})


def duplicate_ids(items: Sequence[BatchRequest | LineError]) -> str | None:
    """A message naming each custom_id that more than one line holds, with its line numbers; None
    if every custom_id is unique."""
    lines: dict[str, list[int]] = defaultdict(list)
    for item in items:
        if item.custom_id is not None:
            lines[item.custom_id].append(item.line_no)
    repeated = [(cid, nos) for cid, nos in lines.items() if len(nos) > 1]
    if not repeated:
        return None
    shown = "; ".join(f"{json.dumps(cid, ensure_ascii=False)} on lines {', '.join(map(str, nos))}"
                      for cid, nos in repeated[:10])
    more = f"; and {len(repeated) - 10} more" if len(repeated) > 10 else ""
    return f"custom_id must be unique within a batch: {shown}{more}"


@dataclass
class Resume:
    """What the output file already holds once `prepare_output` is done with it."""

    done: set[str] = field(default_factory=set)  # custom_ids with a result
    num_anonymous_errors: int = 0  # error lines without a custom_id (lines that were no request)

    @property
    def num_done(self) -> int:
        return len(self.done) + self.num_anonymous_errors


def _is_done(line: dict) -> bool:
    response, error = line.get("response"), line.get("error")
    if isinstance(response, dict):
        status = response.get("status_code")
        return isinstance(status, int) and status < 500
    return isinstance(error, dict) and error.get("code") not in _RETRIED_ERRORS


def prepare_output(path: str, overwrite: bool) -> Resume:
    """Empties the output file (`overwrite`, or none there yet), or keeps the results it holds and
    drops the rest (server failures, a line cut off mid-write), rewriting it if that drops any.
    Raises OSError if it cannot be read or written."""
    if overwrite or not os.path.exists(path):
        open(path, "w", encoding="utf-8").close()
        return Resume()
    resume = Resume()
    kept: list[str] = []
    dropped = False
    with open(path, encoding="utf-8", errors="replace") as f:
        for text in f:
            try:
                line = json.loads(text) if text.endswith("\n") else None
            except ValueError:
                line = None
            if not isinstance(line, dict) or not _is_done(line):
                dropped = True
                continue
            kept.append(text)
            custom_id = line.get("custom_id")
            if isinstance(custom_id, str):
                resume.done.add(custom_id)
            else:
                resume.num_anonymous_errors += 1
    if dropped:
        temporary = f"{path}.resume"
        with open(temporary, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(temporary, path)
    else:
        open(path, "a", encoding="utf-8").close()  # writable: fail now, not after loading the model
    return resume


def remaining(items: Sequence[BatchRequest | LineError], resume: Resume) -> list[BatchRequest | LineError]:
    """The lines that still need a result line: those whose custom_id has none; of the lines
    without a custom_id (error lines), those past the ones already written."""
    out: list[BatchRequest | LineError] = []
    anonymous = resume.num_anonymous_errors
    for item in items:
        if item.custom_id is None:
            if anonymous > 0:
                anonymous -= 1
                continue
        elif item.custom_id in resume.done:
            continue
        out.append(item)
    return out
