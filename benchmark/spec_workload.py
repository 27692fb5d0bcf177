"""An input-grounded chat workload for speculative decoding: edits and quotes of a given text.

The answers a user wants from "fix the spelling in this paragraph", "rename this variable in this
function" or "answer with quotes from this passage" copy most of their tokens from the prompt, the
case where n-gram prompt lookup (and a draft model) pays. The texts come from Python's own standard
library (docstrings and function source, parsed from its source files with `ast` rather than read
from live objects, which other imports may patch), so every machine that runs the benchmark has
them; the choice is fixed by a seed. The exact texts follow the Python version (its docstrings
change between releases), which the benchmark records.

    python -m benchmark.spec_workload [--per-kind 2] [--seed 0]     # prints the prompts

Each prompt is chat messages (for the model's chat template), a `max_tokens` that lets the whole
answer out, and the answer a perfect model would give (`reference`), for a look at the outputs.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import functools
import importlib.util
import io
import json
import random
import re
import sys
import textwrap
import tokenize
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Literal

Kind = Literal["spelling", "rename", "quote"]
KINDS: tuple[Kind, ...] = ("spelling", "rename", "quote")

# Pure-Python standard library modules whose docstrings and functions are prose and plain code.
MODULES: tuple[str, ...] = (
    "argparse", "ast", "bisect", "calendar", "configparser", "contextlib", "copy", "csv", "dataclasses",
    "difflib", "email.utils", "enum", "fnmatch", "fractions", "ftplib", "functools", "gettext", "glob",
    "gzip", "heapq", "hmac", "html", "imaplib", "inspect", "ipaddress", "json", "json.decoder", "locale",
    "logging", "mailbox", "mimetypes", "netrc", "pathlib", "pickle", "pprint", "queue", "quopri", "random",
    "sched", "secrets", "shlex", "shutil", "smtplib", "statistics", "string", "subprocess", "tarfile",
    "tempfile", "textwrap", "threading", "tokenize", "traceback", "typing", "urllib.parse",
    "urllib.request", "uuid", "warnings", "wave", "weakref", "zipfile",
)  # fmt: skip

# Names a rename gives a variable (the first that the function does not already use).
NEW_NAMES: tuple[str, ...] = ("item", "value", "entry", "record", "current", "chunk", "element", "payload",
                              "target", "subject", "holder", "operand")  # fmt: skip

SPELLING_ASK = "Fix the spelling mistakes in this paragraph. Reply with the corrected paragraph only.\n\n{text}"
RENAME_ASK = ("Rename the variable `{old}` to `{new}` in this Python function. Reply with the whole function "
              "only.\n\n```python\n{source}```")
QUOTE_ASK = ('Answer with quotes from this passage: what does it say about "{word}"? Quote each sentence that '
             "mentions it word for word.\n\n{text}")


@dataclass(frozen=True)
class SpecPrompt:
    """One request: `messages` for the chat template, `max_tokens` room for the whole answer."""

    kind: Kind
    source: str  # where the text comes from: module.qualname
    messages: list[dict[str, str]]
    max_tokens: int
    reference: str  # what a perfect answer says

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def build_workload(per_kind: int = 2, seed: int = 0, max_tokens: int = 256) -> list[SpecPrompt]:
    """`per_kind` prompts of each kind, kinds interleaved (spelling, rename, quote, spelling, ...).

    The same seed on the same Python version gives the same prompts. A prompt's `max_tokens` is
    about its answer's length in tokens plus some room; texts whose answer would need more than
    `max_tokens` are passed over, so that no answer is cut.
    """
    docs, functions = _paragraphs(), _functions()
    made: dict[Kind, list[SpecPrompt]] = {}
    makers: dict[Kind, tuple[list[Any], Callable[[Any, random.Random], SpecPrompt | None]]] = {
        "spelling": ([p for p in docs if 40 <= _words(p[1]) <= 90], _spelling),
        "rename": (list(functions), _rename),
        "quote": ([p for p in docs if 70 <= _words(p[1]) <= 160 and len(_sentences(p[1])) >= 3], _quote),
    }
    for kind, (pool, make) in makers.items():
        # A generator per kind: the first n prompts of a kind are the same for any per_kind >= n.
        rng = random.Random(f"{seed}/{kind}")
        order = list(range(len(pool)))
        rng.shuffle(order)
        made[kind] = []
        for i in order:
            if len(made[kind]) == per_kind:
                break
            if (prompt := make(pool[i], rng)) is not None and prompt.max_tokens <= max_tokens:
                made[kind].append(prompt)
        if len(made[kind]) < per_kind:
            raise ValueError(f"only {len(made[kind])} {kind} prompts in the standard library's texts")
    return [p for group in zip(*(made[kind] for kind in KINDS)) for p in group]


def _budget(answer: str) -> int:
    """Tokens for an answer of this length: about 3.5 characters a token in English and code, plus room."""
    return len(answer) * 2 // 7 + 48


def _words(text: str) -> int:
    return len(text.split())


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


def _definitions() -> Iterator[tuple[str, ast.AST, list[str]]]:
    """(module.qualname, node, the module's source lines) of each module, its public functions and
    classes and their methods, in file order. Read from the source files, not the live objects, so
    that nothing imported beforehand (which may patch a module) changes the workload."""
    for name in MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue  # a module some builds leave out
        with open(spec.origin, encoding="utf-8") as f:
            source = f.read()
        tree = ast.parse(source)
        lines = source.splitlines(keepends=True)
        yield name, tree, lines
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                yield f"{name}.{node.name}", node, lines
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                for method in node.body:
                    if isinstance(method, ast.FunctionDef) and not method.name.startswith("__"):
                        yield f"{name}.{node.name}.{method.name}", method, lines


@functools.cache  # the files do not change while the process runs
def _paragraphs() -> tuple[tuple[str, str], ...]:
    """(source, paragraph) of prose in docstrings: no code, tables or lists; one line of text each."""
    out, seen = [], set()
    for where, node, _ in _definitions():
        assert isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef))
        for block in (ast.get_docstring(node) or "").split("\n\n"):
            lines = block.splitlines()
            if not lines or any(line.startswith((" ", ">>>", "-", "*", "|", "=", ":")) for line in lines):
                continue
            text = " ".join(line.strip() for line in lines)
            letters = sum(c.isalpha() or c.isspace() for c in text)
            if letters < 0.9 * len(text) or not text.endswith(".") or text in seen:
                continue
            seen.add(text)
            out.append((where, text))
    return tuple(out)


@functools.cache
def _functions() -> tuple[tuple[str, str], ...]:
    """(source, code) of plain functions of 8 to 30 lines (docstrings dropped: the answer is code)."""
    out = []
    for where, node, lines in _definitions():
        if not isinstance(node, ast.FunctionDef) or node.decorator_list:
            continue
        code = _without_docstring(textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno])))
        if code is not None and 8 <= len(code.splitlines()) <= 30 and "\t" not in code:
            out.append((where, code))
    return tuple(out)


def _without_docstring(code: str) -> str | None:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    fn = tree.body[0]
    if not isinstance(fn, ast.FunctionDef) or fn.decorator_list:
        return None
    body = fn.body
    lines = code.splitlines(keepends=True)
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        if len(body) == 1:
            return None
        lines = lines[: body[0].lineno - 1] + lines[body[0].end_lineno:]
    return "".join(lines)


def _misspelled(word: str, rng: random.Random) -> str:
    """A typo a person makes: two neighbouring inner letters swapped, one dropped or one doubled."""
    i = rng.randrange(1, len(word) - 2)
    how = rng.choice(("swap", "drop", "double"))
    if how == "swap" and word[i] != word[i + 1]:
        return word[:i] + word[i + 1] + word[i] + word[i + 2:]
    if how == "drop":
        return word[:i] + word[i + 1:]
    return word[: i + 1] + word[i] + word[i + 1:]


def _spelling(item: tuple[str, str], rng: random.Random) -> SpecPrompt | None:
    where, text = item
    words = text.split(" ")
    candidates = [i for i, w in enumerate(words) if w.isalpha() and w.islower() and len(w) >= 6]
    if len(candidates) < 4:
        return None
    for i in rng.sample(candidates, min(len(candidates), rng.choice((3, 4)))):
        words[i] = _misspelled(words[i], rng)
    ask = SPELLING_ASK.format(text=" ".join(words))
    return SpecPrompt("spelling", where, [{"role": "user", "content": ask}], _budget(text), text)


def _names(code: str) -> list[tuple[str, int]]:
    """The function's parameters and local variables of 3+ characters, with their number of uses."""
    fn = ast.parse(code).body[0]
    assert isinstance(fn, ast.FunctionDef)
    params = {a.arg for a in fn.args.args + fn.args.kwonlyargs} - {"self", "cls"}
    assigned = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    uses: dict[str, int] = {}
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.NAME and tok.string in params | assigned:
            uses[tok.string] = uses.get(tok.string, 0) + 1
    return sorted((n, c) for n, c in uses.items() if len(n) >= 3 and not hasattr(builtins, n))


def _renamed(code: str, old: str, new: str) -> str:
    """`code` with the variable `old` written `new` wherever it is a name or a parameter (attributes,
    a callee's keywords and strings keep theirs)."""
    tree = ast.parse(code)
    spots = [(n.lineno, n.col_offset) for n in ast.walk(tree)
             if (isinstance(n, ast.Name) and n.id == old) or (isinstance(n, ast.arg) and n.arg == old)]
    lines = code.splitlines(keepends=True)
    for row, col in sorted(spots, reverse=True):  # right to left keeps the earlier offsets valid
        raw = lines[row - 1].encode()  # ast's offsets count UTF-8 bytes
        lines[row - 1] = (raw[:col] + new.encode() + raw[col + len(old.encode()):]).decode()
    return "".join(lines)


def _rename(item: tuple[str, str], rng: random.Random) -> SpecPrompt | None:
    where, code = item
    names = [n for n, uses in _names(code) if uses >= 3]
    if not names:
        return None
    old = rng.choice(names)
    new = next((n for n in NEW_NAMES if not re.search(rf"\b{n}\b", code)), None)
    if new is None:
        return None
    reference = _renamed(code, old, new)
    ask = RENAME_ASK.format(old=old, new=new, source=code)
    return SpecPrompt("rename", where, [{"role": "user", "content": ask}], _budget(reference), reference)


def _quote(item: tuple[str, str], rng: random.Random) -> SpecPrompt | None:
    where, text = item
    sentences = _sentences(text)
    counts: dict[str, int] = {}
    for s in sentences:
        for w in set(re.findall(r"[a-z]{6,}", s)):
            counts[w] = counts.get(w, 0) + 1
    words = sorted(w for w, c in counts.items() if c <= 2 and w not in ("should", "return", "returns", "which"))
    if not words:
        return None
    word = rng.choice(words)
    quoted = [s for s in sentences if re.search(rf"\b{word}\b", s)]
    if not quoted:
        return None
    reference = " ".join(f'"{s}"' for s in quoted)
    ask = QUOTE_ASK.format(word=word, text=text)
    return SpecPrompt("quote", where, [{"role": "user", "content": ask}], _budget(reference) + 32, reference)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.spec_workload", description=__doc__.split("\n\n")[0])
    p.add_argument("--per-kind", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--json", action="store_true", help="one JSON object a line instead of the readable form")
    args = p.parse_args(argv)
    prompts = build_workload(args.per_kind, args.seed, args.max_tokens)
    for prompt in prompts:
        if args.json:
            print(json.dumps(prompt.to_json()))
        else:
            print(f"### {prompt.kind} ({prompt.source}, max_tokens {prompt.max_tokens})\n{prompt.messages[0]['content']}\n")
    print(f"# Python {sys.version.split()[0]}, seed {args.seed}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
