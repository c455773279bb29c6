"""Reward functions for GRPO as TRL's ``GRPOTrainer`` calls them, ``f(prompts=, completions=,
completion_ids=, **columns) -> list[float | None]``: ``parse_rewards`` reads ``--reward`` specs
(a Python file's function, a module's function, or a built-in with an optional ``=ARG``) into
a ``RewardSet``, which calls each function on a batch, checks what it returns and sums the
weighted rewards; the built-ins are ``answer_match`` (GSM8K final numbers), ``format_match``
(a regex matched in full) and ``length_penalty`` (DAPO's soft overlong punishment). No JAX
(the job's flags are checked before JAX is imported). Source: TRL's
``GRPOTrainer._calculate_rewards`` (TRL 1.16), DAPO (Yu et al. 2025, arXiv:2503.14476, Eq. 13).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import re
import sys
from decimal import Decimal
from typing import Any
from typing import Callable
from typing import Sequence

import numpy as np

from jmem._src.cli import did_you_mean
from jmem._src.cli import one_line

__all__ = [
    "BUILTINS",
    "RewardError",
    "RewardSet",
    "THINK_ANSWER_FORMAT",
    "answer_match",
    "final_number",
    "format_match",
    "length_penalty",
    "parse_rewards",
]


class RewardError(ValueError):
    """A reward spec that cannot be loaded, or a reward function that fails or returns what is
    not one finite number (or None) per completion; the message is one line naming the
    function and what to do."""


#: The default of ``format_match``: a ``<think>`` block then an ``<answer>`` block, nothing
#: else but whitespace around them (matched in full, ``re.DOTALL``).
THINK_ANSWER_FORMAT = r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*"

#: The keyword arguments of every call (TRL's), never dataset columns.
_CALL_ARGS = ("prompts", "completions", "completion_ids")
#: What TRL passes besides the columns and jmem does not (it has no ``TrainerState``).
_TRL_ONLY = ("trainer_state", "log_extra", "log_metric", "environments")
#: The spec forms, for error messages.
FORMS = (
    "pass path/to/file.py:FUNC, package.module:FUNC, or a built-in "
    "(answer_match[=COLUMN], format_match[=REGEX], length_penalty[=MAX[:CACHE]])"
)

# A number as written in text: optional sign (ASCII or U+2212), digits with optional
# thousands commas, optional decimals; or a bare decimal (.5). Not inside a word (x2) or
# after a digit (the 2 of 10-2 is 2, not -2).
_NUMBER = re.compile(
    r"(?<![\w.])(?P<sign>[-+\u2212]?)"
    r"(?:(?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?P<frac>\.\d+)?|(?P<bare>\.\d+))"
)


# ------------------------------------------------------------------------------ built-ins


def final_number(text: str) -> Decimal | None:
    """The last number written in ``text``, exactly (a ``Decimal``), or None when it has none.

    A number is an optional sign (``-``, ``+`` or U+2212), digits with optional thousands
    separators (``1,234``; ``1,2`` is two numbers) and optional decimals (``3.50``, ``.5``);
    it does not start inside a word (``x2``) or right after a digit (``10-2`` ends with 2,
    not -2). ``$1,000.`` is 1000.

    Args:
      text: any string.

    Returns:
      ``Decimal`` (``Decimal("-3.5")``), or None.
    """
    last = None
    for m in _NUMBER.finditer(text):
        last = m
    if last is None:
        return None
    sign = "-" if last["sign"] in ("-", "\u2212") else ""
    digits = (last["int"] or "").replace(",", "") + (last["frac"] or last["bare"] or "")
    return Decimal(sign + digits)


def _reference_number(answer: Any, row: int) -> Decimal:
    """The number of an ``answer`` column value: a number as it is, GSM8K text (the last
    number after the last ``####``), or other text (its last number)."""
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        if not math.isfinite(answer):
            raise ValueError(f"row {row}: the answer is {answer}, not a finite number")
        return Decimal(str(answer))
    if isinstance(answer, Decimal):
        return answer
    if isinstance(answer, str):
        number = final_number(answer.rsplit("####", 1)[-1])
        if number is not None:
            return number
    raise ValueError(
        f"row {row}: the answer {str(answer)[:40]!r} holds no number; give the answer column "
        "numbers or GSM8K text ending '#### 42'"
    )


def answer_match(prompts: Sequence, completions: Sequence[str], answer: Sequence, **kwargs):
    """GSM8K-style accuracy: 1.0 where a completion's last number equals its answer, else 0.0.

    The completion's number is ``final_number(completion)`` (none: 0.0). The answer is a
    number as given, or text: GSM8K's answers end with ``#### 42``, so the last number after
    the last ``####`` (text without ``####``: its last number). Numbers compare exactly as
    decimals: ``1,000`` equals ``1000`` and ``1000.0``; ``-3`` is not ``3``; ``0.5`` is not
    ``1/2`` (fractions are not read).

    Args:
      prompts: the prompts (unused; TRL's signature).
      completions: B completion texts.
      answer: B reference answers (the dataset's ``answer`` column, repeated per completion).
      **kwargs: other columns (unused).

    Returns:
      ``list[float]`` of B values in {0.0, 1.0}.

    Raises:
      ValueError: an answer that is not a finite number and holds none.

    Source: the GSM8K answer format (Cobbe et al. 2021, arXiv:2110.14168).
    """
    out = []
    for row, (completion, ref) in enumerate(zip(completions, answer)):
        expected = _reference_number(ref, row)
        got = final_number(completion)
        out.append(1.0 if got is not None and got == expected else 0.0)
    return out


def format_match(prompts: Sequence, completions: Sequence[str], *, pattern=None, **kwargs):
    """1.0 where a completion matches ``pattern`` in full (``re.fullmatch``, ``re.DOTALL``),
    else 0.0.

    Args:
      prompts: the prompts (unused; TRL's signature).
      completions: B completion texts.
      pattern: a regex string (compiled with ``re.DOTALL``) or a compiled pattern (used
        with its own flags); default ``THINK_ANSWER_FORMAT``, i.e.
        ``<think>...</think>`` then ``<answer>...</answer>`` with only whitespace around.
      **kwargs: columns (unused).

    Returns:
      ``list[float]`` of B values in {0.0, 1.0}.

    Raises:
      re.error: a pattern that does not compile.

    Source: the format reward of DeepSeek-R1 (arXiv:2501.12948, Sec. 2.2.2) and TRL's
    ``think_format_reward``.
    """
    pattern = THINK_ANSWER_FORMAT if pattern is None else pattern
    regex = pattern if isinstance(pattern, re.Pattern) else re.compile(pattern, re.DOTALL)
    return [1.0 if regex.fullmatch(c) else 0.0 for c in completions]


def length_penalty(
    prompts: Sequence,
    completions: Sequence[str],
    completion_ids: Sequence[Sequence[int]],
    *,
    max_length: int,
    cache: int | None = None,
    **kwargs,
):
    """DAPO's soft overlong punishment of a completion of ``n`` tokens (``n`` =
    ``len(completion_ids[i])``), with ``L = max_length`` and ``C = cache``: 0 for
    ``n <= L - C``, ``((L - C) - n) / C`` for ``L - C < n <= L`` (from 0 down to -1), -1 for
    ``n > L``. Never positive: it punishes long completions, it does not reward short ones.

    Args:
      prompts, completions: unused (TRL's signature).
      completion_ids: B token-id lists (the completion's tokens, EOS included when sampled).
      max_length: ``L`` in tokens (>= 1), e.g. the rollout's maximum completion length.
      cache: ``C`` in tokens, ``0 <= C <= L``; default ``L // 5`` (DAPO's 4,096 of 20,480).
        ``C = 0``: 0 up to ``L`` tokens, -1 beyond.
      **kwargs: columns (unused).

    Returns:
      ``list[float]`` of B values in [-1, 0].

    Raises:
      ValueError: ``max_length < 1`` or ``cache`` outside ``[0, max_length]``.

    Source: Yu et al. 2025 (DAPO, arXiv:2503.14476), Eq. 13; TRL's
    ``get_soft_overlong_punishment(max_completion_len, soft_punish_cache)`` computes the same.
    """
    cache = max_length // 5 if cache is None else cache
    if not (isinstance(max_length, int) and max_length >= 1 and 0 <= cache <= max_length):
        raise ValueError(
            f"length_penalty needs max_length >= 1 and 0 <= cache <= max_length; got "
            f"max_length={max_length}, cache={cache}"
        )
    start = max_length - cache
    out = []
    for ids in completion_ids:
        n = len(ids)
        out.append(0.0 if n <= start else (start - n) / cache if n <= max_length else -1.0)
    return out


def _answer_builtin(arg: str | None, spec: str, max_completion_length):
    column = arg or "answer"
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", column):
        raise RewardError(f"reward {spec!r}: {column!r} is not a column name; answer_match=COLUMN")

    def reward(prompts, completions, **columns):
        return answer_match(prompts, completions, answer=columns[column])

    return reward, (column,)


def _format_builtin(arg: str | None, spec: str, max_completion_length):
    try:
        regex = re.compile(THINK_ANSWER_FORMAT if arg is None else arg, re.DOTALL)
    except re.error as e:
        raise RewardError(
            f"reward {spec!r}: the regex does not compile ({e}); pass format_match=REGEX"
        ) from None
    return (lambda prompts, completions, **_: format_match(prompts, completions, pattern=regex)), ()


def _length_builtin(arg: str | None, spec: str, max_completion_length):
    usage = "pass length_penalty=MAX or length_penalty=MAX:CACHE (tokens, 0 <= CACHE <= MAX)"
    if arg is None:
        if max_completion_length is None:
            raise RewardError(f"reward {spec!r} needs its maximum length in tokens; {usage}")
        arg = str(max_completion_length)
    parts = arg.split(":")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or values[0] < 1 or not 0 <= values[-1] <= values[0]:
        raise RewardError(f"reward {spec!r}: {arg!r} is not MAX or MAX:CACHE; {usage}")
    max_length, cache = values[0], values[1] if len(values) == 2 else None

    def reward(prompts, completions, completion_ids, **_):
        return length_penalty(
            prompts, completions, completion_ids, max_length=max_length, cache=cache
        )

    return reward, ()


#: The built-in rewards: spec name -> the public function it calls.
BUILTINS: dict[str, Callable] = {
    "answer_match": answer_match,
    "format_match": format_match,
    "length_penalty": length_penalty,
}
#: Built-in name -> ``(arg or None, spec, max_completion_length) -> (func, columns)``.
_BUILDERS: dict[str, Callable] = {
    "answer_match": _answer_builtin,
    "format_match": _format_builtin,
    "length_penalty": _length_builtin,
}


# -------------------------------------------------------------------------------- loading


@dataclasses.dataclass(frozen=True)
class _Signature:
    """How one reward function is called: the columns it names (required: no default), and
    whether it takes ``completion_ids`` and every column (``**kwargs``)."""

    required: tuple[str, ...]
    optional: tuple[str, ...]
    ids: str  # "required", "optional" or "no"
    var_kwargs: bool


def _signature(name: str, func: Callable, columns: tuple[str, ...] | None) -> _Signature:
    """The call signature of ``func``, read with ``inspect`` (built-ins pass ``columns``)."""
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):  # no signature (a C callable): assume **kwargs
        return _Signature(tuple(columns or ()), (), "optional", True)
    var_kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
    keyword = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    bad = [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    missing = [a for a in ("prompts", "completions") if a not in keyword and not var_kwargs]
    if bad or missing:
        shown = ", ".join(str(p) for p in params)
        raise RewardError(
            f"reward {name!r} cannot be called as f(prompts=, completions=, **columns) (TRL's "
            f"signature); its parameters are ({shown}); give it keyword parameters prompts "
            "and completions (and **kwargs for the rest)"
        )
    trl_only = [n for n in _TRL_ONLY if n in keyword and keyword[n].default is keyword[n].empty]
    if trl_only:
        raise RewardError(
            f"reward {name!r} needs {trl_only[0]!r}, which TRL passes and jmem does not; give "
            "that parameter a default"
        )
    names = [n for n in keyword if n not in _CALL_ARGS and n not in _TRL_ONLY]
    required = [n for n in names if keyword[n].default is keyword[n].empty]
    optional = [n for n in names if keyword[n].default is not keyword[n].empty]
    param = keyword.get("completion_ids")
    if param is None:
        ids = "optional" if var_kwargs else "no"
    else:
        ids = "required" if param.default is param.empty else "optional"
    return _Signature(tuple(columns or required), tuple(optional), ids, var_kwargs)


def _import_file(path: str, spec: str):
    """The module of a Python file, imported by path under a name of its own."""
    if not os.path.isfile(path):
        raise RewardError(
            f"reward {spec!r}: no such file {path!r}; pass path/to/file.py:FUNC with an "
            "existing file"
        )
    real = os.path.realpath(path)
    name = "jmem_reward_" + hashlib.sha1(real.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, real)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise RewardError(
            f"reward {spec!r}: importing {path} raised {type(e).__name__}: {one_line(e)}"
        ) from e
    return module


def _import_module(target: str, spec: str):
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        raise RewardError(
            f"reward {spec!r}: no module {e.name or target!r} to import; {FORMS}"
        ) from None
    except Exception as e:
        raise RewardError(
            f"reward {spec!r}: importing {target} raised {type(e).__name__}: {one_line(e)}"
        ) from e


def _load_function(spec: str) -> tuple[str, Callable]:
    """``(name, function)`` of ``path.py:FUNC`` or ``package.module:FUNC``."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise RewardError(f"reward {spec!r} names no function; {FORMS}")
    is_file = target.endswith(".py") or "/" in target or os.sep in target
    module = _import_file(target, spec) if is_file else _import_module(target, spec)
    if not hasattr(module, attr):
        funcs = [
            n
            for n, v in vars(module).items()
            if callable(v)
            and not n.startswith("_")
            and getattr(v, "__module__", None) == module.__name__
        ]
        shown = ", ".join(funcs[:10]) + (", ..." if len(funcs) > 10 else "")
        raise RewardError(
            f"reward {spec!r}: {target} has no function {attr!r}{did_you_mean(attr, funcs)}; "
            f"its functions are {shown or 'none'}"
        )
    func = getattr(module, attr)
    if not callable(func):
        raise RewardError(
            f"reward {spec!r}: {target}.{attr} is a {type(func).__name__}, not a function"
        )
    return attr, func


def _builtin(spec: str) -> tuple[str, str | None] | None:
    """``(name, arg or None)`` when ``spec`` is a built-in (``name`` or ``name=ARG``)."""
    name, eq, arg = spec.partition("=")
    if name in BUILTINS:
        return name, (arg if eq else None)
    return None


def _entry(spec, max_completion_length) -> tuple[str, Callable, _Signature]:
    """One spec as ``(name, function, signature)``."""
    if callable(spec):
        inner = spec
        while isinstance(inner, functools.partial):
            inner = inner.func
        name = getattr(inner, "__name__", type(inner).__name__)
        return name, spec, _signature(name, spec, None)
    if not isinstance(spec, str) or not spec.strip():
        raise RewardError(f"reward spec {spec!r} is not a non-empty string; {FORMS}")
    spec = spec.strip()
    builtin = _builtin(spec)
    if builtin is not None:
        name, arg = builtin
        func, columns = _BUILDERS[name](arg, spec, max_completion_length)
        return name, func, _signature(name, func, columns)
    if ":" not in spec:
        word = spec.partition("=")[0]
        raise RewardError(
            f"unknown built-in reward {word!r}{did_you_mean(word, list(BUILTINS))}; {FORMS}"
        )
    name, func = _load_function(spec)
    return name, func, _signature(name, func, None)


def _unique(names: list[str]) -> tuple[str, ...]:
    """``names`` with repeats numbered: ``format_match``, ``format_match_2``."""
    out, seen = [], {}
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}_{seen[n]}")
    return tuple(out)


def parse_rewards(
    specs: Sequence[str | Callable],
    weights: Sequence[float] | None = None,
    *,
    max_completion_length: int | None = None,
) -> "RewardSet":
    """Loads reward functions from specs (``--reward``), with their weights.

    A spec is ``path/to/file.py:FUNC`` (the file imported by its path), ``package.module:FUNC``
    (``importlib.import_module``), or a built-in: ``answer_match`` (``=COLUMN``: compare with
    that column instead of ``answer``), ``format_match`` (``=REGEX``: that regex instead of
    ``THINK_ANSWER_FORMAT``; everything after the first ``=`` is the regex), or
    ``length_penalty`` (``=MAX`` or ``=MAX:CACHE`` in tokens; bare: ``MAX`` is
    ``max_completion_length``). A callable is taken as it is. Repeated names get ``_2``,
    ``_3``... in ``RewardSet.names``.

    Args:
      specs: one or more specs.
      weights: one float per spec (TRL's ``reward_weights``); default 1.0 each.
      max_completion_length: the rollout's maximum completion length in tokens, for a bare
        ``length_penalty``.

    Returns:
      A ``RewardSet``.

    Raises:
      RewardError: no spec; weights of another length or not finite; a file not found, a
        module that does not import, no such function (with the closest name), not callable,
        a signature TRL could not call, an unknown built-in (with the closest name), a bad
        regex or length argument.
    """
    specs = list(specs)
    if not specs:
        raise RewardError(f"no reward function given; {FORMS}")
    if weights is None:
        weights = [1.0] * len(specs)
    weights = list(weights)
    if len(weights) != len(specs):
        raise RewardError(
            f"{len(weights)} reward weights for {len(specs)} reward functions; give one weight "
            "per reward function, in the same order"
        )
    try:
        weights = [float(w) for w in weights]
    except (TypeError, ValueError):
        raise RewardError(f"reward weights {weights} are not all numbers") from None
    if not all(math.isfinite(w) for w in weights):
        raise RewardError(f"reward weights {weights} are not all finite numbers")
    entries = [_entry(s, max_completion_length) for s in specs]
    required = sorted({c for _, _, sig in entries for c in sig.required})
    return RewardSet(
        names=_unique([n for n, _, _ in entries]),
        weights=tuple(weights),
        required_columns=tuple(required),
        functions=tuple(f for _, f, _ in entries),
        _signatures=tuple(sig for _, _, sig in entries),
    )


# -------------------------------------------------------------------------------- calling


def _rows(mask: np.ndarray, limit: int = 8) -> str:
    idx = np.flatnonzero(mask)
    shown = ", ".join(str(i) for i in idx[:limit])
    return shown + (f" and {len(idx) - limit} more" if len(idx) > limit else "")


def _as_rewards(name: str, out: Any, n: int) -> np.ndarray:
    """A function's result as float32 ``[n]`` (None: NaN), or a RewardError saying why not."""
    if hasattr(out, "tolist") and not isinstance(out, (list, tuple)):
        out = out.tolist()  # numpy, JAX or torch arrays; a 0-d one becomes a scalar
    if not isinstance(out, (list, tuple)):
        raise RewardError(
            f"reward {name!r} returned a {type(out).__name__}, not a list; return one float "
            "(or None) per completion"
        )
    if len(out) != n:
        raise RewardError(
            f"reward {name!r} returned {len(out)} rewards for {n} completions; return one "
            "per completion"
        )
    values = np.empty(n, np.float32)
    for i, r in enumerate(out):
        if r is None:
            values[i] = np.nan
        elif isinstance(r, (int, float, np.integer, np.floating)):
            values[i] = r if math.isfinite(float(r)) else np.inf  # refused below, all rows
        else:
            raise RewardError(
                f"reward {name!r} returned a {type(r).__name__} at row {i}; return a float "
                "(or None) per completion"
            )
    bad = np.isinf(values)
    if bad.any():
        raise RewardError(
            f"reward {name!r} returned NaN or inf at rows {_rows(bad)} (of {n}); return a finite "
            "number, or None for a completion it does not score"
        )
    return values


def _kwargs(name: str, sig: _Signature, columns: dict, completion_ids) -> dict:
    """The keyword arguments of one function besides ``prompts`` and ``completions``."""
    for c in sig.required:
        if c not in columns:
            raise RewardError(
                f"reward {name!r} needs the column {c!r}, which the data lacks; the columns "
                f"are {', '.join(sorted(columns)) or 'none'}; add it to every prompt row"
            )
    if sig.var_kwargs:
        kwargs = dict(columns)
    else:
        kwargs = {c: columns[c] for c in sig.required + sig.optional if c in columns}
    if completion_ids is not None and sig.ids != "no":
        kwargs["completion_ids"] = completion_ids
    elif sig.ids == "required":
        raise RewardError(
            f"reward {name!r} needs completion_ids, and none were given; pass the completions' "
            "token ids"
        )
    return kwargs


async def _awaited(awaitable):
    return await awaitable


def _check_lengths(prompts, completions, columns, completion_ids) -> int:
    n = len(completions)
    if len(prompts) != n:
        raise RewardError(f"{len(prompts)} prompts for {n} completions; pass one per completion")
    for c, values in columns.items():
        if len(values) != n:
            raise RewardError(
                f"column {c!r} has {len(values)} values for {n} completions; repeat each "
                "prompt's columns once per completion"
            )
    if completion_ids is not None and len(completion_ids) != n:
        raise RewardError(f"{len(completion_ids)} completion_ids for {n} completions")
    return n


@dataclasses.dataclass(frozen=True)
class RewardSet:
    """Reward functions and their weights (``parse_rewards``), called on a batch as TRL's
    ``GRPOTrainer._calculate_rewards``.

    Attributes:
      names: one per function (a file's or module's function name, a built-in's name;
        repeats numbered ``_2``, ``_3``...).
      weights: one float per function.
      required_columns: the dataset columns the functions name as parameters without a
        default (sorted), which every prompt row must have.
      functions: the callables.
    """

    names: tuple[str, ...]
    weights: tuple[float, ...]
    required_columns: tuple[str, ...]
    functions: tuple[Callable, ...] = dataclasses.field(repr=False)
    _signatures: tuple[_Signature, ...] = dataclasses.field(repr=False, compare=False)

    def check_columns(self, columns: Sequence[str], where: str = "the data") -> None:
        """Refuses data without a column a function needs (before any rollout).

        Args:
          columns: the dataset's column names (besides ``prompt``).
          where: how the message names the data (the job passes ``--data FILE``).

        Raises:
          RewardError: naming the first function whose column is missing, and the columns.
        """
        have = set(columns)
        for name, sig in zip(self.names, self._signatures):
            for c in sig.required:
                if c not in have:
                    raise RewardError(
                        f"reward {name!r} needs the column {c!r}, which {where} lacks; the "
                        f"columns are {', '.join(sorted(have)) or 'none'}; add it to every row "
                        "or pick another reward"
                    )

    def __call__(
        self,
        prompts: Sequence,
        completions: Sequence[str],
        columns: dict[str, Sequence] | None = None,
        completion_ids: Sequence[Sequence[int]] | None = None,
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Scores B completions with every function and sums the weighted rewards.

        Each function is called as TRL calls it: ``f(prompts=prompts, completions=completions,
        completion_ids=..., **columns)``; a function with ``**kwargs`` gets every column and
        ``completion_ids`` (when given), one without gets only the parameters it names. None
        in a result means "not scored" (TRL's meaning): that function's reward there is NaN
        in ``per_function`` and takes no part in the total, as TRL's ``nansum``; a row that
        no function scores is refused (TRL warns and gives it advantage 0). An ``async``
        function is awaited (``asyncio.run``), one after another (TRL runs them
        concurrently).

        Args:
          prompts: B prompts (text), completion ``i``'s prompt at ``i``.
          completions: B completion texts.
          columns: column name -> B values (each prompt row's values repeated per
            completion); the dataset's columns besides ``prompt``.
          completion_ids: B lists of int token ids of the completions, or None.

        Returns:
          ``(total, per_function)``: float32 ``[B]``, ``sum_k weight_k * reward_k`` over
          the functions that scored the row; name -> float32 ``[B]`` (NaN where None).

        Raises:
          RewardError: naming the function, for an exception inside it (its type and
            message), a result that is not a sequence of numbers or None, of another
            length, NaN or inf (the rows), a column it needs missing, or ``completion_ids``
            it needs not given; mismatched lengths of the inputs; rows no function scored.
        """
        columns = {k: list(v) for k, v in (columns or {}).items()}
        if completion_ids is not None:
            completion_ids = [[int(t) for t in ids] for ids in completion_ids]
        n = _check_lengths(prompts, completions, columns, completion_ids)
        prompts, completions = list(prompts), list(completions)
        per_function = {}
        for name, func, sig in zip(self.names, self.functions, self._signatures):
            kwargs = _kwargs(name, sig, columns, completion_ids)
            try:
                out = func(prompts=prompts, completions=completions, **kwargs)
                if inspect.isawaitable(out):  # an async function (an LLM judge): awaited here
                    out = asyncio.run(_awaited(out))
            except Exception as e:
                raise RewardError(
                    f"reward {name!r} raised {type(e).__name__}: {one_line(e)}"
                ) from e
            per_function[name] = _as_rewards(name, out, n)
        stacked = np.stack([per_function[k] for k in self.names], axis=1)  # [B, K]
        unscored = np.isnan(stacked).all(axis=1)
        if unscored.any():
            raise RewardError(
                f"no reward function scored rows {_rows(unscored)} (of {n}): every one returned "
                "None there; have at least one return a number for every completion"
            )
        total = np.nansum(stacked * np.asarray(self.weights, np.float32), axis=1)
        return total.astype(np.float32), per_function
