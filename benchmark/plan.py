"""What a suite run measures, at which sizes and under which time caps (presets and overrides).

`default` fits one GPU machine's 10 minutes, FlashInfer kernel builds (~3 min) included, by running
some workloads at reduced sizes; `cuts()` lists every difference from PERFORMANCE.md's workloads,
and the suite writes that list into its JSON. `full` runs the workloads at their own sizes (about
half an hour). `smoke` runs every phase on a CPU with a tiny model in a few minutes (each server start is a supervisor, an engine core and a front end).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

PHASES = ("floor", "serve-small", "offline", "peers", "serve-large")
SERVE_WORKLOADS = ("latency", "concurrency", "random", "goodput")


@dataclass(frozen=True)
class Plan:
    phases: tuple[str, ...] = PHASES  # run order
    budget_s: float = 540.0  # the whole suite; later phases are cut (skipped) when it runs out
    small_model: str = "llama-3.2-1b"
    large_model: str = "llama-3.1-8b"
    offline_model: str = "llama-3.2-1b"  # offline and peers
    device: str = "auto"
    client_workers: int = 4  # benchmark client processes, for all workloads but latency
    small_workloads: tuple[str, ...] = ("concurrency", "latency", "goodput", "random")
    large_workloads: tuple[str, ...] = ("latency", "goodput")
    latency_repeats: int = 5
    concurrency: tuple[int, ...] = (5, 10, 25, 50, 100)
    concurrency_repeats: int = 2
    random_rates: tuple[float, ...] = (16.0,)
    random_requests: int = 128
    goodput_requests: int = 128  # per probe
    goodput_large_requests: int = 64
    goodput_start: float = 8.0  # req/s
    goodput_step: float = 4.0
    goodput_max: float = 64.0
    goodput_large_step: float = 2.0
    goodput_large_max: float = 32.0
    goodput_slo_ms: float = 200.0  # P99 TTFT
    offline_requests: int = 256
    offline_phases: tuple[str, ...] = ()  # () = both
    peer_requests: int = 128
    peer_batch: int = 32
    peer_latency_repeats: int = 3
    # Seconds per step; each is also cut to the budget left.
    caps: dict[str, float] = field(default_factory=lambda: {
        "floor": 60, "start": 300, "latency": 45, "concurrency": 90, "random": 45, "goodput": 90,
        "offline": 150, "hf-generate": 100, "hf-continuous-batching": 150})

    def cuts(self) -> list[str]:
        """Every way this plan differs from the workloads of PERFORMANCE.md."""
        from benchmark.offline import shape_name

        large, small = shape_name(self.large_model), shape_name(self.small_model)
        out = []
        if self.goodput_slo_ms != 200.0:
            out.append(f"goodput: P99 TTFT SLO {self.goodput_slo_ms:g} ms (workload: 200 ms)")
        if self.concurrency_repeats != 3:
            out.append(f"concurrency: {self.concurrency_repeats} requests per stream (benchmark default 3)")
        if self.random_requests != 256:
            out.append(f"random: {self.random_requests} requests per rate (workload: 256)")
        if self.goodput_requests != 256 or self.goodput_large_requests != 256:
            out.append(f"goodput: {self.goodput_requests} ({large}: {self.goodput_large_requests}) "
                       "requests per probe (workload: 256)")
        out.append(f"goodput search: from {self.goodput_start:g} req/s, step {self.goodput_step:g} up to "
                   f"{self.goodput_max:g} ({large}: step {self.goodput_large_step:g} up to "
                   f"{self.goodput_large_max:g}); a probe that passes the maximum ends the search")
        if self.offline_requests != 256 or self.offline_phases:
            out.append(f"offline: {self.offline_requests} requests, phases {','.join(self.offline_phases) or 'both'}")
        if self.peer_requests != 256:
            out.append(f"peers: the first {self.peer_requests} of the 256 offline requests")
        out.append("peers: fixed512x128 phase only (hf-generate: for time; generate_batch takes one max_new_tokens)")
        for name, model, wl in (("large", large, self.large_workloads), ("small", small, self.small_workloads)):
            missing = [w for w in SERVE_WORKLOADS if w not in wl]
            if missing and f"serve-{name}" in self.phases:
                out.append(f"{model}: serve workloads {', '.join(missing)} not run")
        out += [f"phase {p} not run" for p in PHASES if p not in self.phases]
        return out


FULL = Plan(budget_s=3600.0, large_workloads=SERVE_WORKLOADS, concurrency_repeats=3,
            random_rates=(2.0, 4.0, 8.0, 16.0), random_requests=256, goodput_requests=256,
            goodput_large_requests=256, goodput_start=2.0, goodput_step=0.5, goodput_large_step=0.5,
            goodput_max=512.0, goodput_large_max=512.0, peer_requests=256,
            caps={"floor": 60, "start": 600, "latency": 120, "concurrency": 600, "random": 900, "goodput": 1200,
                  "offline": 600, "hf-generate": 600, "hf-continuous-batching": 900})
SMOKE = Plan(phases=("floor", "serve-small", "offline", "peers"), budget_s=210.0, device="cpu", client_workers=1,
             small_workloads=("latency", "concurrency", "goodput"), latency_repeats=1, concurrency=(2, 4),
             concurrency_repeats=1, random_rates=(20.0,), random_requests=4, goodput_requests=4,
             goodput_large_requests=4, goodput_start=40.0, goodput_step=20.0, goodput_max=40.0,
             goodput_large_step=20.0, goodput_large_max=40.0, goodput_slo_ms=10_000.0, offline_requests=4,
             offline_phases=("fixed512x128",), peer_requests=4, peer_batch=2, peer_latency_repeats=1,
             caps={"floor": 30, "start": 60, "latency": 40, "concurrency": 40, "random": 30, "goodput": 40,
                   "offline": 40, "hf-generate": 90, "hf-continuous-batching": 40})
PRESETS = {"default": Plan(), "full": FULL, "smoke": SMOKE}


def _parse(kind: Any, text: str) -> Any:
    if kind in (int, float, str):
        return kind(text)
    items = [x for x in text.split(",") if x]
    if kind == "tuple[int, ...]":
        return tuple(int(x) for x in items)
    if kind == "tuple[float, ...]":
        return tuple(float(x) for x in items)
    return tuple(items)


def with_overrides(plan: Plan, settings: list[str]) -> Plan:
    """`key=value` overrides (`concurrency=5,100`, `caps.goodput=120`); lists are comma-separated."""
    kinds = {f.name: f.type for f in fields(Plan)}
    kinds = {k: {"int": int, "float": float, "str": str}.get(v, v) for k, v in kinds.items()}
    changes: dict[str, Any] = {}
    caps = dict(plan.caps)
    for item in settings:
        key, _, value = item.partition("=")
        if key.startswith("caps."):
            caps[key[5:]] = float(value)
        elif key in kinds and key != "caps":
            changes[key] = _parse(kinds[key], value)
        else:
            raise ValueError(f"unknown plan setting {key!r}; one of {', '.join(kinds)} or caps.<step>")
    return replace(plan, caps=caps, **changes)
