"""Collective functions a module bound by name before stepscope patched them.

``from torch.distributed._functional_collectives import all_to_all_single`` (torchtitan's token
dispatcher does this) or ``from torch.distributed import all_reduce`` copies the function
into the importing module: replacing the attribute on torch's module later does not reach
that copy, so those calls would go untimed. When a patch goes in, the modules already loaded
are searched for the original function objects and each binding is pointed at the
patched function; :func:`restore` puts back the ones still pointing at it.

torch's own modules are left alone (the patches are placed where torch's callers look them
up), as is stepscope. Modules imported after the patch bind the patched function anyway.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

_lock = threading.Lock()
# (module, attribute, original, patched) for every binding rebound.
_rebound: list[tuple[Any, str, Any, Any]] = []
# Per set of originals: the modules already searched and the bindings found there, so a
# patch applied again (every new tracer after the last one finished) searches only modules
# imported since (one search of ~3300 modules takes ~60 ms).
_searched: dict[frozenset[int], tuple[set[str], list[tuple[Any, str]]]] = {}


def _skip(name: str) -> bool:
    return name == "torch" or name.startswith(("torch.", "stepscope"))


def _point(mod: Any, attr: str, orig: Any, patched: Any) -> bool:
    try:
        setattr(mod, attr, patched)
    except (AttributeError, TypeError):  # a read-only module stand-in: left untimed
        return False
    with _lock:
        _rebound.append((mod, attr, orig, patched))
    return True


def rebind(pairs: Iterable[tuple[Callable[..., Any], Callable[..., Any]]]) -> int:
    """Point every loaded module's binding of an ``original`` at its ``patched``; how many."""
    by_id = {id(orig): (orig, patched) for orig, patched in pairs}
    if not by_id:
        return 0
    searched, found = _searched.setdefault(frozenset(by_id), (set(), []))
    n = 0
    for mod, attr in found:  # bindings found by an earlier search, still the original's
        hit = by_id.get(id(getattr(mod, attr, None)))
        if hit is not None and getattr(mod, attr, None) is hit[0]:
            n += _point(mod, attr, *hit)
    for mod_name, mod in list(sys.modules.items()):
        if mod_name in searched:
            continue
        searched.add(mod_name)
        if mod is None or _skip(mod_name):
            continue
        try:
            items = list(vars(mod).items())
        except TypeError:  # not a module with a __dict__ (a lazy stand-in): nothing bound
            continue
        for attr, value in items:
            hit = by_id.get(id(value))
            if hit is None or hit[0] is not value:
                continue
            found.append((mod, attr))
            n += _point(mod, attr, *hit)
    return n


def restore(originals: Iterable[Callable[..., Any]]) -> None:
    """Put back the bindings of these originals that still hold the patched function."""
    ids = {id(o) for o in originals}
    with _lock:
        keep = []
        for mod, attr, orig, patched in _rebound:
            if id(orig) not in ids:
                keep.append((mod, attr, orig, patched))
            elif getattr(mod, attr, None) is patched:
                setattr(mod, attr, orig)
        _rebound[:] = keep
