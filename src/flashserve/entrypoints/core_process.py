"""The engine core process of `flashserve serve`: load the model, then run `engine.engine_core.EngineCore`
for the front ends at the other ends of its pipes until they are all gone.

Exit codes: 0 once every front end is gone (or on SIGTERM); 1 when the model did not load or the
step loop died (a device error poisons the whole process: a fresh one must take over).
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Callable

from flashserve.entrypoints.processes import ENGINE_CORE_NAME, become_child
from flashserve.message.codec import Dead, EngineSetup, PROTOCOL_VERSION, recv, send

if TYPE_CHECKING:
    from flashserve.serve_args import ServeArgs

logger = logging.getLogger("flashserve")

EXIT_ENGINE_DIED = 1


@dataclass
class CoreParts:
    """What a loader hands the engine core: the engine (without a tokenizer: it sees ids only),
    what the front ends are told, a grammar compiler (spec -> grammar or a Future of one) and
    what to call at the end (stops tensor-parallel workers)."""

    engine: Any  # engine.llm_engine.LLMEngine
    setup: EngineSetup
    compile_grammar: Callable[[Any], Any] | None
    close: Callable[[], None]
    kv_events: Any = None  # config.KVEventsConfig: publish the KV cache's events; None: not


def start_kv_events(parts: CoreParts, engine_index: int) -> Any:
    """The KV event publisher of engine core `engine_index` (an `engine.kv_events.KVEventPublisher`,
    bound to its ports), or None when events are off."""
    if parts.kv_events is None:
        return None
    from flashserve.engine.kv_events import KVEventPublisher

    kv_cache = parts.engine.scheduler.kv_cache
    if not kv_cache.enable_caching:
        logger.warning("--kv-events-config with prefix caching off: no page is ever cached, no event published")
    return KVEventPublisher(parts.kv_events, kv_cache.page_size, engine_index)


def load_serve_core(args: ServeArgs) -> CoreParts:
    """The engine of `flashserve serve` for `args`."""
    from flashserve.entrypoints.stack import load_engine

    parts = core_parts(load_engine(args, detokenize=False))
    parts.kv_events = args.cache.kv_events
    return parts


def core_parts(stack: Any) -> CoreParts:
    """An engine core's parts over a loaded `EngineStack` (whose engine leaves text to the front
    ends: `detokenize=False`)."""
    loaded = stack.loaded
    compiler = None

    def compile_grammar(spec: Any) -> Any:
        nonlocal compiler
        if compiler is None:  # built on the first grammar: the token table takes a moment
            from flashserve.structured.compiler import GrammarCompiler

            compiler = GrammarCompiler(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
        return compiler.submit(spec)

    loras = stack.engine.loras
    setup = EngineSetup(PROTOCOL_VERSION, loaded.tokenizer, loaded.name, stack.max_model_len,
                        tuple(loaded.eos_token_ids), loaded.vocab_size, stack.engine.scheduler.config.max_num_seqs,
                        loras.enabled, loras.adapters)
    return CoreParts(stack.engine, setup, compile_grammar, stack.close)


class _Stop(BaseException):
    """SIGTERM: leave the loop wherever it is."""


class _StopOnce:
    """SIGTERM's handler. The first SIGTERM while the engine core serves leaves the loop wherever
    it is; once the core is stopping (told to, or its front ends gone), a SIGTERM changes nothing.
    The supervisor sends one to every engine core left when another dies: raised in the exit
    (inside threading's shutdown, say), it printed a traceback instead of the one line."""

    def __init__(self) -> None:
        self.stopping = False

    def __call__(self, signum: int, frame: Any) -> None:
        if not self.stopping:
            self.stopping = True
            raise _Stop


def main(load: Callable[[Any], CoreParts], load_arg: Any, conns: list[Connection],
         queue_timeout: float | None, log_level: str, engine_index: int = 0, name: str = ENGINE_CORE_NAME) -> None:
    """The process's target: `load(load_arg)` builds the engine; `conns` lead to the front ends.
    `engine_index`: this engine core's index under `--data-parallel-size` (its metrics' label)."""
    become_child(name, log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when the core stops
    stop = _StopOnce()
    signal.signal(signal.SIGTERM, stop)
    parts: CoreParts | None = None
    kv_events = None
    code = 0
    try:
        try:
            parts = load(load_arg)
        except Exception as exc:
            logger.exception("the model did not load")
            _tell_all(conns, Dead(f"the model did not load: {exc!r}"))
            code = EXIT_ENGINE_DIED
            return
        try:
            kv_events = start_kv_events(parts, engine_index)
        except Exception as exc:  # a port in use, say
            logger.exception("KV cache events did not start")
            _tell_all(conns, Dead(f"KV cache events did not start: {exc!r}"))
            code = EXIT_ENGINE_DIED
            return
        code = serve_front_ends(parts, conns, queue_timeout, engine_index, kv_events)
        stop.stopping = True
        if code == 0:
            logger.info("engine core stopping: every front end is gone")
    except _Stop:
        logger.info("engine core stopping")
    except Exception:  # the process ends below, without the interpreter's traceback
        logger.exception("the engine core failed")
        code = EXIT_ENGINE_DIED
    finally:
        stop.stopping = True
        if kv_events is not None:
            kv_events.close()
        if parts is not None:
            parts.close()
        for conn in conns:
            conn.close()
        # Imported here: the module imports torch, which the supervisor importing this one need not.
        from flashserve.executor.launch import exit_now

        exit_now(code)


def serve_front_ends(parts: CoreParts, conns: list[Connection], queue_timeout: float | None,
                     engine_index: int = 0, kv_events: Any = None) -> int:
    from flashserve.engine.engine_core import EngineCore
    from flashserve.metrics import Metrics

    core = EngineCore(parts.engine, parts.setup, parts.compile_grammar, Metrics(str(engine_index)), queue_timeout,
                      kv_events=kv_events)
    for conn in conns:
        if not core.connect(conn):
            logger.warning("a front end did not connect")
    dead = core.run()
    core.close()
    return EXIT_ENGINE_DIED if dead is not None else 0


def _tell_all(conns: list[Connection], message: Any) -> None:
    for conn in conns:
        try:
            recv(conn)  # its Hello
            send(conn, message)
        except (EOFError, OSError):
            pass
