"""The front end's half of a request's outputs: token ids from the engine core in, text out.

Each request has an incremental detokenizer, which also finds its stop strings. An output in which
a stop string appears is turned into the request's last ("stop") output here, and the caller tells
the engine core to abort the request, which frees its pages: the engine may run a step or two more
for it meanwhile, and those outputs find no stream. The rules are the in-process engine's
(`engine/llm_engine.py`): the output keeps all its token ids, its text ends before the stop string, and
a request that ends otherwise gets what its detokenizer still held.
"""

from __future__ import annotations

import logging
from typing import Any

from flashserve.detokenizer import IncrementalDetokenizer, raw_decoder
from flashserve.message.outputs import RequestOutput
from flashserve.message.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class OutputProcessor:
    """Detokenizers of one front end's open requests (event-loop only). Without a tokenizer,
    outputs pass through untouched (no text, no stop strings), as the engine's do."""

    def __init__(self, tokenizer: Any | None) -> None:
        self._tokenizer = tokenizer
        self._decode = raw_decoder(tokenizer) if tokenizer is not None else None
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if self._tokenizer is not None:
            self._detokenizers[request_id] = IncrementalDetokenizer(
                self._tokenizer, prompt_token_ids, params, self._decode)

    def discard(self, request_id: str) -> None:
        self._detokenizers.pop(request_id, None)

    def process(self, out: RequestOutput) -> bool:
        """Fills `out.new_text`; True when this output ends a request that the engine still runs
        (a stop string, or a detokenizer that failed), which the caller then aborts there."""
        detok = self._detokenizers.get(out.request_id)
        if detok is None:
            return False
        ended_here = False
        try:
            pieces = []
            for token_id in out.new_token_ids:
                pieces.append(detok.add(token_id))
                if detok.stopped:
                    break
            if detok.stopped:
                ended_here = not out.finished
                out.finished, out.finish_reason = True, "stop"
            elif out.finished and out.finish_reason != "abort":
                pieces.append(detok.flush())
            out.new_text = "".join(pieces)
        except Exception as exc:  # a failed request fails alone
            logger.exception("detokenizing request %s failed", out.request_id)
            ended_here = not out.finished
            out.finished, out.finish_reason = True, "error"
            out.error = f"detokenization failed: {exc}"
        if out.finished:
            del self._detokenizers[out.request_id]
        return ended_here
