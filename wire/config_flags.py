"""Command-line flags generated from a config dataclass, and the dataclass built back from them.

A config dataclass owns each operator option: its field's name, type and default, and its
`option(...)` metadata the rest:

  flag      the flag's spelling, e.g. "--max-num-seqs" (a field without one is no option)
  aliases   further spellings ("--max-waiting-requests", "-tp")
  help      what it means; the field's default is appended unless the help names one
  choices, metavar, nargs, const   as argparse's
  type      the flag's value type when it differs from the field's (`--swap-space` GiB: float)
  to_field  flag value -> field value, where unit or sense differ (GiB -> bytes;
            `--enforce-eager` -> cuda_graphs False); the one place a conversion is written
  to_fields flag value -> {field: value}, for one flag that sets several fields
            (`--served-model-name A B`: the name and its aliases); a field set this way and
            by no flag of its own names the flag in its `set_by` metadata
  switch    the flag takes no value (store_true); the field gets to_field(True)
  off_flag  a second spelling, taking no value either, that sets the field False where `flag`
            sets it True (`--enable-log-requests` / `--disable-log-requests`); `off_help` is
            its help; giving both is an error
  repeat    the flag may be given several times; the field gets the list (action "append")
  required  a command line (or the data handed with it) must give it, although code that
            constructs the class may rely on the field's default
  env       the environment variable that gives it when the flag is not (`from_environment`):
            a secret, which a launcher hands its child there (`given_as_environment`), never
            on a command line (which `ps` shows every user) nor in the JSON of its settings
  launcher_sets   `pdserve serve` decides it for each child (addresses, device): no serve flag
  roles     the node roles the option applies to (None: every process that takes the class)

Booleans that are not switches get `--x` / `--no-x`. Every generated flag defaults to None,
"not given", so values from elsewhere (a child's config from its launcher, as JSON) are not
overwritten by a flag's default; `build` fills in the dataclass's own defaults. A process's own
options, under which nothing is layered, may take the field's default instead (`defaults`).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

GIB = 1 << 30
_TYPES: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str, "bool": bool}


def gib_to_bytes(gib: float) -> int:
    return int(gib * GIB)


def option(
    default: Any = dataclasses.MISSING,
    *,
    flag: str,
    help: str,
    default_factory: Any = dataclasses.MISSING,
    **metadata: Any,
) -> Any:
    """A dataclass field that is an operator option (metadata keys: the module docstring)."""
    return dataclasses.field(
        default=default,
        default_factory=default_factory,
        metadata={"flag": flag, "help": help, **metadata},
    )


def options(cls: type) -> list[dataclasses.Field]:
    """The fields of `cls` that have a flag, in declaration order."""
    return [f for f in dataclasses.fields(cls) if "flag" in f.metadata]


def _value_type(f: dataclasses.Field) -> Callable[[str], Any]:
    if "type" in f.metadata:
        return f.metadata["type"]
    annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "str")
    names = [part.strip() for part in annotation.split("|") if part.strip() != "None"]
    return _TYPES.get(names[0], str) if names else str


def _help(f: dataclasses.Field) -> str:
    text, meta = f.metadata["help"], f.metadata
    if "default" in text or meta.get("required") or "to_field" in meta:
        return text
    if "env" in meta:
        return text + f" (default: ${meta['env']})"
    if f.default is not dataclasses.MISSING and f.default is not None:
        default = f.default
        text += f" (default: {'on' if default is True else 'off' if default is False else default})"
    return text


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    select: Callable[[dataclasses.Field], bool] | None = None,
    defaults: bool = False,
) -> None:
    """One argparse argument per option of `cls` that `select` keeps (default: all). With
    `defaults`, a flag not given takes its field's default instead of None: for a process's
    own options, under which no data from elsewhere is layered."""
    for f in options(cls):
        if select is not None and not select(f):
            continue
        meta = f.metadata
        names = [meta["flag"], *meta.get("aliases", ())]
        default = f.default if defaults and f.default is not dataclasses.MISSING else None
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": _help(f)}
        if "off_flag" in meta:
            _add_switch_pair(parser, f, names, default)
            continue
        if meta.get("switch"):
            kwargs["action"] = "store_true"
        elif _value_type(f) is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            if meta.get("repeat"):
                kwargs["action"] = "append"
            kwargs["type"] = _value_type(f)
            for key in ("choices", "metavar", "nargs", "const"):
                if key in meta:
                    kwargs[key] = meta[key]
            if "choices" not in meta:
                kwargs.setdefault("metavar", meta["flag"].lstrip("-").replace("-", "_").upper())
        parser.add_argument(*names, **kwargs)


def _add_switch_pair(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    f: dataclasses.Field,
    names: list[str],
    default: Any,
) -> None:
    """`flag` sets the field True, `off_flag` False; argparse refuses both on one line."""
    pair = parser.add_mutually_exclusive_group()
    pair.add_argument(
        *names, dest=f.name, action="store_const", const=True, default=default, help=_help(f)
    )
    pair.add_argument(
        f.metadata["off_flag"], dest=f.name, action="store_const", const=False, default=default,
        help=f.metadata["off_help"],
    )


def given(
    cls: type,
    args: argparse.Namespace,
    *,
    select: Callable[[dataclasses.Field], bool] | None = None,
) -> dict[str, Any]:
    """Field values of the options of `cls` (that `select` keeps) given on the command line,
    converted to the field's unit and sense."""
    values = {}
    for f in options(cls):
        if select is not None and not select(f):
            continue
        value = getattr(args, f.name, None)
        if value is None or (f.metadata.get("switch") and value is False):
            continue
        values.update(_field_values(f, value))
    return values


