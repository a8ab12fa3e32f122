"""Tests for stepscope.instrument.batch: structure-preserving maps over nested batches."""

from __future__ import annotations

import dataclasses
import gc
import weakref
from collections import OrderedDict, UserDict, defaultdict, namedtuple
from typing import Any

import numpy as np
import pytest
import torch

from stepscope.instrument.batch import iter_tensors, map_tensors

Pair = namedtuple("Pair", ["image", "label"])


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    name: str
    extra: list[Any] = dataclasses.field(default_factory=list)
    derived: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        self.post_init_calls = getattr(self, "post_init_calls", 0) + 1


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: torch.Tensor
    b: int


class HasTo:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to(self, *args: Any, **kwargs: Any) -> HasTo:
        return HasTo(self.t.to(*args, **kwargs))


def _plus_one(t: torch.Tensor) -> torch.Tensor:
    return t + 1


def test_tensor_leaf_is_mapped() -> None:
    assert torch.equal(map_tensors(_plus_one, torch.zeros(3)), torch.ones(3))


def test_nested_containers_keep_structure_and_types() -> None:
    arr = np.arange(3)
    batch = {
        "pair": Pair(torch.zeros(2), torch.tensor(5)),
        "list": [torch.zeros(1), "s", 3, arr],
        "tuple": (torch.zeros(1), None),
        "od": OrderedDict(b=torch.zeros(1), a=torch.zeros(1)),
    }
    out = map_tensors(_plus_one, batch)
    assert list(out) == ["pair", "list", "tuple", "od"]
    assert type(out["pair"]) is Pair
    assert torch.equal(out["pair"].image, torch.ones(2))
    assert out["pair"].label.item() == 6
    assert type(out["list"]) is list and out["list"][1:3] == ["s", 3]
    assert out["list"][3] is arr  # numpy leaves pass through untouched
    assert type(out["tuple"]) is tuple and out["tuple"][1] is None
    assert type(out["od"]) is OrderedDict and list(out["od"]) == ["b", "a"]
    # the input is not mutated
    assert torch.equal(batch["pair"].image, torch.zeros(2))


def test_defaultdict_and_userdict_rebuilt_as_same_type() -> None:
    dd: defaultdict[str, Any] = defaultdict(list, x=torch.zeros(1))
    out = map_tensors(_plus_one, dd)
    assert type(out) is defaultdict and out.default_factory is list
    ud = UserDict(x=torch.zeros(1))
    out_ud = map_tensors(_plus_one, ud)
    assert type(out_ud) is UserDict and out_ud["x"].item() == 1


def test_dataclass_rebuilt_same_type_without_rerunning_post_init() -> None:
    s = Sample(torch.zeros(2), "n", [torch.zeros(1)])
    s.derived = 7
    out = map_tensors(_plus_one, s)
    assert type(out) is Sample and out is not s
    assert torch.equal(out.x, torch.ones(2)) and out.name == "n"
    assert out.extra[0].item() == 1
    assert out.derived == 7
    assert out.post_init_calls == 1
    assert torch.equal(s.x, torch.zeros(2))


def test_frozen_dataclass() -> None:
    out = map_tensors(_plus_one, Frozen(torch.zeros(1), 2))
    assert type(out) is Frozen and out.a.item() == 1 and out.b == 2


def test_dataclass_type_itself_is_a_leaf() -> None:
    assert map_tensors(_plus_one, Sample) is Sample


def test_objects_with_to_are_left_to_the_leaf_callback() -> None:
    obj = HasTo(torch.zeros(1))
    assert map_tensors(_plus_one, [obj])[0] is obj
    out = map_tensors(
        _plus_one, [obj, "s"], leaf=lambda o: o.to(torch.float64) if isinstance(o, HasTo) else o
    )
    assert isinstance(out[0], HasTo) and out[0].t.dtype == torch.float64
    assert out[1] == "s"


def test_iter_tensors_order_matches_map_order() -> None:
    t = [torch.tensor(float(i)) for i in range(6)]
    batch = {
        "a": t[0],
        "b": Pair(t[1], [t[2], "x"]),
        "c": Sample(t[3], "n", [t[4]]),
        "d": (np.zeros(1), t[5]),
    }
    assert [x.item() for x in iter_tensors(batch)] == [0, 1, 2, 3, 4, 5]
    seen: list[float] = []
    map_tensors(lambda x: seen.append(x.item()), batch)
    assert seen == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("leaf", ["s", 3, None, np.zeros(2), b"bytes"])
def test_non_tensor_leaves(leaf: Any) -> None:
    assert map_tensors(_plus_one, leaf) is leaf
    assert list(iter_tensors(leaf)) == []


def test_mapping_creates_no_reference_cycles() -> None:
    # A cycle would keep batches and the mapped function's captures alive until gc runs.
    class Capture:
        pass

    cap = Capture()
    ref = weakref.ref(cap)
    batch = {"a": [torch.zeros(1), Pair(torch.zeros(1), 1)], "s": Sample(torch.zeros(1), "n")}
    gc.disable()
    try:
        out = map_tensors(lambda t, c=cap: t, batch, leaf=lambda o, c=cap: o)
        del cap
        assert ref() is None
        assert type(out["s"]) is Sample
    finally:
        gc.enable()
