"""The engine core's messages through pickle and through the codec's msgspec MessagePack: encode +
decode time and size of one step's outputs for N streams, and of a new request.

    python -m benchmark.codec_bench [--streams 5,100,256] [--out FILE]

A step's outputs are what the engine core sends every step, so their cost bounds how many streams
a step can carry; a new request crosses once.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import time
from pathlib import Path
from typing import Any, Callable

from benchmark import LOCAL_RESULTS
from flashserve.message.codec import AddRequest, StepOutputs, decode, encode
from flashserve.message.outputs import RequestOutput, TokenLogprob
from flashserve.message.requests import Add
from flashserve.message.sampling_params import SamplingParams


def step_outputs(streams: int, logprobs: bool) -> StepOutputs:
    outs = []
    for i in range(streams):
        lps = [TokenLogprob(1000 + i, -0.5, tuple((j, -1.0 - j) for j in range(5)))] if logprobs else None
        outs.append(RequestOutput(f"cmpl-{i:032x}-0", [1000 + i], "", False, None, 24, 100 + i,
                                  arrival_time=123.456, num_cached_tokens=16, logprobs=lps))
    return StepOutputs(outs, num_waiting=3)


def add_requests(count: int, prompt_len: int) -> list[AddRequest]:
    params = SamplingParams(max_tokens=256, temperature=0.7, top_p=0.9, stop=("\n\n",), eos_token_ids=(2,))
    return [AddRequest(Add(f"cmpl-{i:032x}-0", list(range(prompt_len)), params, group=f"cmpl-{i:032x}"))
            for i in range(count)]


def timed(fn: Callable[[], Any], repeats: int) -> float:
    """CPU microseconds per call (process time: the machine is shared), best of 5 rounds."""
    best = float("inf")
    for _ in range(5):
        t0 = time.process_time()
        for _ in range(repeats):
            fn()
        best = min(best, (time.process_time() - t0) / repeats)
    return best * 1e6


def measure(message: Any, repeats: int) -> dict[str, dict[str, float]]:
    """pickle, as the messages were first sent, against the codec's msgspec MessagePack."""
    pickled = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    packed = encode(message)
    assert pickle.loads(pickled) == message and decode(packed) == message
    return {
        "pickle": {"encode_us": timed(lambda: pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), repeats),
                   "decode_us": timed(lambda: pickle.loads(pickled), repeats), "bytes": len(pickled)},
        "msgspec": {"encode_us": timed(lambda: encode(message), repeats),
                    "decode_us": timed(lambda: decode(packed), repeats), "bytes": len(packed)},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", default="5,100,256")
    p.add_argument("--out", default=str(LOCAL_RESULTS / "cpu" / "codec.json"), help="results file (default: %(default)s)")
    args = p.parse_args(argv)
    rows = []
    cases: list[tuple[str, Any]] = []
    for n in map(int, args.streams.split(",")):
        cases += [(f"step outputs, {n} streams", step_outputs(n, False)),
                  (f"step outputs, {n} streams, logprobs 5", step_outputs(n, True))]
    cases.append(("new request, 1,024-token prompt", add_requests(1, 1024)[0]))
    for name, message in cases:
        result = measure(message, 200)
        rows.append({"message": name, **result})
        print(f"{name:42s} " + "  ".join(
            f"{codec} {r['encode_us']:7.1f} + {r['decode_us']:7.1f} us, {r['bytes']:6d} B" for codec, r in result.items()))
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                                "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
