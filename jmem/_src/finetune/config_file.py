"""The job's command line and config files: ``parse_args`` (flags, and ``--config-file``,
which flags override) and ``read_config_file`` (YAML or TOML, nested by group as
``FinetuneConfig``), every value checked by its field's own checker (``config``). Importing
this module does not import JAX: ``--help`` answers at once."""

from __future__ import annotations

import os
import tomllib
from typing import Any
from typing import Mapping

from jmem._src import cli
from jmem._src.finetune.config import ALIASES
from jmem._src.finetune.config import FIELDS
from jmem._src.finetune.config import GROUP_ALIASES
from jmem._src.finetune.config import GROUP_OF
from jmem._src.finetune.config import GROUPS
from jmem._src.finetune.config import FinetuneConfig
from jmem._src.finetune.config import check_combinations

#: What an unknown flag may have meant besides the closest real flag.
UNKNOWN_FLAG_HINTS = {
    "--export": "the adapters are always written to --out/adapter in PEFT format; "
    "--export-merged DIR also writes the merged model",
    "--mlp-chunk": "renamed --token-chunk",
}


def make_parser(prog: str, description: str | None = None) -> cli.Parser:
    """The job's parser, generated from the groups' fields (a flag per field, grouped as
    the config) and ``--config-file``: one-line usage errors (status 2), defaults shown in
    --help, every default None so that the flags the command line gave can be told apart."""
    p = cli.Parser(prog=prog, description=description)
    p.unknown_flag_hints = UNKNOWN_FLAG_HINTS
    p.add_argument(
        "--config-file",
        metavar="FILE",
        help="a YAML (.yaml/.yml) or TOML (.toml) file of options nested as the config "
        "(execution: {remat: full}); flags given on the command line override it",
    )
    for name, cls in GROUPS.items():
        cli.add_options(p, cls, name)
    return p


def read_config_file(path: str) -> dict[str, Any]:
    """The options in a YAML or TOML file, nested by group (``execution: {remat: full}``),
    each checked by its field's checker. Returns them by option name.

    A top-level key whose value is a mapping is a group (``levers:``, the execution group's
    former name, is read with a deprecation note); any other is an option by its flag's
    name, the flat form of earlier versions (``data: chat.jsonl``, ``steps: 40``), read with
    one deprecation note naming each key's nested form.

    Raises:
      CliError: ``--config-file FILE: ...`` naming the key, for an unreadable file, an
        unknown key (with the closest name), a command-line-only option, or a bad value.
    """
    where = f"--config-file {path}: "
    raw = _load(path, where)
    values, flat = {}, []
    for key, value in raw.items():
        name = _key(key)
        group = GROUP_ALIASES.get(name, name)
        if group in GROUPS and isinstance(value, Mapping):
            if group != name:
                print(f"note: {where}{key} is deprecated; name the group {group}", flush=True)
            for sub, v in value.items():
                option_name = _option(f"{key}.{_key(sub)}", where, group=group)
                values[option_name] = _checked(option_name, v, f"{key}.{sub}", where)
        elif group in GROUPS and name not in FIELDS:
            raise cli.CliError(
                f"{where}{key!r} is a group: expected a mapping such as {group}: {{...}}, "
                f"got {value!r}"
            )
        else:
            option_name = _option(name, where)
            flat.append(f"{key} -> {GROUP_OF[option_name]}.{option_name}")
            values[option_name] = _checked(option_name, value, str(key), where)
    if flat:
        print(
            f"note: {where}flat keys are deprecated; nest them by group: {', '.join(flat)}",
            flush=True,
        )
    check_combinations(values, lambda k: f"{where}{k}")
    return values


def _key(key) -> str:
    return str(key).replace("-", "_")


def _option(key: str, where: str, group: str | None = None) -> str:
    """The option a file's key names (``execution.remat``, its group ``group``, or a flat
    ``remat``), or a CliError with the closest nested key."""
    name = key.split(".", 1)[1] if group else key
    new = ALIASES.get(name, name)
    if new != name:
        print(f"note: {where}{key} is deprecated; use {GROUP_OF[new]}.{new}", flush=True)
    if new in FIELDS and (group is None or GROUP_OF[new] == group):
        if FIELDS[new].metadata["option"]["cli_only"]:
            raise cli.CliError(
                f"{where}{key!r} is command-line only (it says what to do with this "
                f"invocation, not what the run is); pass {cli.flag(new)}"
            )
        return new
    if new in FIELDS:
        raise cli.CliError(
            f"{where}unknown key {key!r}: {new} belongs to the {GROUP_OF[new]} group; "
            f"write {GROUP_OF[new]}.{new}"
        )
    if group:
        hint = cli.did_you_mean(f"{group}.{name}", [f"{g}.{n}" for n, g in GROUP_OF.items()])
    else:
        hint = cli.did_you_mean(key, list(GROUP_OF))
        if hint:
            close = hint.split("'")[1]
            hint = f" (did you mean '{GROUP_OF[close]}.{close}'?)"
    raise cli.CliError(f"{where}unknown key {key!r}{hint}")


def _checked(name: str, value, key: str, where: str):
    try:
        return cli.check_field(FIELDS[name], value, key)
    except cli.CliError as e:
        raise cli.CliError(f"{where}{e}") from None


def _load(path: str, where: str) -> dict:
    """The file's mapping (an empty file: none)."""
    if not os.path.isfile(path):
        raise cli.CliError(f"{where}no such file; pass a .yaml, .yml or .toml file")
    ext = os.path.splitext(path)[1].lower()
    with cli.user_input(f"--config-file {path}", (OSError, ValueError, ImportError)):
        if ext == ".toml":
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        elif ext in (".yaml", ".yml"):
            raw = _read_yaml(path)
        else:
            raise ValueError(f"unknown extension {ext!r}; pass a .yaml, .yml or .toml file")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise cli.CliError(f"{where}expected a mapping of option: value, got {type(raw).__name__}")
    return raw


def _read_yaml(path: str):
    try:
        import yaml  # noqa: PLC0415 (optional: the examples extra)
    except ImportError:
        raise ImportError("reading YAML needs PyYAML: pip install 'jmem[examples]'") from None
    with open(path) as f:
        try:
            return yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"not valid YAML ({cli.one_line(e)})") from None


def parse_args(argv=None, prog: str = "jmem finetune", description: str | None = None):
    """``FinetuneConfig`` from flags (and ``--config-file``, which flags override). Unset
    sizes stay None until the job resolves them for the model and the device. A bad flag or
    file exits with status 2 and one line ``error: ...``; no JAX is imported."""
    p = make_parser(prog, description)
    args = p.parse_args(argv)
    given = {k: v for k, v in vars(args).items() if k in FIELDS and v is not None}
    values = {}
    if args.config_file is not None:
        try:
            values = read_config_file(args.config_file)
        except cli.CliError as e:
            p.exit(2, f"error: {e}\n")
        if "config" in given or "checkpoint" in given:  # a flag picks the model
            values.pop("config", None), values.pop("checkpoint", None)
    values.update(given)
    try:
        check_combinations(values, cli.flag)
        return FinetuneConfig.from_flat(**values)
    except cli.CliError as e:
        p.error(str(e))