def _field_values(f: dataclasses.Field, value: Any) -> dict[str, Any]:
    """A flag's value (given, or from its environment variable) as field values."""
    if "to_fields" in f.metadata:
        return f.metadata["to_fields"](value)
    convert = f.metadata.get("to_field")
    return {f.name: convert(value) if convert is not None else value}


def from_environment(cls: type, environ: Mapping[str, str]) -> dict[str, Any]:
    """Field values of the options of `cls` with an `env` variable that `environ` sets (and
    not to the empty string), converted as their flag's value is."""
    values = {}
    for f in options(cls):
        value = environ.get(f.metadata.get("env", ""))
        if value:
            values.update(_field_values(f, value))
    return values


def given_as_environment(
    cls: type,
    args: argparse.Namespace,
    *,
    select: Callable[[dataclasses.Field], bool] | None = None,
) -> dict[str, str]:
    """{variable: flag value} of the options of `cls` with an `env` variable (that `select`
    keeps) given on the command line: what a launcher hands its child in the environment."""
    return {
        f.metadata["env"]: str(getattr(args, f.name))
        for f in options(cls)
        if "env" in f.metadata
        and (select is None or select(f))
        and getattr(args, f.name, None) is not None
    }


def check_values(cls: type, values: Mapping[str, Any]) -> None:
    """ValueError for a key that is no option of `cls` (a config handed over as data)."""
    known = {f.name for f in dataclasses.fields(cls) if {"flag", "set_by"} & set(f.metadata)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{cls.__name__} has no option {', '.join(unknown)}")


def build(
    cls: type,
    args: argparse.Namespace | None = None,
    base: Mapping[str, Any] | None = None,
    **fixed: Any,
) -> Any:
    """`cls` from its defaults, then `base` (field values, e.g. JSON from a launcher), then the
    flags given in `args`, then `fixed`. ValueError naming the flags of required options that
    none of them gave, or for an unknown key in `base`."""
    base = dict(base or {})
    check_values(cls, base)
    values = {**base, **(given(cls, args) if args is not None else {}), **fixed}
    missing = [
        f.metadata.get("flag", f.name)
        for f in dataclasses.fields(cls)
        if f.name not in values
        and (
            f.metadata.get("required")
            or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        )
    ]
    if missing:
        raise ValueError(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required")
    return cls(**values)


def as_values(instance: Any) -> dict[str, Any]:
    """The option fields of a config instance, as JSON-ready field values."""
    return {f.name: getattr(instance, f.name) for f in options(type(instance))}


def in_flag_terms(cls: type, message: str) -> str:
    """A config's error message that starts with a field name, starting with its flag instead
    (for a command line's error; fields whose flag converts keep their name)."""
    for f in options(cls):
        if message.startswith(f"{f.name} ") and "to_field" not in f.metadata:
            return f.metadata["flag"] + message[len(f.name):]
    return message
