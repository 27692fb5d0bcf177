"""`flashserve serve`: load the model, start the engine loop, serve HTTP with uvicorn."""

from __future__ import annotations

import asyncio
import logging
import time

from flashserve.cli import ServeArgs

logger = logging.getLogger("flashserve")


def served_names(args: ServeArgs, loaded_name: str) -> list[str]:
    return list(args.model.served_model_names) or [loaded_name]


async def serve(args: ServeArgs) -> None:
    import uvicorn

    from flashserve.api.server import build_app
    from flashserve.engine.async_engine import AsyncEngine
    from flashserve.llm import build_engine

    t0 = time.perf_counter()
    stack = build_engine(args.model, args.cache, args.scheduler, cuda_graph=args.cuda_graph)
    loaded = stack.loaded
    logger.info(
        "model %s ready in %.1f s: %s on %s, max_model_len %d, KV cache %d pages x %d tokens",
        loaded.name, time.perf_counter() - t0, loaded.dtype, loaded.device, stack.max_model_len,
        stack.num_pages, stack.page_size,
    )
    engine = AsyncEngine(stack.engine, stack.max_model_len)
    app = build_app(
        engine, loaded.tokenizer, served_names(args, loaded.name), stack.max_model_len,
        eos_token_ids=tuple(loaded.eos_token_ids),
    )
    config = uvicorn.Config(
        app, host=args.server.host, port=args.server.port, log_level=args.server.log_level,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    engine.start()
    try:
        await server.serve()
    finally:
        engine.shutdown()


def run_serve(args: ServeArgs) -> None:
    logging.basicConfig(
        level=args.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(serve(args))
