"""Loading the engine as `flashserve serve` configures it (`load_engine`: the engine core process
and run-batch's engine process call it), and an in-process server over it (`build_server`: an
`AsyncEngine` loop in a thread and the OpenAI app, no HTTP listener), for callers that want the
app without processes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

# At module level: whoever imports this builds a server, and the app's imports (2 s, torch and
# transformers among them) then belong to start-up, not to the first request or batch line.
from flashserve.api.options import ServerState
from flashserve.api.server import build_app
from flashserve.serve_args import ServeArgs
from flashserve.client.async_engine import AsyncEngine
from flashserve.metrics import Metrics

if TYPE_CHECKING:
    from fastapi import FastAPI

    from flashserve.entrypoints.llm import EngineStack

logger = logging.getLogger("flashserve")


@dataclass
class ServerStack:
    stack: EngineStack
    engine: AsyncEngine  # not started: start() it on the event loop that reads its outputs
    app: FastAPI
    metrics: Metrics
    state: ServerState


def load_engine(args: ServeArgs, detokenize: bool = True) -> EngineStack:
    """Load the model and build the synchronous engine (torch is imported here); `detokenize=False`
    for an engine that leaves text and stop strings to its front ends."""
    from flashserve.entrypoints.llm import build_engine

    t0 = time.perf_counter()
    stack = build_engine(args.model, args.cache, args.scheduler, cuda_graph=args.cuda_graph, detokenize=detokenize)
    load_lora_modules(stack, args)
    loaded = stack.loaded
    chunk = stack.engine.scheduler.config.chunked_prefill_size
    logger.info(
        "model %s ready in %.1f s: %s on %s, max_model_len %d, KV cache %d pages x %d tokens, step budget %d tokens%s",
        loaded.name, time.perf_counter() - t0, loaded.dtype, loaded.device, stack.max_model_len,
        stack.num_pages, stack.page_size, stack.max_num_batched_tokens,
        f" ({chunk} prompt tokens while streams wait)" if chunk else "",
    )
    return stack


def load_lora_modules(stack: EngineStack, args: ServeArgs) -> None:
    """Loads every `--lora-modules` adapter; an adapter that does not load stops the start (a
    LoRAAdapterError that names it, after what was started is closed)."""
    from flashserve.message.lora import LoRAAdapterError

    for lora in args.lora_modules:
        try:
            stack.engine.loras.load(lora.lora_name, lora.lora_path, lora.base_model_name)
        except LoRAAdapterError as exc:
            stack.close()
            raise LoRAAdapterError(f"--lora-modules {lora.lora_name}={lora.lora_path}: {exc}") from None


def served_names(args: ServeArgs, loaded_name: str) -> list[str]:
    return list(args.model.served_model_names) or [loaded_name]


def build_server(args: ServeArgs, stack: EngineStack) -> ServerStack:
    """The AsyncEngine (not started) and the app over a loaded engine, as `serve` configures them."""
    loaded = stack.loaded
    names = served_names(args, loaded.name)
    metrics = Metrics(model_name=names[0])
    state = ServerState()
    engine = AsyncEngine(stack.engine, stack.max_model_len, metrics=metrics, max_waiting=args.max_waiting,
                         queue_timeout=args.queue_timeout)
    app = build_app(
        engine, loaded.tokenizer, names, stack.max_model_len,
        eos_token_ids=tuple(loaded.eos_token_ids), options=args.api, metrics=metrics, state=state,
        vocab_size=loaded.vocab_size,
    )
    return ServerStack(stack, engine, app, metrics, state)
