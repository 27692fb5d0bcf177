"""When a request stops: the one place that decides, for every rule (vLLM's `check_stop`).

The rules, in order of precedence: the end of the request's grammar, a stop string (found by the
detokenizer, which reports it here), EOS or a stop token id (once min_tokens outputs exist), and
the length limits. The sampler only keeps EOS and stop ids from being drawn before min_tokens; it
decides nothing.
"""

from __future__ import annotations

from flashserve.engine.request import FinishReason, Request


def check_stop(request: Request, max_model_len: int, stop_string: bool = False) -> FinishReason | None:
    """Why `request` ends after its newest output token (and, with `stop_string`, a stop string
    found in its text so far), or None while it goes on."""
    if request.grammar_done:
        return FinishReason.STOP  # the grammar accepted its end (a stop token)
    if stop_string:
        return FinishReason.STOP
    params = request.params
    token = request.output_token_ids[-1] if request.output_token_ids else None
    # The sampler masks EOS and stop ids until min_tokens tokens exist; the token that may stop is
    # the one after them, so stopping needs more than min_tokens outputs.
    if token is not None and request.num_output_tokens > params.min_tokens:
        if token in params.stop_token_ids or (not params.ignore_eos and token in params.eos_token_ids):
            return FinishReason.STOP  # before LENGTH: the model ended on its own
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
