"""Command-line helpers shared by ``jmem estimate`` and ``jmem finetune``: a parser whose
usage errors are one line, argparse types that name what they expect, and the one-line
error a bad input becomes (argparse's own conventions, as ``python -m jmem`` uses them)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import math
import re
from typing import Any
from typing import Callable
from typing import Sequence

from jmem._src.units import parse_memory


class CliError(ValueError):
    """A bad input: a command prints ``error: <message>`` on one line and exits with status
    2. A ``ValueError``, so Python callers of ``jmem.finetune.run`` catch it as one."""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line, ``error: ...``, status 2; no
    abbreviated flags (``--lora-r`` is not ``--lora-rank``), and an unknown flag is named
    with the closest real one (``unknown_flag_hints`` adds a word for a given flag)."""

    #: Unknown flag -> what to say about it besides the closest real flag.
    unknown_flag_hints: dict[str, str] = {}

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(self.unknown_message(extras, namespace))
        return namespace

    def flags(self, namespace=None) -> list[str]:
        """Every long flag of this parser and of the subcommand ``namespace`` chose."""
        out = [s for s in self._option_string_actions if s.startswith("--")]
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and namespace is not None:
                chosen = action.choices.get(getattr(namespace, action.dest, None) or "")
                if isinstance(chosen, Parser):
                    out += chosen.flags()
        return out

    def unknown_message(self, extras: Sequence[str], namespace=None) -> str:
        """One line for arguments no flag took: the first unknown flag with the closest
        real one (difflib), or the stray values."""
        unknown = [e.split("=", 1)[0] for e in extras if e.startswith("-") and e != "-"]
        if not unknown:
            return f"unrecognized arguments: {' '.join(extras)}"
        flag = unknown[0]
        hint = did_you_mean(flag, self.flags(namespace), quote=False)
        note = self.unknown_flag_hints.get(flag, "")
        return f"unrecognized argument {flag}{hint}{'; ' + note if note else ''}"


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


def did_you_mean(name: str, names: Sequence[str], quote: bool = True) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``names`` (difflib), or ``""``;
    ``quote=False`` for flags: ``" (did you mean --x?)"``."""
    close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.6)
    if not close:
        close = [n for n in names if n.replace("_", "") == name.replace("-", "").replace("_", "")]
    if not close:
        return ""
    return f" (did you mean {close[0]!r}?)" if quote else f" (did you mean {close[0]}?)"


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


# ------------------------------------------------- options declared once, on dataclass fields


def option(
    default: Any,
    help: str | None = None,
    *,
    check: Callable[[str], Any] | None = None,
    choices: Sequence[str] | None = None,
    switch: bool = False,
    metavar: str | None = None,
    exclusive: str | None = None,
    cli_only: bool = False,
    aliases: Sequence[str] = (),
    const: str | None = None,
    many: str | None = None,
) -> Any:
    """A dataclass field that is also a flag (``--field-name``): ``help`` for ``--help``,
    ``check`` the argparse type that converts and checks a value (from a flag, a config file
    or Python alike), ``choices`` the allowed values, ``switch`` a ``store_true`` flag,
    ``exclusive`` the name of a mutually exclusive set of flags, ``cli_only`` a flag that a
    config file may not set, ``aliases`` deprecated names (``--old-name``: a note, then the
    value), ``const`` the value of the bare flag (its value may be left out; a config
    file's or Python's true/false mean ``const``/the default), ``many`` a tuple of values
    (each checked by ``check``): ``"append"`` a repeatable flag, ``"comma"`` one flag
    with a comma list; a config file or Python gives a list (or one value)."""
    meta = dict(
        help=help,
        check=check,
        choices=None if choices is None else tuple(choices),
        switch=switch,
        metavar=metavar,
        exclusive=exclusive,
        cli_only=cli_only,
        aliases=tuple(aliases),
        const=const,
        many=many,
    )
    return dataclasses.field(default=default, metadata={"option": meta})


def options(cls) -> list[dataclasses.Field]:
    """The fields of dataclass ``cls`` declared with ``option``."""
    return [f for f in dataclasses.fields(cls) if "option" in f.metadata]


def flag(name: str) -> str:
    """``lora_rank`` -> ``--lora-rank``."""
    return "--" + name.replace("_", "-")


def check_field(field: dataclasses.Field, value: Any, name: str | None = None) -> Any:
    """``value`` of an ``option`` field, checked (and converted) by its ``check`` and
    ``choices``; a switch takes a bool, an option whose default is None takes None.

    Raises:
      CliError: ``"<name>: <what was wrong>"`` on one line (``name``: the field's name).
    """
    meta, name = field.metadata["option"], name or field.name
    if meta["switch"]:
        if not isinstance(value, bool):
            raise CliError(f"{name}: expected true or false, got {value!r}")
        return value
    if meta.get("const") is not None and isinstance(value, bool):
        value = meta["const"] if value else field.default
    if value is None:
        if field.default is not None:
            raise CliError(f"{name}: must be set (default {field.default!r})")
        return None
    if meta.get("many"):
        return _checked_many(meta, value, name)
    if isinstance(value, (bool, list, tuple, dict)):
        raise CliError(f"{name}: expected a single value, got {value!r}")
    out = str(value)
    if meta["check"] is not None:
        try:
            out = meta["check"](out)
        except argparse.ArgumentTypeError as e:
            raise CliError(f"{name}: {e}") from None
    if meta["choices"] is not None and out not in meta["choices"]:
        hint = did_you_mean(out, meta["choices"])
        raise CliError(f"{name}: {out!r} is not one of {', '.join(meta['choices'])}{hint}")
    return out


def _checked_many(meta, value, name: str) -> tuple:
    """A ``many`` option's tuple: a list or tuple of values, or one value (a comma list for
    ``many="comma"``), each checked by the field's ``check`` and ``choices``."""
    if isinstance(value, str) and meta["many"] == "comma":
        value = [v.strip() for v in value.split(",") if v.strip()]
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    out = []
    for item in items:
        if isinstance(item, (bool, list, tuple, dict)) or item is None:
            raise CliError(f"{name}: expected a list of single values, got {value!r}")
        text = str(item)
        if meta["check"] is not None:
            try:
                text = meta["check"](text)
            except argparse.ArgumentTypeError as e:
                raise CliError(f"{name}: {e}") from None
        if meta["choices"] is not None and text not in meta["choices"]:
            raise CliError(f"{name}: {text!r} is not one of {', '.join(meta['choices'])}")
        out.append(text)
    return tuple(out)


