"""Command-line helpers shared by ``jmem estimate`` and ``jmem finetune``: a parser whose
usage errors are one line, argparse types that name what they expect, and the one-line
error a bad input becomes (argparse's own conventions, as ``python -m jmem`` uses them)."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import math
import re
from typing import Any
from typing import Callable
from typing import Sequence

from jmem._src.planner.ledger import parse_memory


class CliError(ValueError):
    """A bad input: a command prints ``error: <message>`` on one line and exits with status
    2. A ``ValueError``, so Python callers of ``jmem.finetune.run`` catch it as one."""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line, ``error: ...``, status 2."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def number(kind: type, ok: Callable[[Any], bool], what: str) -> Callable[[str], Any]:
    """An argparse type: ``kind(text)`` that satisfies ``ok``, else a message naming ``what``."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    return parse


def int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    """An argparse type: an int >= ``minimum`` (``what`` names the set in errors)."""
    return number(int, lambda v: v >= minimum, what)


#: argparse types: an int >= 1, an int >= 0, a finite float > 0, a float >= 0, [0, 1).
positive_int = int_at_least(1, "a positive integer")
nonnegative_int = int_at_least(0, "an integer >= 0")
positive_float = number(float, lambda v: v > 0 and math.isfinite(v), "a positive number")
nonnegative_float = number(float, lambda v: v >= 0 and math.isfinite(v), "a number >= 0")
fraction = number(float, lambda v: 0 <= v < 1, "a fraction in [0, 1)")


def regex(text: str) -> str:
    """An argparse type: a valid regular expression."""
    try:
        re.compile(text)
    except (re.error, TypeError) as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a valid regex ({e})") from None
    return text


def memory(allow_zero: bool) -> Callable[[str], int]:
    """argparse type: bytes from ``24GB``, ``24GiB``, ``80G`` (``planner.parse_memory``)."""

    def parse(text: str) -> int:
        if allow_zero and re.fullmatch(r"\s*0+(\.0*)?\s*[A-Za-z]*\s*", text):
            return 0
        try:
            return parse_memory(text)
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e).rstrip(".")) from None

    return parse


def choices_list(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """argparse type: a non-empty comma list of names from ``allowed``."""

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"{', '.join(bad) or repr(text)} is not one of {', '.join(allowed)} (a comma list)"
            )
        return names

    return parse


def did_you_mean(name: str, names: Sequence[str]) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``names``, or ``""``."""
    close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.6)
    if not close:
        close = [n for n in names if n.replace("_", "") == name.replace("-", "").replace("_", "")]
    return f" (did you mean {close[0]!r}?)" if close else ""


def one_line(e: BaseException) -> str:
    """The message of ``e`` on one line (its type name when it has none)."""
    return " ".join(str(e).split()) or type(e).__name__


@contextlib.contextmanager
def user_input(what: str, errors=(OSError, ValueError)):
    """Turns ``errors`` raised while reading ``what`` (a flag and its value) into a CliError."""
    try:
        yield
    except CliError:
        raise
    except errors as e:
        raise CliError(f"{what}: {one_line(e)}") from e
