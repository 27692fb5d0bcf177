"""`flashserve run-batch -i requests.jsonl -o results.jsonl`: an OpenAI Batch API file, offline.

Every line goes through the server's own app (`lines.post`), so its result line holds exactly
the status code and body that `flashserve serve` would answer, errors included; a line that is no
request at all (bad JSON, no custom_id, a method or url the batch API does not take) gets an error
line instead, and the run goes on. The app runs in a process of its own (`app.py`), started
while this one loads the model, so that its work for each line does not take turns with the engine
loop for the GIL; this process runs an `EngineCore` (`engine/engine_core.py`, as `flashserve serve`'s
engine core process does) with the app process as its one front end. The two talk through a pipe
each way (`pipes.py`), each message sent by the thread that makes it: a multiprocessing queue's
feeder thread would wait its turn for the GIL behind the busy thread of its process (5 ms a turn),
and requests reached the engine in bursts, long after the app made them. Up to
`--max-concurrency` requests are in flight at once, so the engine batches continuously; they are
submitted in prefix-sharing order (`engine/prefix_groups.py`) unless `--no-prefix-grouping`.
Result lines are written and flushed as requests finish, so an interrupted run keeps every
finished result, and a run on the same output file resumes it: it runs only the lines without a
result there (`resume.py`; --overwrite starts afresh), and ends at once, without loading the model,
when every line has one. A file whose custom_ids repeat is refused.

Exit code 0 when the run completes, failed lines or not; 1 if the engine died on the way (or the
app process did); 2 when the input cannot be read or repeats a custom_id, or the output cannot be
written; 130 when interrupted.
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from flashserve.serve_args import BatchArgs
from flashserve.engine.engine_core import EngineCore
from flashserve.engine.prefix_pins import GroupPins
from flashserve.entrypoints.core_process import core_parts
from flashserve.entrypoints.run_batch import app as batch_app
from flashserve.entrypoints.run_batch.lines import BatchRequest, LineError, parse_line, plan_requests
from flashserve.entrypoints.run_batch.pipes import Duplex, pipe
from flashserve.entrypoints.run_batch.resume import duplicate_ids, prepare_output, remaining
from flashserve.entrypoints.stack import load_engine, served_names
from flashserve.message.codec import send

logger = logging.getLogger("flashserve")

EXIT_ENGINE_DIED = 1
EXIT_BAD_FILE = 2
EXIT_INTERRUPTED = 130


class AppProcessDied(RuntimeError):
    """The app process ended without finishing the run."""


def main(args: BatchArgs, stack: Any = None) -> int:
    """Run the batch; returns the exit code. `stack` (an `llm.EngineStack`) skips loading the
    model, for callers that hold one already; its engine leaves text to the app process for the
    run."""
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
    if not todo:  # before the model loads (a minute on a large one) and the app process starts
        had = f"{args.output_file} has a result for every line of {args.input_file}" if items else \
            f"{args.input_file} holds no request"
        print(f"flashserve run-batch: {had}; nothing to run (--overwrite starts afresh)", file=sys.stderr)
        print(batch_app.Tally().summary())
        return 0
    if resume.num_done:
        print(f"flashserve run-batch: resuming {args.output_file}: {len(items) - len(todo)} of {len(items)} lines "
              f"have results there; running the other {len(todo)} (--overwrite starts afresh)", file=sys.stderr)
    requests = [item for item in todo if isinstance(item, BatchRequest)]
    context = multiprocessing.get_context("spawn")  # never fork a process that may hold a GPU
    inbox, app_tx = pipe(context)  # app -> engine
    app_rx, outbox = pipe(context)  # engine -> app
    done_rx, done_tx = context.Pipe(duplex=False)  # the app's summary, at the end
    app = context.Process(target=batch_app.main, args=(app_rx, app_tx, done_tx), name="flashserve-run-batch-app",
                          daemon=True)
    app.start()  # it imports the app while the model loads
    for end in (app_tx, app_rx, done_tx):  # the app's ends are the app's: a pipe whose far end is gone reads EOF
        end.close()
    conn = Duplex(inbox, outbox)
    setup_sent = False
    engine_tokenizer = None  # the tokenizer a caller's engine detokenized with, given back at the end
    try:
        if stack is None:
            stack = load_engine(args.serve, detokenize=False)
        engine_tokenizer = stack.engine.tokenizer
        stack.engine.set_tokenizer(None)  # text and stop strings are the app process's
        pins: GroupPins | None = None
        member_of_line: dict[int, tuple[int, int]] = {}
        scheduler = stack.engine.scheduler
        if args.prefix_grouping and scheduler.kv_cache.enable_caching and requests:
            t0 = time.perf_counter()
            lora_ids = {lora.lora_name: lora.lora_int_id for lora in stack.engine.loras.adapters}
            batch = plan_requests(requests, stack.tokenizer, stack.page_size, stack.max_model_len, lora_ids)
            requests, member_of_line = batch.requests, batch.member_of_line()
            pins = GroupPins(scheduler.kv_cache, scheduler.prefix_cache.hasher, batch.plan, batch.prompts,
                             batch.largest_request_tokens, batch.salts, batch.lora_keys)
            logger.info("ordered %d requests by shared prefixes in %.1f s", len(requests), time.perf_counter() - t0)
        _send(conn, app, batch_app.AppSetup(
            served_model_names=served_names(args.serve, stack.loaded.name), api=args.serve.api,
            input_file=args.input_file, output_file=args.output_file, order=[r.line_no for r in requests],
            error_lines=[e.line_no for e in todo if isinstance(e, LineError)], member_of_line=member_of_line,
            num_done=len(items) - len(todo),
            max_concurrency=args.max_concurrency or 2 * stack.engine.scheduler.config.max_num_seqs,
            progress=args.progress, log_level=level,
        ))
        setup_sent = True
        parts = core_parts(stack)
        core = EngineCore(parts.engine, parts.setup, parts.compile_grammar, pins=pins)
        if not core.connect(conn):
            raise _died(app)
        dead = core.run()  # until the app is done (it closes its end) or the engine dies
        summary = _summary(done_rx, app)
    except KeyboardInterrupt:
        print(f"flashserve run-batch: interrupted; finished results are in {args.output_file}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except AppProcessDied as exc:
        print(f"flashserve run-batch: {exc}; finished results are in {args.output_file}", file=sys.stderr)
        return EXIT_ENGINE_DIED
    finally:
        if not setup_sent:  # the model did not load: the app process ends
            try:
                send(conn, None)  # type: ignore[arg-type]
            except OSError:  # it is gone already
                pass
        app.join(10)
        if app.is_alive():
            app.terminate()
        conn.close()
        done_rx.close()
        if engine_tokenizer is not None:
            stack.engine.set_tokenizer(engine_tokenizer)
    print(summary)
    return EXIT_ENGINE_DIED if dead is not None else 0


def _summary(done: Connection, app: BaseProcess) -> str:
    """The app's summary of the run, once it has written every line."""
    try:
        return done.recv()
    except (EOFError, OSError):  # it exited without one
        raise _died(app) from None


def _send(conn: Duplex, app: BaseProcess, message: Any) -> None:
    try:
        send(conn, message)
    except OSError:  # a broken pipe: the app process exited
        raise _died(app) from None


def _died(app: BaseProcess) -> AppProcessDied:
    app.join(1)
    return AppProcessDied(f"the app process exited with code {app.exitcode}")
