"""The whole benchmark suite in one command: floor, servers, offline, peers, summary, plots, targets.

    python -m benchmark.suite OUT [--preset default|full|smoke] [--phases floor,serve-small,...]
                                  [--set goodput_requests=256 --set caps.goodput=120 ...]

Phases run in `--phases` order, each step as a subprocess under a time cap (cut to the budget left;
a step with too little left is skipped): `floor` (benchmark.floor, then the floor of each workload
as result files labelled `floor`); `serve-small` / `serve-large` (`flashserve serve --load-format
dummy` in a subprocess, /health, warm-up requests, then benchmark.serve_bench per workload, then
stopped); `offline` (benchmark.offline); `peers` (benchmark.peers: hf-generate, then
hf-continuous-batching). A step that fails or times out is recorded and the suite goes on.

Writes under OUT: `<gpu>/*.json` (one result per run, workloads named `<workload>@<model shape>`),
`summary.json` (benchmark.metrics), `plots/*.png`, `logs/*.log`, `rates.json` and `suite.json`
(plan, cuts, steps with status and seconds, targets). Prints the targets table. Exit status 1 when a
step failed or timed out (skipped steps do not count).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from benchmark.offline import shape_name
from benchmark.plan import PHASES, PRESETS, Plan, with_overrides
from benchmark.server_process import free_port, stop, wait_ready

REPO = Path(__file__).resolve().parent.parent
RESERVE_S = 15.0  # kept back from every step for the summary, plots and table
MIN_STEP_S = 10.0  # a step with less than this left is skipped
TINY_CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 10240,
               "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
               "tie_word_embeddings": True, "rope_theta": 10000.0}


def model_config(model: str) -> dict[str, Any]:
    """config.json contents of a built-in dummy shape or a config.json path."""
    from flashserve.model_loader.loader import DUMMY_SHAPES

    return dict(DUMMY_SHAPES[model]) if model in DUMMY_SHAPES else json.loads(Path(model).read_text())


class Suite:
    def __init__(self, out: Path, plan: Plan, gpu_name: str | None, serve_args: list[str]) -> None:
        self.out, self.plan, self.serve_args = out, plan, serve_args
        self.t0 = time.monotonic()
        self.gpu = gpu_name
        self.asked_nvidia_smi = plan.device == "cpu"
        self.rates_path: Path | None = None  # set once this run measured them
        self.steps: list[dict[str, Any]] = []
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(REPO / "src"), str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        (out / "logs").mkdir(parents=True, exist_ok=True)

    @property
    def gpu_name(self) -> str:
        """The measured device's name; before (or without) the floor step, nvidia-smi's, else cpu."""
        if self.gpu is None and not self.asked_nvidia_smi:
            self.asked_nvidia_smi = True
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                     capture_output=True, text=True, timeout=20)
                self.gpu = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
            except (OSError, subprocess.SubprocessError):
                pass
        return self.gpu or "cpu"

    @property
    def gpu_dir(self) -> Path:
        from benchmark.serve_bench import slug

        return self.out / slug(self.gpu_name)

    def begin(self, name: str, want_s: float) -> float | None:
        """The cap of a step about to start, or None (recorded as skipped) when the budget is spent."""
        left = self.plan.budget_s - (time.monotonic() - self.t0) - RESERVE_S
        cap = min(want_s, left)
        if cap < MIN_STEP_S:
            self.steps.append({"step": name, "status": "skipped", "seconds": 0.0, "cap_s": 0.0,
                               "detail": f"budget: {max(left, 0):.0f} s left"})
            print(f"== {name}: skipped ({max(left, 0):.0f} s of the budget left)", flush=True)
            return None
        print(f"== {name} (cap {cap:.0f} s, {time.monotonic() - self.t0:.0f} s into the suite)", flush=True)
        return cap

    def record(self, name: str, status: str, started: float, cap: float, detail: str = "") -> bool:
        secs = time.monotonic() - started
        self.steps.append({"step": name, "status": status, "seconds": round(secs, 1), "cap_s": round(cap, 1),
                           "detail": detail})
        print(f"== {name}: {status} in {secs:.0f} s {detail}", flush=True)
        return status == "ok"

    def command(self, name: str, args: list[str], want_s: float) -> bool:
        """Run `python -m <args>` as one step; its output goes to logs/<name>.log (tail echoed)."""
        cap = self.begin(name, want_s)
        if cap is None:
            return False
        started, log_path = time.monotonic(), self.out / "logs" / f"{name.replace(':', '-')}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, env=self.env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=cap)
                status, detail = ("ok" if rc == 0 else "failed"), f"rc={rc}"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the step and its children only
                proc.wait()
                status, detail = "timeout", f"killed after {cap:.0f} s"
        tail = log_path.read_text(errors="replace").splitlines()[-30:]
        print("\n".join("   " + line for line in tail), flush=True)
        return self.record(name, status, started, cap, detail)

    def floor(self) -> None:
        rates_path = self.out / "rates.json"
        if not self.command("floor", ["benchmark.floor", "--device", self.plan.device, "--out", str(rates_path)],
                            self.plan.caps["floor"]):
            return
        from benchmark.floor import load_rates

        rates = load_rates(rates_path)
        self.rates_path = rates_path
        self.gpu = self.gpu or rates.device
        write_floor_docs(self.plan, rates, self.gpu, self.gpu_dir)

    def serve(self, which: str) -> None:
        model = getattr(self.plan, f"{which}_model")
        workloads = getattr(self.plan, f"{which}_workloads")
        shape, name = shape_name(model), f"serve-{which}"
        cap = self.begin(f"{name}:start", self.plan.caps["start"])
        if cap is None:
            return
        started, port = time.monotonic(), free_port()
        cmd = [sys.executable, "-m", "flashserve", "serve", "--load-format", "dummy", "--model", model,
               "--port", str(port), "--device", self.plan.device, "--log-level", "warning", "--shutdown-timeout", "2",
               *self.serve_args]
        with open(self.out / "logs" / f"{name}-{shape}.log", "w") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                base = f"http://127.0.0.1:{port}"
                error = wait_ready(proc, base, started + cap, model_config(model)["vocab_size"])
                if not self.record(f"{name}:start", "failed" if error else "ok", started, cap, error or ""):
                    self.steps += [{"step": f"{name}:{wl}", "status": "skipped", "seconds": 0.0, "cap_s": 0.0,
                                    "detail": "server not ready"} for wl in workloads]
                    return
                for wl in workloads:
                    self.command(f"{name}:{wl}", serve_bench_args(self.plan, which, wl, base, shape, self.gpu_name,
                                                                  self.gpu_dir), self.plan.caps[wl])
            finally:
                stop(proc)

    def offline(self) -> None:
        p = self.plan
        common = ["--model", p.offline_model, "--device", p.device, "--gpu-name", self.gpu_name,
                  "--out-dir", str(self.gpu_dir)]
        rates = ["--rates", str(self.rates_path)] if self.rates_path else []
        phases = ["--phases", ",".join(p.offline_phases)] if p.offline_phases else []
        self.command("offline", ["benchmark.offline", *common, *rates, *phases,
                                 "--num-requests", str(p.offline_requests)], p.caps["offline"])

    def peers(self) -> None:
        p = self.plan
        common = ["--model", p.offline_model, "--device", p.device, "--gpu-name", self.gpu_name,
                  "--out-dir", str(self.gpu_dir), "--num-requests", str(p.peer_requests)]
        self.command("hf-generate", ["benchmark.peers", "--system", "hf-generate", *common, "--batch-size",
                                     str(p.peer_batch), "--latency-repeats", str(p.peer_latency_repeats)],
                     p.caps["hf-generate"])
        self.command("hf-continuous-batching", ["benchmark.peers", "--system", "hf-continuous-batching", *common],
                     p.caps["hf-continuous-batching"])

    def run(self) -> int:
        for phase in self.plan.phases:
            {"floor": self.floor, "serve-small": lambda: self.serve("small"), "offline": self.offline,
             "peers": self.peers, "serve-large": lambda: self.serve("large")}[phase]()
        from benchmark.report import evaluate_targets, format_targets

        summary = finish(self.out, self.gpu_dir, self.gpu_name, self.plan)
        p = self.plan
        rows = evaluate_targets(summary, self.gpu_name, shape_name(p.large_model), shape_name(p.small_model),
                                shape_name(p.offline_model), p.goodput_slo_ms)
        elapsed = time.monotonic() - self.t0
        doc = {"gpu": self.gpu_name, "elapsed_s": round(elapsed, 1), "plan": asdict(p), "cuts": p.cuts(),
               "steps": self.steps, "targets": rows}
        (self.out / "suite.json").write_text(json.dumps(doc, indent=2) + "\n")
        print()
        for st in self.steps:
            print(f"{st['step']:<34}{st['status']:<9}{st['seconds']:>6.0f} s  {st['detail']}")
        print(f"\nsuite: {elapsed:.0f} s of {p.budget_s:.0f}; cut from PERFORMANCE.md's workloads:")
        print("\n".join("  - " + c for c in p.cuts()))
        print("\n" + format_targets(rows, self.gpu_name), flush=True)
        return 1 if any(s["status"] in ("failed", "timeout") for s in self.steps) else 0


def serve_bench_args(plan: Plan, which: str, workload: str, base: str, shape: str, gpu: str, out_dir: Path) -> list[str]:
    """benchmark.serve_bench's command line for one workload of the plan (token-id prompts: dummy
    weights have no tokenizer; several client processes where many streams are in flight)."""
    args = ["benchmark.serve_bench", "--base-url", base, "--workload", workload, "--workload-name",
            f"{workload}@{shape}", "--token-ids", "--empty-text-chunks", "--label", "flashserve", "--gpu-name", gpu,
            "--out-dir", str(out_dir), "--no-summary", "--no-progress"]
    if workload != "latency":
        args += ["--workers", str(plan.client_workers)]
    large = which == "large"
    if workload == "latency":
        args += ["--repeats", str(plan.latency_repeats)]
    elif workload == "concurrency":
        args += ["--concurrency", ",".join(map(str, plan.concurrency)), "--repeats", str(plan.concurrency_repeats)]
    elif workload == "random":
        args += ["--request-rate", ",".join(f"{r:g}" for r in plan.random_rates), "--num-requests",
                 str(plan.random_requests)]
    elif workload == "goodput":
        args += ["--num-requests", str(plan.goodput_large_requests if large else plan.goodput_requests),
                 "--goodput-start-rate", f"{plan.goodput_start:g}", "--goodput-step",
                 f"{plan.goodput_large_step if large else plan.goodput_step:g}",
                 "--goodput-max-rate", f"{plan.goodput_large_max if large else plan.goodput_max:g}",
                 "--ttft-slo-ms", f"{plan.goodput_slo_ms:g}"]
    return args


def write_floor_docs(plan: Plan, rates: Any, gpu: str, out_dir: Path) -> None:
    """Result files labelled `floor` for every workload the plan can run, under the same names."""
    from datetime import datetime, timezone

    from benchmark import floor as fl
    from benchmark import workloads as w
    from benchmark.serve_bench import git_commit, write_result

    spec = w.PromptSpec()
    docs = {"device": {"copy_GB_per_s": rates.copy_bytes_per_s / 1e9,
                       "matmul_TFLOP_per_s": rates.matmul_flop_per_s / 1e12}}
    offline = [ph for ph in w.offline_phases(spec, 0, plan.offline_requests)
               if not plan.offline_phases or ph.name in plan.offline_phases]
    for model in {plan.small_model, plan.large_model, plan.offline_model}:
        shape = fl.ModelShape.from_config(model_config(model), dtype_bytes=4 if rates.device == "cpu" else 2)
        name = shape_name(model)
        docs[f"latency@{name}"] = fl.latency_floor_headline(shape, rates, w.latency_phases(spec))
        docs[f"goodput@{name}"] = fl.goodput_floor_headline(shape, rates)
        levels = w.concurrency_phases(spec, levels=plan.concurrency, repeats=1)
        docs[f"concurrency@{name}"] = fl.concurrency_floor_headline(shape, rates, levels)
        head = fl.offline_floor_headline(shape, rates, offline)
        # The whole-workload figures only when the run has both phases, as benchmark.offline does.
        docs[f"offline@{name}"] = {k: v for k, v in head.items() if len(offline) == 2 or not k.startswith("workload_")}
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    for workload, head in docs.items():
        write_result({"schema": 1, "workload": workload, "label": "floor", "gpu": gpu, "git_commit": git_commit(),
                      "timestamp": stamp, "rates": rates.to_json(), "phases": [], "goodput": None,
                      "headline": head}, out_dir)


def finish(out: Path, gpu_dir: Path, gpu: str, plan: Plan) -> dict[str, Any]:
    """summary.json and the plots: per model shape, concurrency and request-rate plots; headline bars."""
    from benchmark import plots
    from benchmark.metrics import merge_summary
    from benchmark.report import plot_headlines

    if not gpu_dir.exists():
        return {}
    summary = json.loads(merge_summary(gpu_dir, out / "summary.json").read_text())
    try:
        docs = plots.load_results([gpu_dir])
        for model in {plan.small_model, plan.large_model}:
            shape = shape_name(model)
            mine = [{**d, "workload": d["workload"].split("@")[0]} for d in docs if d["workload"].endswith(f"@{shape}")]
            plots.plot_concurrency(mine, out / "plots" / f"concurrency-{shape}.png")
            plots.plot_request_rate(mine, out / "plots" / f"request_rate-{shape}.png")
        plot_headlines(summary, gpu, out / "plots" / "headlines.png")
    except Exception as exc:  # noqa: BLE001 - the numbers matter more than the pictures
        print(f"plots failed: {type(exc).__name__}: {exc}", flush=True)
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.suite", description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="output folder")
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    p.add_argument("--smoke", action="store_true", help="--preset smoke: CPU, tiny model, a few minutes")
    p.add_argument("--phases", help=f"comma-separated, in run order, from {','.join(PHASES)}")
    p.add_argument("--budget-s", type=float, help="seconds for the whole suite")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="plan override (benchmark/plan.py), e.g. goodput_requests=256, caps.goodput=120")
    p.add_argument("--gpu-name", help="default: the device the floor step measured")
    p.add_argument("--serve-args", default="", help="extra flags for flashserve serve, with '=': --serve-args='--max-num-seqs 128'")
    args = p.parse_args(argv)
    plan = PRESETS["smoke" if args.smoke else args.preset]
    settings = list(args.set) + ([f"phases={args.phases}"] if args.phases else []) + (
        [f"budget_s={args.budget_s}"] if args.budget_s else [])
    plan = with_overrides(plan, settings)
    if unknown := set(plan.phases) - set(PHASES):
        p.error(f"unknown phases {sorted(unknown)}")
    if args.smoke:
        config = args.out / "models" / "tiny-llama" / "config.json"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(json.dumps(TINY_CONFIG))
        plan = with_overrides(plan, [f"{k}_model={config}" for k in ("small", "large", "offline")])
    return Suite(args.out, plan, args.gpu_name, args.serve_args.split()).run()


if __name__ == "__main__":
    sys.exit(main())
