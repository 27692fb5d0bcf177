"""`flashserve run-batch -i requests.jsonl -o results.jsonl`: an OpenAI Batch API file, offline.

Every line goes through the server's own app (`batch_lines.post`), so its result line holds exactly
the status code and body that `flashserve serve` would answer, errors included; a line that is no
request at all (bad JSON, no custom_id, a method or url the batch API does not take) gets an error
line instead, and the run goes on. The app runs in a process of its own (`app.py`), started
while this one loads the model, so that its work for each line does not take turns with the engine
loop for the GIL; this process runs the engine and serves the app's requests (`serve_app`). The two
talk through a pipe each way, each message sent by the thread that makes it: a multiprocessing
queue's feeder thread would wait its turn for the GIL behind the busy thread of its process (5 ms
a turn), and requests reached the engine in bursts, long after the app made them. Up to
`--max-concurrency` requests are in flight at once, so the engine batches continuously; they are
submitted in prefix-sharing order (`engine/prefix_groups.py`) unless `--no-prefix-grouping`.
Result lines are written and flushed as requests finish, so an interrupted run keeps every
finished result, and a run on the same output file resumes it: it runs only the lines without a
result there (`batch_resume`; --overwrite starts afresh). A file whose custom_ids repeat is refused.

Exit code 0 when the run completes, failed lines or not; 1 if the engine died on the way (or the
app process did); 2 when the input cannot be read or repeats a custom_id, or the output cannot be
written; 130 when interrupted.
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
import time
from dataclasses import replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Callable

try:
    import fcntl
except ImportError:  # not on Windows
    fcntl = None  # type: ignore[assignment]

from flashserve.cli import BatchArgs
from flashserve.client.streams import error_output
from flashserve.engine.engine import LLMEngine
from flashserve.engine.heap import existing_objects_frozen
from flashserve.engine.outputs import RequestOutput
from flashserve.engine.prefix_pins import GroupPins
from flashserve.entrypoints.run_batch import app as batch_app
from flashserve.entrypoints.run_batch.lines import BatchRequest, LineError, parse_line, plan_requests
from flashserve.entrypoints.run_batch.resume import duplicate_ids, prepare_output, remaining
from flashserve.entrypoints.stack import load_engine, served_names

logger = logging.getLogger("flashserve")

EXIT_ENGINE_DIED = 1
EXIT_BAD_FILE = 2
EXIT_INTERRUPTED = 130


class AppProcessDied(RuntimeError):
    """The app process ended without finishing the run."""


def main(args: BatchArgs, stack: Any = None) -> int:
    """Run the batch; returns the exit code. `stack` (an `llm.EngineStack`) skips loading the
    model, for callers that hold one already."""
    level = args.serve.server.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        with open(args.input_file, encoding="utf-8") as f:
            texts = f.readlines()
    except (OSError, UnicodeDecodeError) as exc:
        print(f"flashserve run-batch: cannot read {args.input_file}: {exc}", file=sys.stderr)
        return EXIT_BAD_FILE
    items = [parse_line(text, n) for n, text in enumerate(texts, 1) if text.strip()]
    duplicates = duplicate_ids(items)
    if duplicates is not None:
        print(f"flashserve run-batch: {args.input_file}: {duplicates}", file=sys.stderr)
        return EXIT_BAD_FILE
    try:
        resume = prepare_output(args.output_file, args.overwrite)  # the app process appends to it
    except OSError as exc:
        print(f"flashserve run-batch: cannot write {args.output_file}: {exc}", file=sys.stderr)
        return EXIT_BAD_FILE
    todo = remaining(items, resume)
    if resume.num_done:
        print(f"flashserve run-batch: resuming {args.output_file}: {len(items) - len(todo)} of {len(items)} lines "
              f"have results there; running the other {len(todo)} (--overwrite starts afresh)", file=sys.stderr)
    requests = [item for item in todo if isinstance(item, BatchRequest)]
    context = multiprocessing.get_context("spawn")  # never fork a process that may hold a GPU
    inbox, app_tx = pipe(context)  # app -> engine
    app_rx, outbox = pipe(context)  # engine -> app
    app = context.Process(target=batch_app.main, args=(app_tx, app_rx), name="flashserve-run-batch-app",
                          daemon=True)
    app.start()  # it imports the app while the model loads
    app_tx.close()  # the app's ends are the app's: a pipe whose far end is gone reads EOF, writes fail
    app_rx.close()
    setup_sent = False
    try:
        if stack is None:
            stack = load_engine(args.serve)
        pins: GroupPins | None = None
        member_of_line: dict[int, tuple[int, int]] = {}
        scheduler = stack.engine.scheduler
        if args.prefix_grouping and scheduler.kv_cache.enable_caching and requests:
            t0 = time.perf_counter()
            batch = plan_requests(requests, stack.tokenizer, stack.page_size, stack.max_model_len)
            requests, member_of_line = batch.requests, batch.member_of_line()
            pins = GroupPins(scheduler.kv_cache, scheduler.prefix_cache.hasher, batch.plan, batch.prompts,
                             batch.largest_request_tokens, batch.salts)
            logger.info("ordered %d requests by shared prefixes in %.1f s", len(requests), time.perf_counter() - t0)
        loaded = stack.loaded
        _send(outbox, app, batch_app.AppSetup(
            tokenizer=loaded.tokenizer, served_model_names=served_names(args.serve, loaded.name),
            max_model_len=stack.max_model_len, eos_token_ids=tuple(loaded.eos_token_ids),
            vocab_size=loaded.vocab_size, api=args.serve.api, input_file=args.input_file,
            output_file=args.output_file, order=[r.line_no for r in requests],
            error_lines=[e.line_no for e in todo if isinstance(e, LineError)], num_done=len(items) - len(todo),
            max_concurrency=args.max_concurrency or 2 * stack.engine.scheduler.config.max_num_seqs,
            progress=args.progress, log_level=level,
        ))
        setup_sent = True
        summary, dead = serve_app(stack.engine, app, inbox, outbox, _grammar_compiler(stack), pins, member_of_line)
    except KeyboardInterrupt:
        print(f"flashserve run-batch: interrupted; finished results are in {args.output_file}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except AppProcessDied as exc:
        print(f"flashserve run-batch: {exc}; finished results are in {args.output_file}", file=sys.stderr)
        return EXIT_ENGINE_DIED
    finally:
        if not setup_sent:  # the model did not load: the app process ends
            try:
                outbox.send(None)
            except OSError:  # it is gone already
                pass
        app.join(10)
        if app.is_alive():
            app.terminate()
        inbox.close()
        outbox.close()
    print(summary)
    return EXIT_ENGINE_DIED if dead is not None else 0


def serve_app(engine: LLMEngine, app: BaseProcess, inbox: Connection, outbox: Connection,
              compile_grammar: Callable[[Any], Any], pins: GroupPins | None = None,
              member_of_line: dict[int, tuple[int, int]] | None = None) -> tuple[str, str | None]:
    """The engine loop for the app process: its adds and aborts go to the engine between steps,
    each step's outputs go back in one message. With `pins`, each prefix-sharing group's prefix is
    pinned while the group runs (`member_of_line`: a line's group and member). Returns (the app's
    summary, why the engine died or None) when the app is done; raises AppProcessDied if it ends
    first."""
    dead: str | None = None
    member_of_line = member_of_line or {}
    group_of: dict[str, int] = {}  # request id -> its group, for requests under a pin
    try:
        with existing_objects_frozen():
            while True:
                outputs: list[RequestOutput] = []
                for kind, value in _receive(inbox, app, wait=dead is not None or not engine.has_unfinished):
                    if kind == "add":
                        add, spec, line = value
                        member = member_of_line.get(line) if pins is not None else None
                        if member is not None:  # pinned before the request can be scheduled
                            pins.submitted(*member)  # type: ignore[union-attr]
                            group_of[add.request_id] = member[0]
                        try:
                            if dead is not None:
                                raise RuntimeError(dead)
                            params = add.params if spec is None else replace(add.params,
                                                                             grammar=compile_grammar(spec))
                            engine.add_request(add.request_id, add.prompt_token_ids, params, add.group,
                                               add.cache_salt, add.stream)
                        except Exception as exc:  # this request fails alone
                            outputs.append(error_output(add.request_id, len(add.prompt_token_ids), str(exc)))
                    elif kind == "abort":
                        if (aborted := engine.abort(value.request_id, value.error)) is not None:
                            outputs.append(aborted)
                    elif kind == "done":
                        return value, dead
                if dead is None and engine.has_unfinished:
                    try:
                        outputs.extend(engine.step())
                    except Exception as exc:  # the engine loop died: every open request ends with it
                        logger.exception("engine loop died")
                        dead = f"engine loop died: {exc!r}"
                        _send(outbox, app, ("dead", dead))
                if outputs:
                    if group_of:
                        for out in outputs:
                            if out.finished and (group := group_of.pop(out.request_id, None)) is not None:
                                pins.finished(group)  # type: ignore[union-attr]
                    _send(outbox, app, ("outputs", outputs))
    finally:
        if pins is not None:
            pins.release_all()


PIPE_BYTES = 1 << 20


def pipe(context: Any) -> tuple[Connection, Connection]:
    """(reader, writer) of a pipe that holds up to `PIPE_BYTES` (1 MiB, Linux's default most for an
    unprivileged process) where the system allows it, else the default 64 KiB. The engine reads
    between steps, so a step's worth of the app's requests must fit: at 64 KiB five to seven
    requests of a 2,200-token prompt did (9-11.5 KB pickled), and the app's event loop, blocked in
    its next send, waited for the engine's next step."""
    reader, writer = context.Pipe(duplex=False)
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None) if fcntl is not None else None
    if set_size is not None:
        try:
            fcntl.fcntl(writer.fileno(), set_size, PIPE_BYTES)
        except OSError:  # above this system's limit: the default stays
            pass
    return reader, writer


def _receive(inbox: Connection, app: BaseProcess, wait: bool) -> list[Any]:
    """The messages waiting now; with `wait`, blocks until there is one."""
    while wait and not inbox.poll(0.5):
        if not app.is_alive():
            raise _died(app)
    messages = []
    try:
        while inbox.poll():
            messages.append(inbox.recv())
    except (EOFError, OSError):  # the app's end is closed: it exited
        raise _died(app) from None
    return messages


def _send(outbox: Connection, app: BaseProcess, message: Any) -> None:
    try:
        outbox.send(message)
    except OSError:  # a broken pipe: the app process exited
        raise _died(app) from None


def _died(app: BaseProcess) -> AppProcessDied:
    app.join(1)
    return AppProcessDied(f"the app process exited with code {app.exitcode}")


def _grammar_compiler(stack: Any) -> Callable[[Any], Any]:
    """spec -> compiled grammar, compiling in this process (made on the first grammar line)."""
    compiler = None

    def compile_grammar(spec: Any) -> Any:
        nonlocal compiler
        if compiler is None:
            from flashserve.structured.compiler import GrammarCompiler

            loaded = stack.loaded
            compiler = GrammarCompiler(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
        return compiler.compile_sync(spec)

    return compile_grammar
