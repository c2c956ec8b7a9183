"""Reading user-written mappings (YAML or JSON) with errors that name the file and the field.

Whatever a file holds, reading it ends in bounded time and memory with either data or one BatonError:

* a file larger than ``MAX_FILE_BYTES``, one that is not UTF-8 text, or nested deeper than
  ``MAX_DEPTH`` is refused;
* YAML aliases may not expand to more than ``MAX_EXPANDED_NODES`` nodes (a few hundred bytes of nested
  aliases otherwise expand to gigabytes: the "billion laughs"), and may not refer to themselves;
* a key given twice in one mapping is an error (YAML and JSON parsers silently keep the last one);
* a bad value is quoted as a short excerpt (``excerpt``), never in full;
* numbers have documented upper bounds (``LIMITS``, by field name), so no size can exhaust the machine
  later (10^12 GPUs, 1e300 GiB of memory).
"""
from __future__ import annotations

import difflib
import json
import re
import reprlib
from pathlib import Path
from typing import Any

import yaml

from baton.errors import BatonError

MAX_FILE_BYTES = 16 * 1024 * 1024
"""Largest cluster, model or plan file read (the largest shipped one is a few KiB)."""
MAX_EXPANDED_NODES = 100_000
"""Most YAML nodes a document may hold once its aliases are expanded."""
MAX_DEPTH = 64
"""Deepest nesting of mappings and lists."""

LIMITS: dict[str, float] = {
    # cluster files
    "count": 1024,                      # GPUs of one kind in a node entry; copies of a node entry
    "memory_gib": 65536,                # per device
    "memory_reserve_gib": 65536,
    "host_memory_gib": 1048576,         # per node: 1 PiB
    "host_link_gb_per_s": 1e9,          # as every bandwidth
    # 10^9 GB/s, a million times any link built today: anything above it is a typo. Every
    # *_bandwidth_gb_per_s field.
    "bandwidth_gb_per_s": 1e9,
    "latency_us": 1e7,                  # 10 s; every *_latency_us field
}
"""Upper bound of every number read through ``Fields`` under these field names (a field ending in
``_bandwidth_gb_per_s`` or ``_latency_us`` takes that entry's bound); callers may pass a tighter one."""


def _limit(key: str) -> float | None:
    if key in LIMITS:
        return LIMITS[key]
    for suffix in ("bandwidth_gb_per_s", "latency_us"):
        if key.endswith("_" + suffix):
            return LIMITS[suffix]
    return None


_repr = reprlib.Repr()
_repr.maxstring, _repr.maxother, _repr.maxlist, _repr.maxdict, _repr.maxlevel = 40, 40, 4, 4, 2


def excerpt(value: Any) -> str:
    """A short repr of ``value`` for an error line (bounded whatever the value's size or sharing)."""
    return _repr.repr(value)


def _read_text(path: Path) -> str:
    if not path.is_file():
        raise BatonError("not a regular file" if path.exists() else "file not found", source=str(path))
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise BatonError(f"file has {size} bytes, more than the {MAX_FILE_BYTES // (1024 * 1024)} MiB a spec may have",
                         source=str(path))
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise BatonError(f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at line {line}); is it a binary file?",
                         source=str(path)) from None


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys, self-referring aliases and alias expansion bombs."""

    def compose_document(self):
        node = super().compose_document()
        _check_expansion(node)
        return node

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    raise yaml.constructor.ConstructorError(None, None, "a key must be a plain value", key_node.start_mark) from None
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {excerpt(key)} (first at line {seen[key] + 1})", key_node.start_mark)
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _check_expansion(root) -> None:
    """Count the nodes of ``root`` with every alias expanded (shared nodes counted once per use,
    memoised so the count itself stays cheap) and refuse cycles and deep nesting."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node, depth: int) -> int:
        if depth > MAX_DEPTH:
            raise yaml.YAMLError(f"nested deeper than {MAX_DEPTH} levels")
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise yaml.YAMLError("an alias refers to the node that contains it")
        active.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        for child in children:
            total += size(child, depth + 1)
            if total > MAX_EXPANDED_NODES:
                raise yaml.YAMLError(f"aliases expand to more than {MAX_EXPANDED_NODES} nodes")
        active.discard(key)
        sizes[key] = total
        return total

    if root is not None:
        size(root, 0)


