"""A request's grammar as it travels: what the API layer builds (`structured/specs.py`) and the engine
core compiles (`structured/compiler.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GrammarKind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]


@dataclass(frozen=True)
class GrammarSpec:
    """What the output must match; hashable, as it is the compile cache key.

    `value` is the schema serialized (json), "" (json_object), the pattern (regex), a JSON list of
    the strings (choice) or EBNF text (grammar). `param` is the request field it came from.
    """

    kind: GrammarKind
    value: str
    param: str
