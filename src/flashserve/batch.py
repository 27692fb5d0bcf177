"""`flashserve run-batch -i requests.jsonl -o results.jsonl`: an OpenAI Batch API file, offline.

Every line goes through the server's own app in-process (`batch_lines.post`), so its result line
holds exactly the status code and body that `flashserve serve` would answer, errors included; a
line that is no request at all (bad JSON, no custom_id, a method or url the batch API does not
take) gets an error line instead, and the run goes on. Up to `--max-concurrency` requests are in
flight at once, so the engine batches continuously; they are submitted in prefix-sharing order
(`engine/prefix_groups.py`) unless `--no-prefix-grouping`. Result lines are written and flushed
as requests finish, so an interrupted run keeps every finished result.

Exit code 0 when the run completes, failed lines or not; 1 if the engine died on the way; 2 when
the input cannot be read or the output cannot be written; 130 when interrupted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any

from flashserve.batch_lines import BatchRequest, LineError, error_line, order_requests, parse_line, post, result_line
from flashserve.cli import BatchArgs
from flashserve.server_stack import build_server, load_engine

logger = logging.getLogger("flashserve")

EXIT_ENGINE_DIED = 1
EXIT_BAD_FILE = 2
EXIT_INTERRUPTED = 130


@dataclass
class Tally:
    """What the result lines add up to, for the progress bar and the summary."""

    num_ok: int = 0
    num_failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    start: float = field(default_factory=time.perf_counter)

    def add(self, line: dict[str, Any]) -> None:
        response = line["response"]
        if response is None or response["status_code"] != 200:
            self.num_failed += 1
            return
        self.num_ok += 1
        body = response["body"]
        usage = (body.get("usage") if isinstance(body, dict) else None) or {}
        self.prompt_tokens += usage.get("prompt_tokens", 0)
        self.completion_tokens += usage.get("completion_tokens", 0)
        self.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    def summary(self) -> str:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        total = self.num_ok + self.num_failed
        computed = self.prompt_tokens - self.cached_tokens
        return "\n".join((
            f"requests: {self.num_ok} ok, {self.num_failed} failed, {total} in {elapsed:.1f} s "
            f"({total / elapsed:.2f} requests/s)",
            f"tokens: {self.prompt_tokens} prompt ({computed} computed, {self.cached_tokens} from the prefix "
            f"cache), {self.completion_tokens} completion",
            f"throughput: {self.completion_tokens / elapsed:.1f} completion tokens/s, "
            f"{(self.prompt_tokens + self.completion_tokens) / elapsed:.1f} total tokens/s",
        ))


def main(args: BatchArgs, stack: Any = None) -> int:
    """Run the batch; returns the exit code. `stack` (an `llm.EngineStack`) skips loading the
    model, for callers that hold one already."""
    level = args.serve.server.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level != "DEBUG":  # one log line per request would bury the progress bar
        logging.getLogger("flashserve.requests").setLevel(logging.WARNING)
    try:
        with open(args.input_file, encoding="utf-8") as f:
            texts = f.readlines()
    except (OSError, UnicodeDecodeError) as exc:
        print(f"flashserve run-batch: cannot read {args.input_file}: {exc}", file=sys.stderr)
        return EXIT_BAD_FILE
    items = [parse_line(text, n) for n, text in enumerate(texts, 1) if text.strip()]
    errors = [item for item in items if isinstance(item, LineError)]
    requests = [item for item in items if isinstance(item, BatchRequest)]
    try:
        out = open(args.output_file, "w", encoding="utf-8")
    except OSError as exc:
        print(f"flashserve run-batch: cannot write {args.output_file}: {exc}", file=sys.stderr)
        return EXIT_BAD_FILE
    with out:
        if stack is None:
            stack = load_engine(args.serve)
        server = build_server(args.serve, stack)
        if args.prefix_grouping and stack.engine.scheduler.kv_cache.enable_caching and requests:
            t0 = time.perf_counter()
            requests = order_requests(requests, stack.tokenizer, stack.page_size, stack.max_model_len)
            logger.info("ordered %d requests by shared prefixes in %.1f s", len(requests), time.perf_counter() - t0)
        try:
            tally = asyncio.run(_run(server, errors, requests, out, args))
        except KeyboardInterrupt:
            print(f"flashserve run-batch: interrupted; finished results are in {args.output_file}", file=sys.stderr)
            return EXIT_INTERRUPTED
    print(tally.summary())
    return EXIT_ENGINE_DIED if server.engine.dead_reason is not None else 0


async def _run(server: Any, errors: list[LineError], requests: list[BatchRequest], out: IO[str],
               args: BatchArgs) -> Tally:
    tally = Tally()
    bar = _progress_bar(len(errors) + len(requests), args.progress)
    last_postfix = 0.0

    def write(line: dict[str, Any]) -> None:
        nonlocal last_postfix
        out.write(json.dumps(line, ensure_ascii=False) + "\n")
        out.flush()
        tally.add(line)
        if bar is None:
            return
        bar.update(1)
        now = time.perf_counter()
        if now - last_postfix > 0.5:
            last_postfix = now
            bar.set_postfix_str(f"{tally.completion_tokens / max(now - tally.start, 1e-9):.0f} tok/s", refresh=False)

    for error in errors:
        write(error_line(error))
    slots = asyncio.Semaphore(args.max_concurrency or 2 * server.engine.engine.scheduler.config.max_num_seqs)
    pending: set[asyncio.Task[None]] = set()

    async def one(request: BatchRequest) -> None:
        try:
            status, request_id, body = await post(server.app, request.url, request.payload)
        except Exception as exc:  # the app gave no answer at all: this line fails alone
            logger.exception("request %s failed", request.custom_id)
            write(error_line(LineError(request.line_no, request.custom_id, "internal_error", str(exc))))
        else:
            write(result_line(request.custom_id, status, request_id, body))
        finally:
            slots.release()

    server.engine.start()
    try:
        for request in requests:  # in submission order: a task starts only when a slot is free
            await slots.acquire()
            task = asyncio.create_task(one(request))
            pending.add(task)
            task.add_done_callback(pending.discard)
        await asyncio.gather(*pending)
    finally:
        for task in pending:
            task.cancel()
        server.engine.shutdown()
        if bar is not None:
            rate = tally.completion_tokens / max(time.perf_counter() - tally.start, 1e-9)
            bar.set_postfix_str(f"{rate:.0f} tok/s", refresh=False)
            bar.close()
    return tally


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # a dependency of transformers, so normally present
        return None
    return tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True, desc="run-batch")