def load_yaml(path: str | Path) -> Any:
    """Parse a YAML file, turning a missing file or a syntax error into a one-line BatonError."""
    path = Path(path)
    text = _read_text(path)
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or (str(exc) if type(exc) is yaml.YAMLError else "invalid YAML")
        raise BatonError(f"malformed YAML{where}: {problem}", source=str(path)) from None
    except (ValueError, OverflowError, RecursionError) as exc:  # e.g. an integer of 10^5 digits
        raise BatonError(f"malformed YAML: {str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__}",
                         source=str(path)) from None


def _no_duplicates(pairs):
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {excerpt(key)}")
        out[key] = value
    return out


def load_json(path: str | Path) -> Any:
    """Parse a JSON file with the same one-line errors as load_yaml."""
    path = Path(path)
    text = _read_text(path)
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise BatonError(f"malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}", source=str(path)) from None
    except RecursionError:
        raise BatonError("malformed JSON: nested too deeply", source=str(path)) from None
    except ValueError as exc:  # a duplicate key, or an integer of thousands of digits
        raise BatonError(f"malformed JSON: {str(exc).splitlines()[0][:120]}", source=str(path)) from None
    _check_depth(data, source=str(path))
    return data


def _check_depth(data: Any, *, source: str) -> None:
    stack = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise BatonError(f"nested deeper than {MAX_DEPTH} levels", source=source)
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)


def close_fields(key: Any, allowed) -> list[str]:
    """The fields of ``allowed`` that ``key`` is likely a typo of (at most two, nearest first)."""
    if not isinstance(key, str):
        return []
    return difflib.get_close_matches(key[:60], sorted(allowed), n=2, cutoff=0.75)


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

    def check_known(self, allowed: set[str], *, what: str | None = None) -> None:
        """Reject misspelt keys early: an unknown key is almost always a typo of a known one, so the error
        lists the fields ``what`` (a cluster file, a node, ...) has and the nearest of them."""
        for key in self.data:
            if key not in allowed:
                listed = f"{what} has: " if what else "expected one of: "
                near = close_fields(key, allowed)
                hint = f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
                raise self.error(excerpt(key) if not isinstance(key, str) else key[:60],
                                 f"unknown field ({listed}{', '.join(sorted(allowed))}{hint})")

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
            raise self.error(key, f"expected a non-empty string, got {excerpt(value)}")
        return value

    def integer(self, key: str, default: Any = ..., *, minimum: int | None = 1, maximum: int | None = None) -> int:
        value = self.raw(key, default)
        if value is default and default is not ...:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise self.error(key, f"expected an integer, got {excerpt(value)}")
        if minimum is not None and value < minimum:
            raise self.error(key, f"must be >= {minimum}, got {excerpt(value)}")
        maximum = maximum if maximum is not None else _limit(key)
        if maximum is not None and value > maximum:
            raise self.error(key, f"must be <= {maximum:g}, got {excerpt(value)}")
        return value

    def number(self, key: str, default: Any = ..., *, positive: bool = True, allow_zero: bool = False,
               maximum: float | None = None) -> float:
        value = self.raw(key, default)
        if value is default and default is not ...:
            return value
        if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 (PyYAML) reads exponents without a dot, such as 1e9, as text
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(key, f"expected a number, got {excerpt(value)}")
        try:
            value = float(value)
        except OverflowError:
            raise self.error(key, f"expected a finite number, got {excerpt(value)}") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise self.error(key, f"expected a finite number, got {value!r}")
        if positive and (value < 0 or (value == 0 and not allow_zero)):
            raise self.error(key, f"must be {'>= 0' if allow_zero else '> 0'}, got {value:g}")
        maximum = maximum if maximum is not None else _limit(key)
        if maximum is not None and value > maximum:
            raise self.error(key, f"must be <= {maximum:g}, got {value:g}")
        return value

    def boolean(self, key: str, default: Any = ...) -> bool:
        value = self.raw(key, default)
        if value is default and default is not ...:
            return value
        if not isinstance(value, bool):  # YAML's true/false; 'yes', 1 or "false" are typos here, not truths
            raise self.error(key, f"expected true or false, got {excerpt(value)}")
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
