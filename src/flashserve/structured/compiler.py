"""Grammar specs compiled with xgrammar for one tokenizer, the compiled grammars the engine uses.

Compiling takes milliseconds to seconds depending on the schema, so it runs in worker threads (the
event loop keeps serving), results are kept in an LRU cache keyed by the spec (clients repeat the
same schema on every request), and concurrent requests with the same new spec share one
compilation. A grammar xgrammar refuses (a malformed schema, regex or grammar) becomes an
`InvalidParameter` naming the request field, so the client gets a 400 rather than a 500. The
engine only sees the `flashserve.structured.grammar` protocol.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import threading
from collections import OrderedDict
from types import ModuleType
from typing import TYPE_CHECKING, Any, Sequence

from flashserve.message.grammar_spec import GrammarSpec
from flashserve.message.sampling_params import InvalidParameter
from flashserve.structured.json_grammar import json_grammar

if TYPE_CHECKING:
    import xgrammar as xgr


def _xgr() -> ModuleType:
    """xgrammar, imported on first use: it imports torch (about 1.5 s), which an app process that
    serves no grammar never needs (run-batch's)."""
    import xgrammar

    return xgrammar


# xgrammar prefixes its errors with "[hh:mm:ss] /path/file.cc:123: " (and sometimes "Check failed").
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def _ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal matching exactly it. Control characters use \\u, which
    takes exactly four digits (xgrammar's \\x reads every hex digit that follows)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


class XGrammar:
    """A compiled grammar; the engine makes one matcher per request from it."""

    def __init__(self, spec: GrammarSpec, compiled: xgr.CompiledGrammar,
                 batch: xgr.BatchGrammarMatcher | None = None) -> None:
        self.spec = spec
        self.compiled = compiled
        self._batch = batch if batch is not None else _xgr().BatchGrammarMatcher(max_threads=1)
        # A matcher terminates when it accepts one of these (the model's EOS ids).
        self._stop_ids = frozenset(compiled.tokenizer_info.stop_token_ids)

    def new_matcher(self) -> xgr.GrammarMatcher:
        return _xgr().GrammarMatcher(self.compiled)

    def advance(self, matchers: Sequence[xgr.GrammarMatcher], token_ids: Sequence[int]) -> list[tuple[bool, bool]]:
        """Every matcher takes its token in one call (any grammars of this compiler's tokenizer)."""
        accepted = _xgr().BatchGrammarMatcher.batch_accept_token(list(matchers), list(token_ids))
        return [(ok, ok and token in self._stop_ids) for ok, token in zip(accepted, token_ids)]

    def fill_bitmasks(self, matchers: Sequence[xgr.GrammarMatcher], bitmask: Any) -> None:
        """One batched call over every row of a step (on the compiler's threads)."""
        self._batch.batch_fill_next_token_bitmask(list(matchers), bitmask)


class GrammarCompiler:
    """Compiles specs for one tokenizer and model vocabulary, with an LRU cache.

    `vocab_size` is the model's logit width (it may exceed the tokenizer's vocabulary when the
    embedding is padded); masks are ceil(vocab_size / 32) words and padding ids are never allowed.
    `num_compiles` counts compilations; `num_cache_hits` counts requests served without starting
    one (a cached grammar, or one already being compiled for another request).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], *, cache_size: int = 256,
                 max_threads: int | None = None) -> None:
        """max_threads: for compiling and for filling a step's masks (default: up to 8 cores)."""
        max_threads = max_threads or max(1, min(8, os.cpu_count() or 1))
        self.vocab_size = vocab_size
        self.tokenizer_info = _xgr().TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids) or None
        )
        # xgrammar's own cache is unbounded; ours is bounded and also shares in-flight compiles.
        self._xgr = _xgr().GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=False)
        self._batch = _xgr().BatchGrammarMatcher(max_threads=max_threads)
        self._executor = concurrent.futures.ThreadPoolExecutor(max_threads, thread_name_prefix="grammar-compile")
        self._cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, XGrammar] = OrderedDict()
        self._pending: dict[GrammarSpec, concurrent.futures.Future[XGrammar]] = {}
        self._lock = threading.Lock()
        self.num_compiles = 0
        self.num_cache_hits = 0

    async def compile(self, spec: GrammarSpec) -> XGrammar:
        """The compiled grammar for `spec`; a miss compiles in a worker thread."""
        found = self._lookup(spec)
        if isinstance(found, XGrammar):
            return found
        # Shielded: one cancelled request must not cancel a compilation others are waiting for.
        return await asyncio.shield(asyncio.wrap_future(found))

    def compile_sync(self, spec: GrammarSpec) -> XGrammar:
        """`compile` for callers without an event loop (the offline API); it blocks."""
        found = self._lookup(spec)
        return found if isinstance(found, XGrammar) else found.result()

    def submit(self, spec: GrammarSpec) -> XGrammar | concurrent.futures.Future[XGrammar]:
        """The compiled grammar for `spec` if cached, else a future of it (compiling in a worker
        thread), for a caller that must not block (the engine core's loop)."""
        return self._lookup(spec)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _lookup(self, spec: GrammarSpec) -> XGrammar | concurrent.futures.Future[XGrammar]:
        with self._lock:
            grammar = self._cache.get(spec)
            if grammar is not None:
                self._cache.move_to_end(spec)
                self.num_cache_hits += 1
                return grammar
            future = self._pending.get(spec)
            if future is not None:
                self.num_cache_hits += 1
                return future
            future = self._executor.submit(self._build, spec)
            self._pending[spec] = future
        future.add_done_callback(lambda f: self._finish(spec, f))
        return future

    def _finish(self, spec: GrammarSpec, future: concurrent.futures.Future[XGrammar]) -> None:
        """Caches a successful compile; a failed one is forgotten, so it is retried (and fails
        again with the same message) rather than cached."""
        with self._lock:
            self._pending.pop(spec, None)
            if future.cancelled() or future.exception() is not None:
                return
            self._cache[spec] = future.result()
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)

    def _build(self, spec: GrammarSpec) -> XGrammar:
        with self._lock:
            self.num_compiles += 1
        what = {"json": "JSON schema", "json_object": "JSON", "regex": "regex", "choice": "choice",
                "structural_tag": "tool parameters schema"}
        try:
            return XGrammar(spec, self._compile(spec), self._batch)
        except (RuntimeError, ValueError) as exc:
            detail = _XGR_PREFIX.sub("", str(exc).strip()).strip()
            detail = detail.split(". The JSON string is:")[0]
            raise InvalidParameter(spec.param, f"invalid {what.get(spec.kind, 'grammar')}: {detail}") from None

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        if spec.kind == "json":
            ebnf = str(_xgr().Grammar.from_json_schema(spec.value, any_whitespace=False))
            return self._xgr.compile_grammar(json_grammar(ebnf))
        if spec.kind == "structural_tag":
            return self._xgr.compile_grammar(json_grammar(str(_xgr().Grammar.from_structural_tag(spec.value))))
        if spec.kind == "json_object":
            # Any object (not any JSON value), on one line like the schema outputs.
            return self._xgr.compile_json_schema('{"type":"object"}', any_whitespace=False)
        if spec.kind == "regex":
            return self._xgr.compile_regex(spec.value)
        if spec.kind == "choice":
            choices = json.loads(spec.value)
            return self._xgr.compile_grammar("root ::= " + " | ".join(_ebnf_literal(c) for c in choices))
        if spec.kind == "grammar":
            return self._xgr.compile_grammar(spec.value)
        raise AssertionError(f"unknown grammar kind {spec.kind!r}")  # a bug, not bad input: no 400
