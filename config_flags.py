"""One dataclass per component, exposed as CLI flags and environment variables that match.

A field ``page_size`` of a config whose prefix is ``SPLITSERVE`` becomes the flag
``--page-size`` and the environment variable ``SPLITSERVE_PAGE_SIZE``. Precedence: flag,
then environment, then a config file's value (``--config FILE``, where a command takes one),
then the dataclass default. Field metadata may carry ``help`` and ``choices``; list fields
take several values (``nargs='+'``) or a comma-separated env value.

A command may show only its users' flags in ``--help``: the other fields stay settable (as
flags that ``--help-all`` lists, in the config file and through the environment), and fields
named in ``omit`` (test hooks) get no flag at all.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import types
import typing
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A flag or environment variable holds a value its field cannot take."""


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def env_name(prefix: str, field_name: str) -> str:
    return f"{prefix}_{field_name.upper()}"


def _base_type(annotation: Any) -> tuple[type, bool]:
    """Returns (scalar type, is_list) of an annotation such as ``int | None`` or ``list[str]``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0])
    if origin in (list, Sequence, tuple):
        return typing.get_args(annotation)[0], True
    return annotation, False


def _parse_scalar(kind: type, text: str, where: str) -> Any:
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off", ""):
            return False
        raise ConfigError(f"{where}: expected a boolean, got {text!r}")
    try:
        return kind(text)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: expected {kind.__name__}, got {text!r}") from exc


NEGATIVE_PREFIXES = ("disable_", "no_", "skip_")


def default_text(field: dataclasses.Field) -> str:
    """The field's default as ``--help`` shows it."""
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if value is None or value == "" or value == []:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return str(value)


def add_config_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, config_cls: type, prefix: str,
                     shown: Collection[str] | None = None, omit: Collection[str] = (),
                     show_all: bool = False) -> None:
    """Adds one flag per field of ``config_cls`` to ``parser``; defaults come from the env.

    ``shown``: the fields ``--help`` lists (None: all); the rest are accepted but listed only
    with ``show_all``. ``omit``: fields that get no flag (settable through the environment only).
    """
    hints = typing.get_type_hints(config_cls)
    for field in dataclasses.fields(config_cls):
        if not field.init or field.name in omit:
            continue
        kind, is_list = _base_type(hints[field.name])
        env = env_name(prefix, field.name)
        help_text = field.metadata.get("help", "")
        if "default" not in help_text:
            help_text = f"{help_text} (default: {default_text(field)})".strip()
        help_text = f"{help_text} [env {env}]"
        if shown is not None and field.name not in shown and not show_all:
            help_text = argparse.SUPPRESS
        choices = field.metadata.get("choices")
        if kind is bool and field.name.startswith(NEGATIVE_PREFIXES):
            # `--disable-x` alone: BooleanOptionalAction would add `--no-disable-x`.
            parser.add_argument(flag_name(field.name), dest=field.name, default=None, action="store_const",
                                const=True, help=help_text)
        elif kind is bool:
            parser.add_argument(
                flag_name(field.name), dest=field.name, default=None,
                action=argparse.BooleanOptionalAction, help=help_text,
            )
        elif is_list:
            parser.add_argument(
                flag_name(field.name), dest=field.name, default=None, nargs="+",
                type=lambda t, k=kind, f=field.name: _parse_scalar(k, t, flag_name(f)),
                help=help_text, choices=choices,
            )
        else:
            parser.add_argument(
                flag_name(field.name), dest=field.name, default=None,
                type=lambda t, k=kind, f=field.name: _parse_scalar(k, t, flag_name(f)),
                help=help_text, choices=choices,
            )


def read_config_file(path: str | Path, config_classes: Sequence[type]) -> dict[str, Any]:
    """The values of a YAML config file: a mapping of field names (``page_size`` or ``page-size``)
    to values, every name a field of one of ``config_classes``. Raises ConfigError naming the file
    and the key on anything else."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc.strerror or exc})") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not valid YAML ({exc})") from exc
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"--config {path}: expected a mapping of settings, got {type(data).__name__}")
    known = {f.name for cls in config_classes for f in dataclasses.fields(cls) if f.init}
    values: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"--config {path}: unknown setting {key!r}{hint}")
        values[name] = value
    return values


def _file_value(kind: type, is_list: bool, value: Any, where: str) -> Any:
    """A config file's value as the field's type (YAML already typed it; strings are parsed like env values)."""
    if is_list:
        items = value if isinstance(value, list) else [p for p in str(value).split(",") if p.strip()]
        return [_file_value(kind, False, v, where) for v in items]
    if isinstance(value, str) or (kind is float and isinstance(value, int) and not isinstance(value, bool)):
        return _parse_scalar(kind, str(value), where)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: expected {kind.__name__}, got {value!r}")
    return value


def config_from_args(config_cls: type[T], args: argparse.Namespace, prefix: str,
                     environ: typing.Mapping[str, str] | None = None,
                     file_values: Mapping[str, Any] | None = None) -> T:
    """Builds ``config_cls`` from parsed flags, falling back to env vars, a config file's values, then defaults."""
    environ = os.environ if environ is None else environ
    file_values = file_values or {}
    hints = typing.get_type_hints(config_cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(config_cls):
        if not field.init:
            continue
        value = getattr(args, field.name, None)
        kind, is_list = _base_type(hints[field.name])
        where = flag_name(field.name)
        if value is None:
            env = env_name(prefix, field.name)
            if env in environ:
                raw = environ[env]
                if is_list:
                    value = [_parse_scalar(kind, p, env) for p in raw.split(",") if p.strip()]
                else:
                    value = _parse_scalar(kind, raw, env)
                where = env
            elif field.name in file_values:
                where = f"config file: {field.name}"
                value = _file_value(kind, is_list, file_values[field.name], where)
        choices = field.metadata.get("choices")
        if value is not None and choices and not is_list and value not in choices:
            raise ConfigError(f"{where}: {value!r} is not one of {list(choices)}")
        if value is not None:
            values[field.name] = value
    return config_cls(**values)


def parse_config(config_cls: type[T], argv: Sequence[str] | None, prefix: str, prog: str,
                 description: str = "") -> T:
    """Parses ``argv`` into ``config_cls`` (flags, env, defaults), exiting 2 on a bad value."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_config_flags(parser, config_cls, prefix)
    args = parser.parse_args(argv)
    try:
        return config_from_args(config_cls, args, prefix)
    except (ConfigError, ValueError) as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
