"""Reading user-written mappings (YAML or JSON) with errors that name the file and the field."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from baton.errors import BatonError


def load_yaml(path: str | Path) -> Any:
    """Parse a YAML file, turning a missing file or a syntax error into a one-line BatonError."""
    path = Path(path)
    if not path.is_file():
        raise BatonError("file not found", source=str(path))
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise BatonError(f"malformed YAML{where}: {problem}", source=str(path)) from None


def load_json(path: str | Path) -> Any:
    """Parse a JSON file with the same one-line errors as load_yaml."""
    path = Path(path)
    if not path.is_file():
        raise BatonError("file not found", source=str(path))
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise BatonError(f"malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}", source=str(path)) from None


_EXPONENT = re.compile(r"[-+]?[0-9]+(\.[0-9]*)?[eE][-+]?[0-9]+")


class Fields:
    """A view of one mapping in a user file that reads typed fields and reports the dotted field path."""

    def __init__(self, data: Any, *, source: str, prefix: str = ""):
        self.source = source
        self.prefix = prefix
        if not isinstance(data, dict):
            what = type(data).__name__ if data is not None else "nothing"
            raise BatonError(f"expected a mapping, found {what}", source=source, field=prefix or None)
        self.data = data

    def path(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def error(self, key: str, message: str) -> BatonError:
        return BatonError(message, source=self.source, field=self.path(key))

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def check_known(self, allowed: set[str]) -> None:
        """Reject misspelt keys early: an unknown key is almost always a typo of a known one."""
        for key in self.data:
            if key not in allowed:
                raise self.error(str(key), f"unknown field (expected one of: {', '.join(sorted(allowed))})")

    def raw(self, key: str, default: Any = ...) -> Any:
        if not self.has(key):
            if default is ...:
                raise self.error(key, "missing required field")
            return default
        return self.data[key]

    def string(self, key: str, default: Any = ...) -> str:
        value = self.raw(key, default)
        if value is default and default is not ...:
            return value
        if not isinstance(value, str) or not value.strip():
            raise self.error(key, f"expected a non-empty string, got {value!r}")
        return value

    def integer(self, key: str, default: Any = ..., *, minimum: int | None = 1) -> int:
        value = self.raw(key, default)
        if value is default and default is not ...:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise self.error(key, f"expected an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise self.error(key, f"must be >= {minimum}, got {value}")
        return value

    def number(self, key: str, default: Any = ..., *, positive: bool = True, allow_zero: bool = False) -> float:
        value = self.raw(key, default)
        if value is default and default is not ...:
            return value
        if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 (PyYAML) reads exponents without a dot, such as 1e9, as text
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(key, f"expected a number, got {value!r}")
        value = float(value)
        if value != value or value in (float("inf"), float("-inf")):
            raise self.error(key, f"expected a finite number, got {value!r}")
        if positive and (value < 0 or (value == 0 and not allow_zero)):
            raise self.error(key, f"must be {'>= 0' if allow_zero else '> 0'}, got {value:g}")
        return value

    def mapping(self, key: str, default: Any = ...) -> "Fields":
        value = self.raw(key, default)
        if value is default and default is not ...:
            return value
        return Fields(value, source=self.source, prefix=self.path(key))

    def sequence(self, key: str, default: Any = ...) -> list:
        value = self.raw(key, default)
        if value is default and default is not ...:
            return value
        if not isinstance(value, list) or not value:
            raise self.error(key, "expected a non-empty list")
        return value
