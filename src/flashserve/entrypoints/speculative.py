"""Start-up checks of `--speculative-config` that need the models' configs: run before any weights
load, so that a bad configuration stops the start with a clear error and nothing half started."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from flashserve.spec_decode.config import SpeculativeConfig

logger = logging.getLogger(__name__)


def _vocab_size(model: Any) -> int:
    """The vocabulary of a model config (`config.ModelConfig`), read from its config file only."""
    import torch

    from flashserve.model_loader.dummy import dummy_hf_config
    from flashserve.model_loader.hf import read_config
    from flashserve.model_loader.loader import locate

    source = locate(model, torch.device("cpu"))
    hf_config = dummy_hf_config(source.path) if source.dummy else read_config(source.path, model, source.gguf_file)
    text = getattr(hf_config, "text_config", None) or hf_config
    return int(text.vocab_size)


def check_speculative(spec: SpeculativeConfig, target: Any) -> None:
    """Raises ValueError for a configuration that cannot run with the target model (`ModelConfig`):
    a draft model with another vocabulary, or a method not built yet."""
    if spec.method == "draft_model":
        draft = replace(target, model=spec.model or "")
        try:
            draft_vocab = _vocab_size(draft)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--speculative-config: cannot read the draft model {spec.model!r}: {exc}") from None
        target_vocab = _vocab_size(target)
        if draft_vocab != target_vocab:
            raise ValueError(
                f"--speculative-config: the draft model {spec.model!r} has a vocabulary of {draft_vocab} tokens, "
                f"the target model {target.model or 'the embedded model'!r} one of {target_vocab}: a draft model "
                "must share the target's vocabulary")
    logger.info("%s", spec.describe())
