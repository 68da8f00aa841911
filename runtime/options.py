"""Options from defaults, an optional TOML file and the environment, each parsed by a named rule;
a bad value is one ``ConfigError`` line naming the option, its source and what is allowed. Shared
by the ingest service and the pipeline."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
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


OPTION = "option"
"""The metadata key of a configuration field declared with ``option``."""


@dataclass(frozen=True, slots=True)
class Option:
    parse: Callable[[Any], Any]
    variable: str | None
    """Its environment variable; None: the class's prefix and the option's name in capitals."""


def option(default: Any, parse: Callable[[Any], Any], variable: str | None = None) -> Any:
    """A configuration field declared once: its default, the rule that parses a value given in
    a file or the environment, and (when not the usual one) its environment variable."""
    return field(default=default, metadata={OPTION: Option(parse, variable)})


def environment_of(cls: type[Any], prefix: str) -> dict[str, str]:
    """Each option of ``cls`` and its environment variable."""
    return {f.name: f.metadata[OPTION].variable or f"{prefix}{f.name.upper()}" for f in fields(cls)}


def reference(cls: type[Any], prefix: str) -> list[tuple[str, str, object]]:
    """(option, environment variable, default) for every option: the documentation's source."""
    environment = environment_of(cls, prefix)
    return [(f.name, environment[f.name], f.default) for f in fields(cls)]


def load_options(cls: type[Any], prefix: str, environ: Mapping[str, str], path: str | None) -> Any:
    """Defaults of ``cls``, then the TOML file at ``path``, then the environment; 1-line errors."""
    parsers = {f.name: f.metadata[OPTION].parse for f in fields(cls)}
    environment = environment_of(cls, prefix)
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
