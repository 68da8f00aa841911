"""Options from defaults, an optional TOML file and the environment, each parsed by a named rule;
a bad value is one ``ConfigError`` line naming the option, its source and what is allowed. Shared
by the ingest service and the pipeline."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from runtime.errors import BadInput


class ConfigError(BadInput, ValueError):
    pass


def identifier(value: Any) -> str:
    text = str(value)
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_\-]*", text):
        raise ValueError("expected letters, digits, '_' or '-', starting with a letter")
    return text


def choice(*allowed: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if str(value) not in allowed:
            raise ValueError(f"expected one of {', '.join(allowed)}")
        return str(value)

    return parse


def in_range(
    convert: Callable[[Any], Any], what: str, low: float, high: float
) -> Callable[[Any], Any]:
    message = f"expected {what} from {low} to {high}"

    def parse(value: Any) -> Any:
        try:
            number = convert(value)
        except (TypeError, ValueError):
            raise ValueError(message) from None
        if not low <= number <= high:
            raise ValueError(message)
        return number

    return parse


def strict_int(value: Any) -> int:
    """``int`` that refuses booleans (TOML ``true`` is not a count)."""
    if isinstance(value, bool):
        raise TypeError("boolean")
    return int(value)


def integer(low: int, high: int) -> Callable[[Any], int]:
    return in_range(strict_int, "an integer", low, high)


def seconds(low: float, high: float) -> Callable[[Any], float]:
    return in_range(float, "seconds", low, high)


def non_empty(value: Any) -> str:
    if not str(value).strip():
        raise ValueError("must not be empty")
    return str(value)


def load_options(
    cls: type[Any],
    parsers: Mapping[str, Callable[[Any], Any]],
    environment: Mapping[str, str],
    environ: Mapping[str, str],
    path: str | None,
) -> Any:
    """Defaults of ``cls``, then the TOML file at ``path``, then the environment; 1-line errors."""
    values: dict[str, Any] = {}
    if path:
        try:
            document = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as error:
            raise ConfigError(f"config file {path}: {error}") from None
        unknown = sorted(set(document) - set(parsers))
        if unknown:
            raise ConfigError(f"config file {path}: unknown option {unknown[0]!r}")
        values.update({name: (value, f"{path}: {name}") for name, value in document.items()})
    for name, variable in environment.items():
        if variable in environ:
            values[name] = (environ[variable], variable)
    parsed = {}
    for name, (value, source) in values.items():
        try:
            parsed[name] = parsers[name](value)
        except ValueError as error:
            raise ConfigError(f"{source}={value!r}: {error}") from None
    return cls(**parsed)
