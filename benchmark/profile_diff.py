"""Two py-spy profiles side by side (collapsed stacks, `py-spy record --format raw --threads`),
as `structured_bench --profile` writes them: inclusive samples per function in one thread.

    python -m benchmark.profile_diff A.txt B.txt [--thread flashserve-engine] [--top 40]

Each function counts once per stack (inclusive), named `Class.method file.py`. Prints both
counts, their difference, and each as a share of its profile's samples in that thread.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

_LOCATION = re.compile(r" \(([^:()]*)(?::\d+)?\)$")


def frame_name(frame: str) -> str:
    """`Class.method (path/to/file.py:123)` -> `Class.method file.py`."""
    match = _LOCATION.search(frame)
    if match is None:
        return frame
    return f"{frame[: match.start()]} {match.group(1).rsplit('/', 1)[-1]}"


def inclusive(path: Path, thread: str) -> tuple[Counter[str], int]:
    """(samples per function, total samples) over the stacks of threads whose name has `thread`."""
    counts: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        if not n.isdigit() or thread not in frames[0]:
            continue
        total += int(n)
        for name in {frame_name(f) for f in frames[1:]}:
            counts[name] += int(n)
    return counts, total


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--thread", default="flashserve-engine", help="part of the thread's name")
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args(argv)
    a, total_a = inclusive(args.a, args.thread)
    b, total_b = inclusive(args.b, args.thread)
    print(f"{args.thread}: {total_a} samples in {args.a.name}, {total_b} in {args.b.name}")
    print(f"{'A':>7} {'B':>7} {'A-B':>7} {'A %':>6} {'B %':>6}  function")
    for name in sorted(set(a) | set(b), key=lambda k: -max(a[k], b[k]))[: args.top]:
        share_a = 100 * a[name] / max(total_a, 1)
        share_b = 100 * b[name] / max(total_b, 1)
        print(f"{a[name]:7d} {b[name]:7d} {a[name] - b[name]:+7d} {share_a:6.1f} {share_b:6.1f}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
