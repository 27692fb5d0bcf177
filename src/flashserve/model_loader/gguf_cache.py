"""A GGUF model converted once: its dequantized weights, config and tokenizer kept as an HF directory.

transformers reads a GGUF file by dequantizing every tensor and rebuilding the tokenizer from the
file's vocabulary; for the embedded SmolLM2-135M that is about 21 s of a 26 s start on 2 cores
(weights 14 s, tokenizer 7 s), every start. The first load keeps what it built here
(`model.safetensors` in the loaded dtype, the tokenizer's files, and the GGUF's own config and
generation config), and later loads read that directory instead: the same tensors, bit for bit,
in about a second.

An entry is named by the GGUF file's absolute path, size and modification time, the transformers
version that converted it, and this format's version; a changed file or library gets a new entry.
Each entry records its source (`source.json`), and keeping a new one removes the entries it
supersedes: those of the same file and dtype under another name (the file or the library changed)
and those whose file is gone (a deleted checkout or virtual environment), so that the directory
holds about one converted copy per installed GGUF rather than one per install ever made. It is
written into a temporary directory and renamed into place, so that a reader never sees half of one
and two processes converting at once both succeed (one rename wins). The directory is
`$FLASHSERVE_CACHE_DIR/gguf` (default `~/.cache/flashserve/gguf`, or under `$XDG_CACHE_HOME`);
`FLASHSERVE_CACHE_DIR=off` turns the cache off. Where it cannot be written, the model loads as
before and a warning says why.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from typing import Any

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
OFF = "off"
SOURCE = "source.json"


def cache_root() -> str | None:
    """The cache's directory, or None when it is turned off."""
    root = os.environ.get("FLASHSERVE_CACHE_DIR")
    if root is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "flashserve")
    if root.strip().lower() in (OFF, ""):
        return None
    return os.path.join(root, "gguf")


def entry_path(gguf_path: str, dtype: Any) -> str | None:
    """Where the converted `gguf_path` (loaded as `dtype`) is kept, or None when the cache is off."""
    located = _locate(gguf_path, dtype)
    return None if located is None else located[0]


def _locate(gguf_path: str, dtype: Any) -> tuple[str, dict[str, Any]] | None:
    """The entry of `gguf_path` as `dtype` and what it is converted from (the fields of its name,
    kept beside it as `source.json`), or None when the cache is off."""
    root = cache_root()
    if root is None:
        return None
    import transformers

    path = os.path.abspath(gguf_path)
    stat = os.stat(path)
    source = {"path": path, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "dtype": str(dtype),
              "transformers": transformers.__version__, "format": FORMAT_VERSION}
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}|transformers {transformers.__version__}|v{FORMAT_VERSION}"
    name = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(root, f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"), source


def lookup(gguf_path: str, dtype: Any) -> str | None:
    """The converted directory of `gguf_path`, if one is complete."""
    entry = entry_path(gguf_path, dtype)
    if entry is None or not os.path.isfile(os.path.join(entry, "model.safetensors")):
        return None
    return entry


def store(gguf_path: str, dtype: Any, model: Any, hf_config: Any, tokenizer: Any | None) -> str | None:
    """Keeps what a GGUF load built; returns the entry, or None when the cache is off or unwritable."""
    located = _locate(gguf_path, dtype)
    if located is None:
        return None
    entry, source = located
    if os.path.isdir(entry):
        return entry
    parent = os.path.dirname(entry)
    tmp = None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".converting-", dir=parent)
        # transformers will not save_pretrained a model it loaded from GGUF: the tensors go out by
        # safetensors (tied ones once; from_pretrained ties them again), the configs on their own.
        from safetensors.torch import save_model

        save_model(model, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        hf_config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, SOURCE), "w") as f:
            json.dump(source, f)
        os.rename(tmp, entry)
        tmp = None
        logger.info("kept the converted %s in %s: later loads read it", os.path.basename(gguf_path), entry)
        _remove_superseded(parent, entry, source)
    except Exception as exc:  # a cache must never fail a load
        if not os.path.isdir(entry):  # else another process put it there first
            logger.warning("could not keep the converted %s in %s (%s); each load converts it again "
                           "(FLASHSERVE_CACHE_DIR picks another directory)", os.path.basename(gguf_path), parent, exc)
            return None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return entry


def _remove_superseded(root: str, kept: str, source: dict[str, Any]) -> None:
    """Removes the entries under `root` that `kept` (converted from `source`) supersedes: another
    entry of the same file and dtype, and any entry whose GGUF file no longer exists. Entries
    without a `source.json` and half-written ones (a leading dot) are left alone."""
    for name in os.listdir(root):
        entry = os.path.join(root, name)
        if name.startswith(".") or entry == kept:
            continue
        try:
            with open(os.path.join(entry, SOURCE)) as f:
                other = json.load(f)
            gone = not os.path.exists(other["path"])
            same = other["path"] == source["path"] and other["dtype"] == source["dtype"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if gone or same:
            shutil.rmtree(entry, ignore_errors=True)
            logger.info("removed the converted copy %s: %s", entry,
                        "its GGUF file is gone" if gone else "a newer conversion of its file replaces it")