def _comma_list(check: Callable[[str], Any] | None) -> Callable[[str], tuple]:
    """argparse type of a ``many="comma"`` flag: a non-empty comma list, each checked."""

    def parse(text: str) -> tuple:
        items = [v.strip() for v in str(text).split(",") if v.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma list, got {text!r}")
        return tuple(check(v) if check else v for v in items)

    return parse


def check_fields(obj) -> None:
    """Checks and converts every ``option`` field of the frozen dataclass ``obj`` in place
    (for its ``__post_init__``)."""
    for f in options(type(obj)):
        object.__setattr__(obj, f.name, check_field(f, getattr(obj, f.name)))


class DeprecatedAlias(argparse.Action):
    """A flag's old name: prints a note naming the new one, then stores the value."""

    def __init__(self, option_strings, dest, new: str = "", **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"note: {option_string} is deprecated; use {self.new}", flush=True)
        setattr(namespace, self.dest, values)


def add_options(parser: argparse.ArgumentParser, cls, title: str):
    """Adds a flag per ``option`` field of dataclass ``cls`` to an argument group ``title``
    (described by the class's docstring's first paragraph). Every flag's default is None
    (so that a caller tells the flags given apart); ``--help`` shows the field's default.
    Returns the group."""
    doc = (cls.__doc__ or "").strip().split("\n\n")[0]
    group = parser.add_argument_group(title, " ".join(doc.split()))
    exclusive = {}
    for f in options(cls):
        meta = f.metadata["option"]
        where = group
        if meta["exclusive"]:
            if meta["exclusive"] not in exclusive:
                exclusive[meta["exclusive"]] = group.add_mutually_exclusive_group()
            where = exclusive[meta["exclusive"]]
        text = meta["help"]
        if text:
            text = f"{text} (default: {f.default})".replace("%", "%%")
        kw = dict(dest=f.name, help=text, default=None)
        if meta["switch"]:
            kw["action"] = "store_true"
        elif meta.get("many") == "append":
            kw.update(action="append", type=meta["check"], metavar=meta["metavar"])
        elif meta.get("many") == "comma":
            kw.update(type=_comma_list(meta["check"]), metavar=meta["metavar"])
        else:
            kw.update(type=meta["check"], choices=meta["choices"], metavar=meta["metavar"])
            if meta.get("const") is not None:
                kw.update(nargs="?", const=meta["const"])
        where.add_argument(flag(f.name), **kw)
        for old in meta["aliases"]:
            alias = {k: v for k, v in kw.items() if k not in ("action", "help", "default")}
            group.add_argument(
                flag(old), action=DeprecatedAlias, new=flag(f.name), help=argparse.SUPPRESS, **alias
            )
    return group
