"""``ConfigError``, and a config value checked against its key's type: a value of a YAML file, or the text of a
``key=value`` override, converted to the type a :class:`~mjp_fast.train.config.TrainConfig` field is annotated with
(``bool``, ``int``, ``float``, ``str``, ``list[...]``, each optionally ``| None``) and to one of its choices.

Nothing here knows the fields: :func:`mjp_fast.train.config.coerce` looks a key up and passes its type and choices to
:func:`coerce_value`. Every error names the key, what was expected and what was given.
"""

from __future__ import annotations

import math
import types
import typing
from typing import Any

import yaml


class ConfigError(ValueError):
    """Bad configuration keys or values, or bad paths: the ``mjp`` command prints them, one problem a line.

    ``ConfigError(problem, ...)``: ``problems`` lists them (one line each); ``str(error)`` is the problem itself when
    there is one, else a count followed by one indented line per problem. ``config``: the
    :class:`~mjp_fast.train.config.TrainConfig` whose values were checked (set by ``TrainConfig.validate``, so that a
    caller can add the problems it checks itself, such as the data folder's), or None.
    """

    def __init__(self, *problems: str, config: Any = None) -> None:
        self.problems = [str(problem) for problem in problems]
        self.config = config
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = f"{len(self.problems)} problems:" + "".join(f"\n  {problem}" for problem in self.problems)
        super().__init__(message)


def describe_type(hint: Any) -> str:
    """A field's annotation in words, for messages and ``mjp train --help``: ``int or none``, ``list of float``."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [arg for arg in args if arg is not type(None)]
        return f"{describe_type(inner[0])} or none"
    if origin is list:
        return f"list of {args[0].__name__}"
    return hint.__name__


def _without_none(hint: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return inner[0], True
    return hint, False


def _coerce_scalar(name: str, kind: type, value: Any, from_text: bool) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and from_text:
            lowered = value.strip().lower()
            if lowered in ("true", "yes", "on", "1"):
                return True
            if lowered in ("false", "no", "off", "0"):
                return False
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    if kind is int:
        if isinstance(value, bool):
            raise ConfigError(f"{name} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if kind is float:
        if isinstance(value, bool):
            raise ConfigError(f"{name} must be a number, got {value!r}")
        if isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
            try:
                number = float(value.strip())
            except ValueError:
                raise ConfigError(f"{name} must be a number, got {value!r}") from None
        else:
            raise ConfigError(f"{name} must be a number, got {value!r}")
        if not math.isfinite(number):
            raise ConfigError(f"{name} must be a finite number, got {value!r}")
        return number
    if kind is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{name} must be a string, got {value!r}")
    raise ConfigError(f"{name}: unsupported type {kind}")  # pragma: no cover - a field with a new type


def coerce_value(name: str, hint: Any, choices: tuple[str, ...] | None, value: Any, *, from_text: bool = False) -> Any:
    """``value`` converted to ``hint``, a field's annotation, and checked against its ``choices``; raises
    ConfigError naming key ``name``.

    ``from_text``: the value is the text of a ``key=value`` override (so ``true``, ``none``, ``[1,2]`` are parsed).
    """
    kind, optional = _without_none(hint)
    if from_text and isinstance(value, str) and value.strip().lower() in ("none", "null", "~", ""):
        value = None
    if value is None and "none" in (choices or ()):
        value = "none"  # a key whose choices name "none" (mjp_dal): none and null mean that choice
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{name} cannot be none; expected {describe_type(hint)}")
    if typing.get_origin(kind) is list:
        (item_kind,) = typing.get_args(kind)
        if from_text and isinstance(value, str):
            text = value.strip()
            try:
                parsed = yaml.safe_load(text if text.startswith("[") else f"[{text}]")
            except yaml.YAMLError:
                raise ConfigError(f"{name} must be a list like [1, 2], got {value!r}") from None
            value = parsed
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name} must be a list of {item_kind.__name__}, got {value!r}")
        return [_coerce_scalar(f"{name}[{index}]", item_kind, item, True) for index, item in enumerate(value)]
    result = _coerce_scalar(name, kind, value, from_text)
    if choices and result not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {result!r}")
    return result
