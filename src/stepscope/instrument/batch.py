"""Walking nested training batches: map a function over, or iterate, their tensor leaves."""

from __future__ import annotations

import copy
import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["iter_tensors", "map_tensors"]


def _is_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def _is_dataclass_instance(obj: object) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def map_tensors(
    fn: Callable[[torch.Tensor], Any],
    batch: Any,
    *,
    leaf: Callable[[Any], Any] | None = None,
) -> Any:
    """Return ``batch`` with ``fn`` applied to every tensor leaf, keeping the structure.

    Containers walked: Mapping (dict, OrderedDict, defaultdict, UserDict, ...), list,
    tuple, namedtuple and dataclass instances; namedtuples and dataclasses come back as
    the same type. Any other leaf (str, int, numpy array, an object with ``.to()``) is
    returned as it is, or passed to ``leaf`` when given, so callers decide what to do
    with non-tensor objects such as ``BatchEncoding``-like wrappers.

    Example::

        >>> b = {"x": torch.zeros(2), "meta": ("id", torch.ones(1))}
        >>> out = map_tensors(lambda t: t + 1, b)
        >>> out["x"].tolist(), out["meta"][0]
        ([1.0, 1.0], 'id')
    """
    return _map(fn, leaf, batch)


def _map(fn: Callable[[torch.Tensor], Any], leaf: Callable[[Any], Any] | None, obj: Any) -> Any:
    # A module-level recursion, not a nested closure: a self-referencing closure would form
    # a reference cycle per call and keep every batch (and ``fn``'s captures) alive until
    # the garbage collector runs.
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return _rebuild_mapping(obj, {k: _map(fn, leaf, v) for k, v in obj.items()})
    if _is_namedtuple(obj):
        return type(obj)(*(_map(fn, leaf, v) for v in obj))
    if isinstance(obj, tuple):
        return tuple(_map(fn, leaf, v) for v in obj)
    if isinstance(obj, list):
        return [_map(fn, leaf, v) for v in obj]
    if _is_dataclass_instance(obj):
        return _rebuild_dataclass(obj, lambda v: _map(fn, leaf, v))
    return leaf(obj) if leaf is not None else obj


def iter_tensors(batch: Any) -> Iterator[torch.Tensor]:
    """Yield the tensor leaves of ``batch`` in the order :func:`map_tensors` visits them."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, Mapping):
        for v in batch.values():
            yield from iter_tensors(v)
    elif isinstance(batch, (tuple, list)):
        for v in batch:
            yield from iter_tensors(v)
    elif _is_dataclass_instance(batch):
        for f in dataclasses.fields(batch):
            yield from iter_tensors(getattr(batch, f.name))


def _rebuild_mapping(original: Mapping[Any, Any], items: dict[Any, Any]) -> Mapping[Any, Any]:
    if type(original) is dict:
        return items
    if isinstance(original, defaultdict):
        return defaultdict(original.default_factory, items)
    try:
        return type(original)(items)  # type: ignore[call-arg]
    except TypeError:
        # A Mapping whose constructor does not take a dict (e.g. a custom view): a plain
        # dict keeps every key and value, which is what the caller needs from a batch.
        return items


def _rebuild_dataclass(obj: Any, walk: Callable[[Any], Any]) -> Any:
    # A shallow copy with fields reassigned keeps the exact type, init=False fields and
    # frozen instances without re-running __init__/__post_init__ on already-built data.
    new = copy.copy(obj)
    for f in dataclasses.fields(obj):
        object.__setattr__(new, f.name, walk(getattr(obj, f.name)))
    return new
