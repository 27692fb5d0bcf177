"""benchmark.ab_pairs: paired A/B runs of SGLang's client read back and their differences averaged."""

from __future__ import annotations

import json
from pathlib import Path

from benchmark.ab_pairs import pairs, table


def write(folder: Path, name: str, median_ttft: float) -> None:
    record = {"request_rate": 24.0, "median_ttft_ms": median_ttft, "mean_ttft_ms": 1.0, "p99_ttft_ms": 2.0,
              "median_itl_ms": 3.0, "mean_itl_ms": 4.0, "p99_itl_ms": 5.0}
    (folder / f"sgl_{name}.jsonl").write_text(json.dumps(record) + "\n")


def test_each_pair_shows_both_sides_and_the_mean_difference_over_the_pairs(tmp_path: Path) -> None:
    write(tmp_path, "8b-r1-late", 60.0)
    write(tmp_path, "8b-r1-nolate", 64.0)
    write(tmp_path, "8b-r2-late", 62.0)
    write(tmp_path, "8b-r2-nolate", 64.0)
    write(tmp_path, "8b-r3-late", 50.0)  # no partner: left out
    found = pairs(tmp_path, "late", "nolate")
    assert [name for name, _, _ in found] == ["8b-r1", "8b-r2"]
    lines = table(found, "late", "nolate").splitlines()
    assert "60.00 / 64.00" in lines[2] and "62.00 / 64.00" in lines[3]
    assert lines[-1].startswith("| late - nolate: mean (range) over 2 | | -3.00 (-4.00 to -2.00) |")
