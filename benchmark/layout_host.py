"""Host time of one step's attention layout: flat, and with the cascade's prefix level.

    python -m benchmark.layout_host [--groups 30 --members 16 --prefix-pages 125 --own-pages 13]

Decode rows of G groups x M requests, each group sharing its first P pages (a cached prefix) and
each request holding its own pages after them (page size 16), in group order as the scheduler
keeps them. Times `BatchLayout.build` without a cascade policy, with one (`on`), and the two parts
of the prefix level (`find_groups`; `build_prefix_level` over the flat layout). Pure host work:
the same on any machine with or without a GPU. Prints a table and writes
benchmark/results/local/cpu/layout_host.json (the CPU named, the load average before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from array import array
from pathlib import Path
from typing import Any, Callable

from flashserve.attention.base import BatchLayout
from flashserve.attention.cascade import CascadePolicy, build_prefix_level, find_groups
from flashserve.engine.outputs import ScheduledRequest
from flashserve.message.sampling_params import SamplingParams

from benchmark import LOCAL_RESULTS

PAGE = 16


def decode_rows(groups: int, members: int, prefix_pages: int, own_pages: int, seed: int = 0) -> list[ScheduledRequest]:
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=100)
    rows, next_page = [], 0
    for g in range(groups):
        prefix = list(range(next_page, next_page + prefix_pages))
        next_page += prefix_pages
        for m in range(members):
            pages = array("i", prefix + list(range(next_page, next_page + own_pages)))
            next_page += own_pages
            kv_len = (prefix_pages + own_pages - 1) * PAGE + rng.randrange(1, PAGE + 1)
            rows.append(ScheduledRequest(f"r{g}-{m}", [1], kv_len - 1, pages, True, params))
    return rows


def per_call_ms(fn: Callable[[], Any], seconds: float = 1.0) -> float:
    fn()
    calls, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - t0) / calls * 1e3


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=30)
    p.add_argument("--members", type=int, default=16)
    p.add_argument("--prefix-pages", type=int, default=125)
    p.add_argument("--own-pages", type=int, default=13)
    p.add_argument("--out", default=str(LOCAL_RESULTS / "cpu" / "layout_host.json"), help="JSON file (default: %(default)s)")
    args = p.parse_args()
    load_before = os.getloadavg()
    rows = decode_rows(args.groups, args.members, args.prefix_pages, args.own_pages)
    flat = BatchLayout.build(rows, PAGE)
    timings = {
        "flat layout": per_call_ms(lambda: BatchLayout.build(rows, PAGE)),
        "layout with the prefix level": per_call_ms(lambda: BatchLayout.build(rows, PAGE, CascadePolicy())),
        "  find_groups": per_call_ms(lambda: find_groups(rows, PAGE)),
        "  build_prefix_level": per_call_ms(
            lambda: build_prefix_level(rows, PAGE, flat.qo_indptr, flat.kv_indptr, flat.kv_indices)),
    }
    cpu = cpu_name()
    print(f"{cpu}: {len(rows)} decode rows, {args.groups} groups x {args.members}, {args.prefix_pages} shared + "
          f"{args.own_pages} own pages of {PAGE} tokens")
    for name, ms in timings.items():
        print(f"  {name:32s} {ms:7.3f} ms")
    extra = timings["layout with the prefix level"] - timings["flat layout"]
    print(f"  {'the prefix level adds':32s} {extra:7.3f} ms a step")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu, "args": vars(args), "ms": timings, "prefix_level_adds_ms": extra,
                               "load_average": {"before": load_before, "after": os.getloadavg()}}, indent=1) + "\n")


if __name__ == "__main__":
    main()
