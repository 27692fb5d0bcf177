"""xgrammar's EBNF of a JSON schema, rewritten before it compiles (`json_grammar`): strings hold
only what JSON allows unescaped, length-bounded strings become chains of rules whose masks are
precomputed, and numbers are bounded to what their type can hold. Each rewrite works around an
xgrammar (0.2.8) behaviour named in its docstring; other grammars come back unchanged.
"""

from __future__ import annotations

import re

# xgrammar's form of a JSON string with maxLength: `"\"" <chars>{min, max} "\""`.
_BOUNDED_STRING = re.compile(r'"\\"" (\w+)\{(\d+), (\d+)\} "\\""')
# Longer bounds stay as xgrammar writes them: an unrolled string compiles one rule per character.
_UNROLL_MAX_LENGTH = 256
# xgrammar's character of a string with minLength or maxLength (`<name>_characters ::= ...`), and
# a JSON string's unescaped character, as its own free strings (`basic_string_sub`) have it.
_BOUNDED_CHARACTER = re.compile(r"^(\w+) ::= " + re.escape(r'(([^\"\\\r\n]))') + "$", re.MULTILINE)
_JSON_CHARACTER = r'[^\0-\x1f\"\\\r\n]'
# Numbers in xgrammar's JSON grammars: unbounded digit runs, which a small model can fill until
# max_tokens ("11111..."). A digit rule (`name ::= (([0-9]))`), its open-ended repetitions, the
# exponent's among them, and the free digits after a number's first.
_DIGIT_RULE = re.compile(r"^(\w+) ::= \(\(\[0-9\]\)\)$", re.MULTILINE)
_OPEN_REPEAT = re.compile(r"(\[eE\] \w+ )?\b(\w+)\{(\d+), -1\}")
_FREE_DIGITS = "[1-9] [0-9]*"
# At most 19 digits before the point (an int64's), 17 after it (a double's significant digits), 3
# in an exponent.
MAX_INTEGER_DIGITS, MAX_FRACTION_DIGITS, MAX_EXPONENT_DIGITS = 19, 17, 3


def json_string_characters(ebnf: str) -> str:
    """xgrammar's EBNF for a JSON schema with the characters of its length-bounded strings
    (minLength, maxLength) limited to those JSON allows unescaped in a string.

    xgrammar (0.2.8, its issue #800) lets such a character be anything but a quote, a backslash,
    CR or LF, so the other control characters (U+0000-U+001F) get in: a model that samples a raw
    tab inside a bounded string ends its grammar with text that `json.loads` rejects. The bounds
    count characters as before; other grammars come back unchanged.
    """
    return _BOUNDED_CHARACTER.sub(lambda m: f"{m.group(1)} ::= {_JSON_CHARACTER}", ebnf)


def unroll_bounded_strings(ebnf: str) -> str:
    """xgrammar's EBNF for a JSON schema with each length-bounded string (maxLength <= 256) as a
    chain of rules, one per character count, each ending the string or taking one more character.

    The same language, but xgrammar (0.2.8, its issue #852) fills the token mask inside a counted
    repetition by walking the vocabulary at every step, up to ~10 ms a row near the bound on a
    128k vocabulary, while each rule of the chain gets its mask precomputed at compile time
    (~0.02 ms). Other grammars come back unchanged.
    """
    rules: list[str] = []

    def chain(match: re.Match[str]) -> str:
        body, low, high = match.group(1), int(match.group(2)), int(match.group(3))
        if high > _UNROLL_MAX_LENGTH:
            return match.group(0)
        name = f"{body}_bounded_{len(rules)}"
        for count in range(high + 1):
            ends = ['"\\""'] if count >= low else []
            more = [f"{body} {name}_{count + 1}"] if count < high else []
            rules.append(f"{name}_{count} ::= " + " | ".join(ends + more))
        return f'"\\"" {name}_0'

    out = _BOUNDED_STRING.sub(chain, ebnf)
    return out + "\n" + "\n".join(rules) + "\n" if rules else ebnf


def _digits(low: int, high: int) -> str:
    """EBNF for `low` to `high` digits, the optional ones nested (`[0-9] ([0-9])?`): a chain of
    rules with masks precomputed at compile time, unlike a counted repetition (see
    `unroll_bounded_strings`)."""
    optional = ""
    for _ in range(high - low):
        optional = f"([0-9] {optional})?" if optional else "([0-9])?"
    return " ".join(["[0-9]"] * low + ([optional] if optional else [])) or '""'


def bound_numbers(ebnf: str) -> str:
    """xgrammar's EBNF for a JSON schema with every number bounded to what its type can hold: at
    most MAX_INTEGER_DIGITS digits before the point, MAX_FRACTION_DIGITS after it and
    MAX_EXPONENT_DIGITS in an exponent, where the schema's minimum and maximum do not bound it
    already. xgrammar (0.2.8) lets digits run on, and a model that keeps writing them ends only at
    max_tokens, with no JSON at all."""
    digit_rules = set(_DIGIT_RULE.findall(ebnf))

    def repeat(match: re.Match[str]) -> str:
        exponent, name, low = match.group(1), match.group(2), int(match.group(3))
        if name not in digit_rules:
            return match.group(0)
        high = MAX_EXPONENT_DIGITS if exponent else MAX_FRACTION_DIGITS
        return f"{exponent or ''}{_digits(low, max(low, high))}"

    ebnf = _OPEN_REPEAT.sub(repeat, ebnf)
    return ebnf.replace(_FREE_DIGITS, f"[1-9] {_digits(0, MAX_INTEGER_DIGITS - 1)}")


def json_grammar(ebnf: str) -> str:
    """xgrammar's EBNF of a JSON schema as this server compiles it: strings hold only what JSON
    allows, length-bounded strings are unrolled, numbers are bounded."""
    return bound_numbers(unroll_bounded_strings(json_string_characters(ebnf)))
