"""One dataclass per component, exposed as CLI flags and environment variables that match.

A field ``page_size`` of a config whose prefix is ``SPLITSERVE`` becomes the flag
``--page-size`` and the environment variable ``SPLITSERVE_PAGE_SIZE``. Precedence: flag,
then environment, then the dataclass default. Field metadata may carry ``help`` and
``choices``; list fields take several values (``nargs='+'``) or a comma-separated env value.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

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


def add_config_flags(parser: argparse.ArgumentParser, config_cls: type, prefix: str) -> None:
    """Adds one flag per field of ``config_cls`` to ``parser``; defaults come from the env."""
    hints = typing.get_type_hints(config_cls)
    for field in dataclasses.fields(config_cls):
        if not field.init:
            continue
        kind, is_list = _base_type(hints[field.name])
        env = env_name(prefix, field.name)
        help_text = field.metadata.get("help", "")
        help_text = f"{help_text} [env {env}]".strip()
        choices = field.metadata.get("choices")
        if kind is bool:
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


def config_from_args(config_cls: type[T], args: argparse.Namespace, prefix: str,
                     environ: typing.Mapping[str, str] | None = None) -> T:
    """Builds ``config_cls`` from parsed flags, falling back to env vars, then defaults."""
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(config_cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(config_cls):
        if not field.init:
            continue
        value = getattr(args, field.name, None)
        if value is None:
            env = env_name(prefix, field.name)
            if env in environ:
                kind, is_list = _base_type(hints[field.name])
                raw = environ[env]
                if is_list:
                    value = [_parse_scalar(kind, p, env) for p in raw.split(",") if p.strip()]
                else:
                    value = _parse_scalar(kind, raw, env)
                choices = field.metadata.get("choices")
                if choices and not is_list and value not in choices:
                    raise ConfigError(f"{env}: {value!r} is not one of {list(choices)}")
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
