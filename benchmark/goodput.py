"""Goodput: the highest request rate whose P99 TTFT stays within an SLO.

The search doubles the rate from `start_rate` until a probe misses the SLO, then bisects the last
passing / first failing pair until they are at most `step` req/s apart. It assumes that P99 TTFT
grows with the rate; the answer is the highest passing rate probed, within `step` of the boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

Measure = Callable[[float], Awaitable[dict[str, Any]]]


@dataclass
class Probe:
    rate: float  # req/s
    passed: bool
    metrics: dict[str, Any]  # benchmark.metrics.summarize output at that rate


@dataclass
class GoodputResult:
    slo_ms: float
    step: float
    rate: float  # req/s; 0 when no probed rate met the SLO
    metrics: dict[str, Any] | None  # at `rate`
    probes: list[Probe] = field(default_factory=list)
    hit_max_rate: bool = False

    def to_json(self) -> dict[str, Any]:
        m = self.metrics or {}
        return {
            "slo_ms": self.slo_ms,
            "step": self.step,
            "rate": self.rate,
            "hit_max_rate": self.hit_max_rate,
            "median_ttft_ms": (m.get("ttft_ms") or {}).get("median"),
            "median_itl_ms": (m.get("itl_ms") or {}).get("median"),
            "p99_ttft_ms": (m.get("ttft_ms") or {}).get("p99"),
            "probes": [{"rate": p.rate, "passed": p.passed, "metrics": p.metrics} for p in self.probes],
        }


def meets_slo(metrics: dict[str, Any], slo_ms: float) -> bool:
    """Every request completed and P99 TTFT (ms) is within the SLO."""
    p99 = (metrics.get("ttft_ms") or {}).get("p99")
    return metrics.get("failed", 0) == 0 and metrics.get("completed", 0) > 0 and p99 is not None and p99 <= slo_ms


async def search_goodput(
    measure: Measure,
    slo_ms: float,
    *,
    start_rate: float = 2.0,
    step: float = 0.5,
    max_rate: float = 512.0,
) -> GoodputResult:
    """Search rates (req/s) with `measure(rate) -> metrics`; see the module docstring."""
    if start_rate <= 0 or step <= 0:
        raise ValueError("start_rate and step must be positive")
    result = GoodputResult(slo_ms=slo_ms, step=step, rate=0.0, metrics=None)

    async def probe(rate: float) -> bool:
        metrics = await measure(rate)
        passed = meets_slo(metrics, slo_ms)
        result.probes.append(Probe(rate, passed, metrics))
        if passed and rate > result.rate:
            result.rate, result.metrics = rate, metrics
        return passed

    lo, hi, rate = 0.0, None, start_rate
    while hi is None:
        if await probe(rate):
            lo = rate
            if rate >= max_rate:
                result.hit_max_rate = True
                return result
            rate = min(rate * 2, max_rate)
        else:
            hi = rate
    while hi - lo > step:
        mid = (lo + hi) / 2
        if await probe(mid):
            lo = mid
        else:
            hi = mid
    return result
