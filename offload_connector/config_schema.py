"""How a msgspec validation error is named for the user (config.py's `ConfigError`): the field a path names,
resolved through the Struct types, the values its annotation admits, and the value the user wrote there.

Imports nothing from the project.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec


def resolve_field(root: Any, path: list[str]) -> tuple[Any, Any]:
    """Walk `path` through the Struct types from `root`; return (owning struct type, field annotation or None)."""
    owner: Any = root
    annotation: Any = None
    for name in path:
        hints = typing.get_type_hints(owner, include_extras=True) if is_struct(owner) else {}
        annotation = hints.get(name)
        nxt = struct_in(annotation)
        if nxt is not None and name != path[-1]:
            owner = nxt
    return owner, annotation


def is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def struct_in(annotation: Any) -> Any:
    if is_struct(annotation):
        return annotation
    for arg in typing.get_args(annotation):
        if is_struct(arg):
            return arg
    return None


def describe(annotation: Any) -> str:
    """Human description of the values an annotation admits."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    if origin is Annotated:
        base, *metas = typing.get_args(annotation)
        bounds = [f">= {m.ge}" for m in metas if isinstance(m, msgspec.Meta) and m.ge is not None]
        bounds += [f"<= {m.le}" for m in metas if isinstance(m, msgspec.Meta) and m.le is not None]
        return f"{describe(base)} {' '.join(bounds)}".strip()
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " or ".join(describe(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    if is_struct(annotation):
        return f"a mapping with keys {', '.join(annotation.__struct_fields__)}"
    return getattr(annotation, "__name__", str(annotation))


def lookup(data: Any, path: list[str]) -> Any:
    for name in path:
        if not isinstance(data, Mapping) or name not in data:
            return None
        data = data[name]
    return data
