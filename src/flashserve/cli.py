"""Command-line options. Every flag is also an environment variable FLASHSERVE_<FLAG>. What they
become (`ServeArgs`, `BatchArgs`) is `serve_args.py`."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from flashserve.attention.cascade import CASCADE_MODES
from flashserve.config import MAX_PIECEWISE_GRAPH_TOKENS, TP_OVERLAP_COMMS, KVEventsConfig
from flashserve.spec_decode.config import SpeculativeConfig


@dataclass(frozen=True)
class Option:
    flag: str  # "--max-num-seqs"
    type: Callable[[str], Any] | None
    default: Any
    help: str
    choices: Sequence[str] | None = None
    multiple: bool = False  # several values: space-separated on the command line, comma-separated in env
    # Other environment variables read when FLASHSERVE_<FLAG> is not set (vLLM's names), in order.
    env_aliases: tuple[str, ...] = ()
    # How the environment variable of a `multiple` option splits into values (default: at commas).
    env_split: Callable[[str], list[str]] | None = None

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def env(self) -> str:
        return "FLASHSERVE_" + self.dest.upper()


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be zero or more: {text!r}")
    return value


def _graph_tokens(text: str) -> int:
    value = _count(text)
    if value > MAX_PIECEWISE_GRAPH_TOKENS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_PIECEWISE_GRAPH_TOKENS}: {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def _kv_events_config(text: str) -> KVEventsConfig:
    try:
        return KVEventsConfig.from_json(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.from_json(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _lora_module(text: str) -> dict[str, Any]:
    """One `--lora-modules` entry, as vLLM takes it: `name=path`, or a JSON object with "name",
    "path" and optionally "base_model_name"."""
    text = text.strip()
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not JSON: {text!r} ({exc})") from None
        if not isinstance(raw, dict):
            raise argparse.ArgumentTypeError(f"expected a JSON object: {text!r}")
        unknown = sorted(set(raw) - {"name", "path", "base_model_name"})
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown field(s) {unknown} in {text!r}; known: name, path, "
                                             "base_model_name")
        name, path, base = raw.get("name"), raw.get("path"), raw.get("base_model_name")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise argparse.ArgumentTypeError(f"{text!r} needs a non-empty \"name\" and \"path\"")
        if base is not None and not isinstance(base, str):
            raise argparse.ArgumentTypeError(f"base_model_name must be a string in {text!r}")
        return {"name": name, "path": path, "base_model_name": base}
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected name=path or a JSON object, got {text!r}")
    return {"name": name.strip(), "path": path.strip(), "base_model_name": None}


def _lora_modules_env(raw: str) -> list[str]:
    """FLASHSERVE_LORA_MODULES: a JSON list of objects, or name=path entries separated by commas."""
    raw = raw.strip()
    if raw.startswith("["):
        try:
            entries = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"FLASHSERVE_LORA_MODULES is not JSON: {exc}") from None
        if not isinstance(entries, list):
            raise argparse.ArgumentTypeError("FLASHSERVE_LORA_MODULES: expected a JSON list")
        return [json.dumps(e) if isinstance(e, dict) else str(e) for e in entries]
    return raw.split(",")


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be zero or more seconds: {text!r}")
    return value


SERVE_OPTIONS: tuple[Option, ...] = (
    Option("--model", str, "", "HF model id, local directory, .gguf file, config.json or built-in shape "
           "name (with --load-format dummy); empty: the embedded SmolLM2-135M-Instruct"),
    Option("--tokenizer", str, None, "tokenizer to use instead of the model's"),
    Option("--served-model-name", str, None, "model id(s) the API answers to (default: the model name)", multiple=True),
    Option("--host", str, "127.0.0.1", "address to bind"),
    Option("--port", int, 8000, "port to bind"),
    Option("--dtype", str, "auto", "model weights dtype", ["auto", "float32", "float16", "bfloat16"]),
    Option("--attention-dtype", str, "auto", "attention dtype for float32 models on CUDA",
           ["auto", "float16", "bfloat16"]),
    Option("--load-format", str, "auto", "dummy: random weights in the model's shape", ["auto", "dummy"]),
    Option("--max-model-len", int, None, "context length (default: the model's)"),
    Option("--device", str, "auto", "where to run", ["auto", "cpu", "cuda"]),
    Option("--attention-backend", str, "auto", "attention kernels (auto: flashinfer on CUDA, torch on CPU)",
           ["auto", "torch", "flashinfer"]),
    Option("--model-impl", str, "auto", "model code: native (fused Llama/Mistral/Qwen2/Qwen3 forward), hf "
           "(any transformers CausalLM), auto (native where supported)", ["auto", "native", "hf"]),
    Option("--torch-compile", _bool, False, "compile the native model's non-attention parts with "
           "torch.compile (Inductor); start-up compiles for a while first"),
    Option("--fused-decode", _bool, False, "with FlashInfer attention: RoPE inside the KV append kernel, and "
           "decode steps of up to 4 requests through a Triton split-KV attention (faster single-stream decode; "
           "they round otherwise than FlashInfer's kernels)"),
    Option("--tensor-parallel-size", _positive_int, 1, "ranks that share the model's weights on this node "
           "(this process and N-1 worker processes; native model path only) (alias --tp)"),
    Option("--enable-flashinfer-allreduce-fusion", _bool, None, "with --tensor-parallel-size > 1 on GPUs: "
           "run each all-reduce with the residual add and RMSNorm after it as one FlashInfer kernel "
           "(steps of up to 128 tokens) instead of NCCL's all-reduce and a norm kernel (default: where "
           "it can run, a float16/bfloat16 model on GPUs of one node that NVLink connects; "
           "--no-enable-flashinfer-allreduce-fusion: NCCL); FlashInfer builds that kernel at the first "
           "start on a machine, which takes several minutes"),
    Option("--tp-overlap-min-tokens", _positive_int, None, "with --tensor-parallel-size > 1: steps of at least this many "
           "tokens run each layer's token-wise part (projections, norms, MLP) in two chunks, so that one "
           "chunk's all-reduce runs beside the other chunk's GEMMs (default: off)"),
    Option("--tp-overlap-comm", str, "nccl", "with --tp-overlap-min-tokens on GPUs that NVLink connects: what "
           "carries the overlapped all-reduces: nccl, or copy-engine (peer copies through symmetric memory "
           "and a small sum kernel, leaving the SMs to the GEMMs beside)", list(TP_OVERLAP_COMMS)),
    Option("--piecewise-cuda-graph-max-tokens", _graph_tokens, None, "steps with prompt tokens (short prompts, "
           "prefill chunks beside decode rows) of up to this many tokens replay the model's pieces between "
           "attention calls from CUDA graphs captured at start, attention eager between them (native model "
           "with FlashInfer; 0: such steps run eagerly; default: 512, 2304 with FP8 projections)"),
    Option("--quantization", str, None, "fp8: quantize a bfloat16/float16 checkpoint's projections to FP8 at "
           "load (per-channel weights, per-token activations; FP8 GEMMs need a GPU of compute capability "
           ">= 8.9, a CPU computes with the FP8-rounded weights). FP8 checkpoints (compressed-tensors, "
           "fbgemm_fp8) are detected from config.json without it", ["fp8"]),
    Option("--kv-cache-dtype", str, "auto", "KV cache dtype: auto (the attention dtype) or fp8 (e4m3 with "
           "scale 1.0: half the KV memory and reads of bfloat16)", ["auto", "fp8", "fp8_e4m3"]),
    Option("--cascade-attention", str, "auto", "attend a prefix shared by a group of requests once for the group "
           "(on: every such group; auto: in a step whose groups save >= 512k KV token reads)", list(CASCADE_MODES)),
    Option("--enable-lora", _bool, False, "serve LoRA adapters of the model (PEFT's format): a request names "
           "an adapter as its model"),
    Option("--lora-modules", _lora_module, None, "adapters served from the start, as name=path or JSON "
           "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}' (a local folder, or an HF id found in "
           "the local HF cache); the environment variable takes name=path entries separated by commas or a "
           "JSON list", multiple=True, env_split=_lora_modules_env),
    Option("--max-loras", _positive_int, 1, "most adapters one step uses (the device holds this many); "
           "requests of more adapters wait for a step with room"),
    Option("--max-lora-rank", _positive_int, 16, "largest adapter rank; an adapter of a larger rank is refused"),
    Option("--max-cpu-loras", _positive_int, None, "adapters whose weights stay in host memory; the others "
           "are read again from their folder when a step needs them (default: --max-loras)"),
    Option("--allow-runtime-lora-updating", _bool, False, "serve POST /v1/load_lora_adapter and "
           "/v1/unload_lora_adapter, which load and unload adapters while serving (behind --api-key when set)",
           env_aliases=("VLLM_ALLOW_RUNTIME_LORA_UPDATING",)),
    Option("--page-size", int, 16, "tokens per KV cache page"),
    Option("--num-pages", int, None, "KV cache pages (default: sized from memory)"),
    Option("--gpu-memory-utilization", float, 0.9, "fraction of GPU memory for weights, activations and KV cache"),
    Option("--cpu-kv-cache-gb", float, 1.0, "KV cache size on CPU, in GB"),
    Option("--enable-prefix-caching", _bool, True, "reuse the KV pages of prompt prefixes that earlier "
           "requests computed (--no-enable-prefix-caching to turn it off)"),
    Option("--prefix-caching-hash-seed", str, "flashserve", "seed of the page hashes' chain (sha256, "
           "docs/production.md): fixed, so a page's hash is the same in every replica and after restarts; "
           "change it to keep them private"),
    Option("--kv-events-config", _kv_events_config, None, "publish the prefix cache's stored and evicted "
           "pages for KV-aware routers, as vLLM's option (JSON, e.g. '{\"enable_kv_cache_events\": true, "
           "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}'; "
           "each engine core of --data-parallel-size publishes on the ports plus its rank)"),
    Option("--max-num-seqs", _positive_int, None, "most requests in one step (default: 1024 on a GPU of 70 GiB "
           "or more other than an A100, as vLLM's; else 256)"),
    Option("--max-num-batched-tokens", _positive_int, None, "most tokens in one step (prefill chunks + decode "
           "tokens) (default: 8192 on a GPU of 70 GiB or more other than an A100, as vLLM's; 2048 on other "
           "GPUs; on a CPU as many as one step computes in about 0.4 s, measured at start-up)"),
    Option("--max-prefill-tokens", _count, None, "prompt tokens a step computes for more than one prompt: "
           "a step takes another waiting prompt only while its prompt tokens stay within this (like SGLang's "
           "option), so that prompts arriving together get first tokens in turn; a prompt alone may take the "
           "whole step (default: 2048 on a GPU; 0 and on a CPU: no bound)"),
    Option("--chunked-prefill-size", _count, 0, "prompt tokens of a step in which running streams wait "
           "for their next token (like SGLang's option): a longer prompt continues in the next steps, so a "
           "stream's gap between tokens stays nearer a decode step's, at the cost of its first token; steps no "
           "stream waits on are bounded by --max-num-batched-tokens only (default 0: no bound)"),
    Option("--overlap-scheduling", _bool, True, "schedule and launch each step while the device computes "
           "the one before (--no-overlap-scheduling: one after the other)"),
    Option("--late-launch", _bool, None, "with overlap scheduling: schedule the step behind a decode step "
           "shortly before that one ends (predicted from the steps before), not as it starts, so that a prompt "
           "arriving meanwhile starts up to one decode step sooner; it costs the streams the moments a launch "
           "comes late (default: behind decode steps of at least 8 ms on a GPU, as a 70B's; --late-launch: "
           "behind every decode step; --no-late-launch: never)"),
    Option("--speculative-config", _speculative_config, None, "speculative decoding, as vLLM's option (JSON): "
           "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, "
           "\"prompt_lookup_max\": 4}' proposes draft tokens by looking the request's last tokens up in its own "
           "prompt and output, verified in one forward; '{\"model\": PATH, \"num_speculative_tokens\": 4}' has a "
           "smaller draft model of the same vocabulary propose them; \"disable_by_batch_size\": N turns it off in "
           "steps of more than N requests (default: off)"),
    Option("--cuda-graph", _bool, True, "capture decode steps in CUDA graphs (--no-cuda-graph or --enforce-eager to disable)"),
    Option("--seed", int, 0, "seed of the sampler for requests without a seed"),
    Option("--log-level", str, "info", "log level", ["debug", "info", "warning", "error"]),
    # ---- production: logs, overload, auth, CORS, shutdown
    Option("--log-requests", _bool, False, "log each request's prompt (text or token ids) as it arrives; "
           "without it logs carry no prompt text"),
    Option("--access-log", _bool, False, "uvicorn's access log line per HTTP request, besides the "
           "line per finished generation request"),
    Option("--max-waiting", _positive_int, None, "most sequences (prompts x n of every request) queued for "
           "the engine; past it new requests get 503 with Retry-After (default: no limit)"),
    Option("--queue-timeout", _positive_float, None, "seconds a request may wait to be scheduled before it "
           "ends with a 503 error and frees what it held (default: no limit)"),
    Option("--api-key", str, None, "API key(s) clients must send as 'Authorization: Bearer KEY'; "
           "/health and /metrics stay open (default: none, no authentication)", multiple=True),
    Option("--allowed-origins", str, None, "CORS: origins allowed to call the API from a browser, or '*' "
           "(default: none, CORS off)", multiple=True),
    Option("--allowed-methods", str, ["GET", "POST", "OPTIONS"], "CORS: allowed methods", multiple=True),
    Option("--allowed-headers", str, ["*"], "CORS: allowed request headers", multiple=True),
    Option("--allow-credentials", _bool, False, "CORS: allow cookies and HTTP authentication"),
    Option("--max-sequences-per-request", _positive_int, 256, "most sequences (prompts x n) one request may "
           "start; more is a 400"),
    Option("--max-body-bytes", _positive_int, 8 << 20, "largest request body; larger ones get 413"),
    Option("--tool-call-parser", str, "auto", "the model's tool-call format, parsed into tool_calls for "
           "tool_choice auto: llama3_json, hermes, mistral, auto (detected from the chat template), or generic; "
           "where none is known or the template does not render tools (and with generic), the tools are shown "
           "to the model as text and its calls follow a generic format that a grammar enforces",
           ["auto", "llama3_json", "hermes", "mistral", "generic"]),
    Option("--api-server-count", _positive_int, 1, "front-end processes (HTTP, tokenizing, detokenizing) "
           "that share the port and feed the one engine core process"),
    Option("--data-parallel-size", _positive_int, 1, "engine cores on this node, each with its own GPUs "
           "(--tensor-parallel-size of them) and KV cache, behind the front ends; each request goes to the "
           "engine with the longest cached prefix for it, then the least loaded (alias --dp)"),
    Option("--data-parallel-routing", str, "prefix", "how front ends pick an engine core under "
           "--data-parallel-size: prefix (longest cached prefix, then least load) or load (least load only)",
           ["prefix", "load"]),
    Option("--responses-store-max-entries", _count, 1000, "most responses the Responses API keeps for "
           "previous_response_id and GET /v1/responses/{id}, shared by the server's front ends (lost on restart, not "
           "shared between servers); past it the least recently used go first; 0: none are kept"),
    Option("--responses-store-max-age", _positive_float, 3600.0, "seconds a stored response is kept after "
           "it was last created or read"),
    Option("--shutdown-timeout", _seconds, 30.0, "on SIGTERM, seconds to let running requests finish "
           "(new ones get 503) before the rest end with an error"),
    Option("--ui", _bool, True, "the chat page at / (--no-ui: / answers 404)"),
    Option("--otlp-traces-endpoint", str, None, "OpenTelemetry collector to send a span per request to over "
           "OTLP, gRPC unless OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf (then the whole URL, .../v1/traces); "
           "the request's traceparent header is its parent (default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else "
           "no tracing; needs the tracing extra)"),
)


# Serve's options that mean nothing without an HTTP listener: run-batch leaves them out, and their
# defaults fill its ServeArgs.
SERVER_ONLY_FLAGS = frozenset({
    "--host", "--port", "--log-requests", "--access-log", "--max-waiting", "--queue-timeout", "--api-key",
    "--allowed-origins", "--allowed-methods", "--allowed-headers", "--allow-credentials", "--shutdown-timeout",
    "--ui", "--api-server-count", "--data-parallel-size", "--data-parallel-routing", "--kv-events-config",
    "--responses-store-max-entries", "--responses-store-max-age", "--otlp-traces-endpoint",
    "--allow-runtime-lora-updating",
})

RUN_BATCH_OPTIONS: tuple[Option, ...] = tuple(o for o in SERVE_OPTIONS if o.flag not in SERVER_ONLY_FLAGS) + (
    Option("--max-concurrency", _positive_int, None, "batch requests in flight at once (default: twice "
           "--max-num-seqs, so that the engine always has the next requests waiting)"),
    Option("--prefix-grouping", _bool, True, "submit requests grouped by shared prompt prefixes, "
           "decode-heavy groups first, instead of in file order (--no-prefix-grouping)"),
    Option("--progress", _bool, True, "progress bar on stderr (--no-progress)"),
    Option("--overwrite", _bool, False, "start the output file afresh; by default a run resumes it, running "
           "only the requests whose custom_id has no result there yet (a server failure, 5xx, is run again)"),
)


def add_options(parser: argparse.ArgumentParser, options: Sequence[Option], environ: dict[str, str]) -> None:
    for opt in options:
        default = opt.default
        env = next((name for name in (opt.env, *opt.env_aliases) if name in environ), None)
        if env is not None:
            raw = environ[env]
            try:
                if opt.multiple:
                    values = opt.env_split(raw) if opt.env_split is not None else raw.split(",")
                    default = [opt.type(v) if opt.type else v for v in values if v.strip()]
                else:
                    default = opt.type(raw) if opt.type else raw
            except (argparse.ArgumentTypeError, ValueError) as exc:
                parser.error(f"{env}: {exc}")
        shown = "" if opt.default is None else f" (default: {opt.default})"
        envs = " or ".join((opt.env, *opt.env_aliases))
        help_text = f"{opt.help}{shown} [env: {envs}]"
        if opt.type is _bool:
            parser.add_argument(opt.flag, dest=opt.dest, action=argparse.BooleanOptionalAction,
                                default=default, help=help_text)
            continue
        parser.add_argument(opt.flag, dest=opt.dest, type=opt.type, default=default, choices=opt.choices,
                            nargs="+" if opt.multiple else None, help=help_text)


def build_parser(environ: dict[str, str] | None = None) -> argparse.ArgumentParser:
    environ = dict(os.environ if environ is None else environ)
    parser = argparse.ArgumentParser(prog="flashserve", description="OpenAI-compatible LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over HTTP", formatter_class=argparse.HelpFormatter)
    add_options(serve, SERVE_OPTIONS, environ)
    serve.add_argument("--enforce-eager", dest="cuda_graph", action="store_false",
                       help="alias of --no-cuda-graph")
    serve.add_argument("--tp", dest="tensor_parallel_size", type=_positive_int, default=argparse.SUPPRESS,
                       help="alias of --tensor-parallel-size")
    serve.add_argument("--dp", dest="data_parallel_size", type=_positive_int, default=argparse.SUPPRESS,
                       help="alias of --data-parallel-size")
    batch = sub.add_parser(
        "run-batch", help="run a file of OpenAI batch requests (JSONL) offline",
        description="Run an OpenAI Batch API input file (one JSON request a line: custom_id, method, url, "
                    "body) through the server's API in-process and write one result line per request.")
    batch.add_argument("-i", "--input-file", required=True, help="batch input, JSONL")
    batch.add_argument("-o", "--output-file", required=True, help="results, JSONL, written as requests finish")
    add_options(batch, RUN_BATCH_OPTIONS, environ)
    batch.add_argument("--enforce-eager", dest="cuda_graph", action="store_false",
                       help="alias of --no-cuda-graph")
    batch.add_argument("--tp", dest="tensor_parallel_size", type=_positive_int, default=argparse.SUPPRESS,
                       help="alias of --tensor-parallel-size")
    batch.set_defaults(**{o.dest: o.default for o in SERVE_OPTIONS if o.flag in SERVER_ONLY_FLAGS})
    return parser
