"""CPU tests for PrefetchLoader: iteration semantics, and the CUDA logic through fake streams."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import weakref
from collections import namedtuple
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from fake_cuda_backend import FakeBackend, FakeStream, FakeTracer
from torch.utils.data import DataLoader, Dataset

import stepscope
from stepscope.instrument import h2d
from stepscope.prefetch import PrefetchLoader
from stepscope.recording.clock import CudaClock
from stepscope.recording.schema import read_run

CUDA0 = torch.device("cuda", 0)
Pair = namedtuple("Pair", ["image", "label"])



def fake_loader(
    source: Any, recording: bool = True, enabled: bool = True, **kwargs: Any
) -> tuple[PrefetchLoader, FakeBackend]:
    be = FakeBackend()
    tracer = FakeTracer(be.log, recording, enabled)
    return PrefetchLoader(source, device=CUDA0, tracer=tracer, _backend=be, **kwargs), be


# ---------------------------------------------------------------- data helpers


class NestedDataset(Dataset[dict[str, Any]]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "x": torch.full((3,), float(i)),
            "pair": Pair(torch.tensor([i, i + 1]), i),
            "tags": [f"s{i}", torch.tensor(i * 2)],
            "name": f"item{i}",
        }


@dataclasses.dataclass
class DataBatch:
    x: torch.Tensor
    meta: dict[str, Any]


def to_dataclass(items: list[dict[str, Any]]) -> DataBatch:
    return DataBatch(
        torch.stack([d["x"] for d in items]),
        {"names": [d["name"] for d in items], "arr": np.arange(len(items))},
    )


def assert_same(a: Any, b: Any) -> None:
    """Same structure, same types, equal tensors and leaves."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b)
    else:
        assert a == b


def make(kind: str, source: Any) -> PrefetchLoader:
    """The same wrapper on the CPU pass-through or on the (fake) CUDA prefetch path."""
    if kind == "cpu":
        return PrefetchLoader(source)
    return fake_loader(source)[0]


PATHS = ["cpu", "fake_cuda"]


class Boom(Exception):
    pass


class FlakySource:
    """An iterable whose iterator raises at given positions and then goes on (like DataLoader)."""

    def __init__(self, n: int, fail_at: set[int]) -> None:
        self.n, self.fail_at = n, fail_at
        self.raised: list[Boom] = []

    def __iter__(self) -> Iterator[torch.Tensor]:
        return _FlakyIter(self)


class _FlakyIter:
    def __init__(self, owner: FlakySource) -> None:
        self.owner, self.i = owner, 0

    def __iter__(self) -> _FlakyIter:
        return self

    def __next__(self) -> torch.Tensor:
        i = self.i
        if i >= self.owner.n:
            raise StopIteration
        self.i += 1
        if i in self.owner.fail_at:
            exc = Boom(f"bad batch {i}")
            self.owner.raised.append(exc)
            raise exc
        return torch.tensor([float(i)])


# ----------------------------------------------------------- semantics, both paths


@pytest.mark.parametrize("kind", PATHS)
@pytest.mark.parametrize("workers", [0, 2])
def test_same_batches_same_order_on_dataloader(kind: str, workers: int) -> None:
    dl = DataLoader(NestedDataset(7), batch_size=2, num_workers=workers)
    expected = list(DataLoader(NestedDataset(7), batch_size=2))
    wrapped = make(kind, dl)
    assert len(wrapped) == len(dl) == 4
    got = list(wrapped)
    assert len(got) == 4  # last, partial batch included
    for a, b in zip(got, expected, strict=True):
        assert_same(a, b)
    assert got[-1]["x"].shape == (1, 3)


@pytest.mark.parametrize("kind", PATHS)
def test_dataclass_batches_from_a_collate_fn(kind: str) -> None:
    dl = DataLoader(NestedDataset(5), batch_size=2, collate_fn=to_dataclass)
    got = list(make(kind, dl))
    for a, b in zip(got, list(dl), strict=True):
        assert_same(a, b)
    assert isinstance(got[0], DataBatch) and got[0].meta["names"] == ["item0", "item1"]


@pytest.mark.parametrize("kind", PATHS)
def test_empty_loader_and_stopiteration_after_end(kind: str) -> None:
    wrapped = make(kind, DataLoader(NestedDataset(0), batch_size=2))
    assert len(wrapped) == 0
    it = iter(wrapped)
    for _ in range(3):
        with pytest.raises(StopIteration):
            next(it)
    it2 = iter(make(kind, [torch.zeros(1)]))
    assert torch.equal(next(it2), torch.zeros(1))
    for _ in range(3):
        with pytest.raises(StopIteration):
            next(it2)


@pytest.mark.parametrize("kind", PATHS)
def test_fresh_iterator_each_epoch(kind: str) -> None:
    wrapped = make(kind, DataLoader(NestedDataset(5), batch_size=2))
    first = iter(wrapped)
    second = iter(wrapped)
    assert first is not second
    epochs = [[b["x"][:, 0].tolist() for b in wrapped] for _ in range(3)]
    assert epochs == [[[0.0, 1.0], [2.0, 3.0], [4.0]]] * 3
    # a half-consumed iterator does not leak into a new one
    assert next(first)["x"][0, 0].item() == 0.0
    assert [b["x"][0, 0].item() for b in wrapped] == [0.0, 2.0, 4.0]


@pytest.mark.parametrize("kind", PATHS)
def test_len_forwarded_or_typeerror(kind: str) -> None:
    assert len(make(kind, [1, 2, 3])) == 3
    gen_wrapped = make(kind, (torch.zeros(1) for _ in range(2)))
    with pytest.raises(TypeError):
        len(gen_wrapped)
    assert len(list(gen_wrapped)) == 2  # list() copes with the missing len


@pytest.mark.parametrize("kind", PATHS)
def test_source_exception_reraised_unchanged_in_order(kind: str) -> None:
    src = FlakySource(5, fail_at={2})
    it = iter(make(kind, src))
    got = [next(it).item(), next(it).item()]
    with pytest.raises(Boom) as info:
        next(it)
    assert info.value is src.raised[0]
    # like the source, iteration can go on after the failing batch
    got += [b.item() for b in it]
    assert got == [0.0, 1.0, 3.0, 4.0]


@pytest.mark.parametrize("kind", PATHS)
def test_exception_in_first_batch(kind: str) -> None:
    src = FlakySource(2, fail_at={0})
    it = iter(make(kind, src))
    with pytest.raises(Boom):
        next(it)
    assert next(it).item() == 1.0


@pytest.mark.parametrize("kind", PATHS)
def test_dataloader_worker_exception_surfaces(kind: str) -> None:
    class Bad(NestedDataset):
        def __getitem__(self, i: int) -> dict[str, Any]:
            if i == 3:
                raise KeyError("sample 3 is broken")
            return super().__getitem__(i)

    it = iter(make(kind, DataLoader(Bad(6), batch_size=2)))
    assert next(it)["x"][0, 0].item() == 0.0
    with pytest.raises(KeyError, match="sample 3 is broken"):
        next(it)


@pytest.mark.parametrize("kind", PATHS)
def test_break_frees_everything(kind: str) -> None:
    refs: list[weakref.ref[torch.Tensor]] = []

    def make_batch(i: int) -> dict[str, torch.Tensor]:
        t = torch.full((4,), float(i))
        refs.append(weakref.ref(t))
        return {"x": t}

    def source() -> Iterator[dict[str, torch.Tensor]]:
        for i in range(10):
            yield make_batch(i)  # the generator frame keeps no reference

    wrapped = make(kind, source())
    for batch in wrapped:
        refs.append(weakref.ref(batch["x"]))
        if batch["x"][0].item() == 2.0:
            break
    del batch
    gc.collect()
    # no batch, prefetched or handed over, source or copy, is kept alive
    assert len(refs) >= 6 if kind == "fake_cuda" else len(refs) == 6
    assert [r() for r in refs if r() is not None] == []


def test_cpu_path_is_a_true_pass_through() -> None:
    batch = {"x": torch.zeros(2), "s": "a"}
    wrapped = PrefetchLoader([batch, batch])
    assert wrapped.device == torch.device("cpu")
    assert all(b is batch for b in wrapped)


def test_cpu_path_touches_no_tracer() -> None:
    class Exploding:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"tracer.{name} used on the CPU path")

    assert len(list(PrefetchLoader([torch.zeros(1)] * 3, tracer=Exploding()))) == 3


def test_cuda_requested_without_cuda_is_a_pass_through() -> None:
    be = FakeBackend(available=False)
    wrapped = PrefetchLoader([torch.ones(1)], device="cuda:1", _backend=be)
    assert wrapped.device == torch.device("cpu")
    assert [b.item() for b in wrapped] == [1.0]
    assert be.streams == [] and be.events == []


def test_attributes_forwarded_to_the_wrapped_loader() -> None:
    dl = DataLoader(NestedDataset(4), batch_size=2)
    wrapped = PrefetchLoader(dl)
    assert wrapped.batch_size == 2 and wrapped.dataset is dl.dataset
    with pytest.raises(AttributeError):
        _ = wrapped.no_such_attribute


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="iterable"):
        PrefetchLoader(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="device"):
        PrefetchLoader([], device=1.5)  # type: ignore[arg-type]


# -------------------------------------------------- CUDA logic through fake streams


def names(log: list[tuple[Any, ...]]) -> list[str]:
    return [e[0] for e in log]


def test_first_next_hands_over_batch_0_and_queues_batch_1() -> None:
    loader, be = fake_loader([torch.zeros(2), torch.ones(3)])
    it = iter(loader)
    b0 = next(it)
    assert torch.equal(b0, torch.zeros(2))
    copy = be.streams[0].name
    assert be.log == [
        # stage batch 0: a timed copy; the copy stream waits for nothing on the consumer
        ("pin",),  # on the host, before the timed span starts
        ("record", 0, copy),
        ("copy", copy, (2,), True),
        ("record", 1, copy),
        # hand over batch 0: the exposed wait is timed on the consumer stream
        ("open", "h2d"),
        ("wait_event", "consumer", 1),
        ("close", "h2d"),
        ("side", "h2d_copy", 0, 1),
        ("counter", "h2d_bytes", 8),
        # batch 1 is already queued before batch 0 is returned: it overlaps the compute
        ("pin",),
        ("record", 2, copy),
        ("copy", copy, (3,), True),
        ("record", 3, copy),
    ]
    assert be.events[0].timing and be.events[1].timing


def test_consumer_waits_on_the_event_of_its_own_batch() -> None:
    loader, be = fake_loader([torch.full((1,), float(i)) for i in range(4)])
    out = [b.item() for b in loader]
    assert out == [0.0, 1.0, 2.0, 3.0]
    copy = be.streams[0].name
    waits = [e[2] for e in be.log if e[0] == "wait_event" and e[1] == "consumer"]
    done_events = [e[1] for e in be.log if e[0] == "record" and e[2] == copy][1::2]
    assert waits == done_events  # batch k waits exactly on the event after copy k
    # No copy is ordered after the consumer's work (that would serialise copy and compute):
    # the copy stream waits for nothing while batches flow.
    last_copy = max(i for i, e in enumerate(be.log) if e[0] == "copy")
    assert not [e for e in be.log[:last_copy] if e[0] in ("wait_stream", "wait_event")
                and e[1] == copy]
    # Each batch's last use is marked on the consumer when the next one is handed over.
    used = [e[1] for e in be.log if e[0] == "record" and e[2] == "consumer"]
    assert len(used) == 4  # batches 0-2 at the next hand-over, batch 3 at the epoch end
    # the host never synchronises while batches flow (only the end waits out the tail)
    last_wait = max(i for i, e in enumerate(be.log) if e[0] == "wait_event")
    assert "sync" not in names(be.log[: last_wait + 1])


def test_safe_reuse_follows_the_current_consumer_stream() -> None:
    loader, be = fake_loader([torch.zeros(1)] * 4)
    it = iter(loader)
    next(it)
    first = be.consumer
    be.consumer = FakeStream("side", be.log)  # caller switched streams
    be.log.clear()
    b1 = next(it)
    assert ("wait_event", "side", 3) in be.log
    for e in be.events:
        if e.stream is first:
            e.done = True  # batch 0's last use, on the first consumer stream, is behind us
    ref = weakref.ref(b1)
    del b1
    be.log.clear()
    next(it)  # batch 1's last use is marked on the stream it was handed over on
    (used,) = [e[1] for e in be.log if e[0] == "record" and e[2] == "side"]
    gc.collect()
    assert ref() is not None  # kept alive: the side stream may still read it
    be.events[used].done = True
    next(it)
    gc.collect()
    assert ref() is None  # released once the side stream passed it, without a sync
    assert "sync" not in names(be.log)


def test_one_copy_stream_reused_across_epochs() -> None:
    loader, be = fake_loader([torch.zeros(1)] * 2)
    for _ in range(3):
        assert len(list(loader)) == 2
    assert len(be.streams) == 1
    used = {e[1] for e in be.log if e[0] in ("copy", "wait_stream")}
    assert used == {be.streams[0].name}
    # the stream was created under the target device
    assert be.devices_entered[0] == CUDA0


def test_pinned_source_kept_alive_until_its_copy_event_completes() -> None:
    src = [torch.full((2,), float(i)) for i in range(3)]
    originals = [t.clone() for t in src]
    loader, be = fake_loader(src)
    it = iter(loader)
    next(it)  # batch 0 handed over (its copy may still run), batch 1 staged
    gc.collect()
    assert be.pins[0]() is not None and be.pins[1]() is not None
    next(it)  # batch 0's event is not done yet: its pinned source must survive
    gc.collect()
    assert be.pins[0]() is not None
    be.events[1].done = True  # batch 0's copy completed
    next(it)
    gc.collect()
    assert be.pins[0]() is None  # released at the next poll, without a sync
    assert be.pins[1]() is not None
    assert "sync" not in names(be.log)
    for t, o in zip(src, originals, strict=True):
        assert torch.equal(t, o)  # sources never modified


def test_end_of_epoch_leaves_nothing_in_flight() -> None:
    loader, be = fake_loader([torch.zeros(1)] * 2)
    assert len(list(loader)) == 2
    gc.collect()
    # unfinished copies were waited out once, at the end, then every pinned source freed
    copy = be.streams[0]
    assert all(e.done for e in be.events if e.stream is copy and not e.timing)
    assert [p() for p in be.pins] == [None, None]
    # batches the consumer may still read were let go without a sync: the next copy on
    # the copy stream waits for their last use on the GPU
    used = [e.n for e in be.events if e.stream is be.consumer]
    assert used and [("wait_event", copy.name, n) for n in used] == [
        e for e in be.log if e[0] == "wait_event" and e[1] == copy.name]


def test_break_waits_for_the_prefetched_copy_and_frees_it() -> None:
    loader, be = fake_loader([torch.full((4,), float(i)) for i in range(5)])
    for batch in loader:
        if batch[0].item() == 1.0:
            break
    # batch 2 was queued; the loop's iterator is gone, so its copy was waited out
    copy = be.streams[0].name
    done2 = [e[1] for e in be.log if e[0] == "record" and e[2] == copy][-1]
    assert be.log[-1] == ("sync", done2)
    del batch
    gc.collect()
    assert [p() for p in be.pins] == [None, None, None]


def test_already_pinned_and_on_device_tensors() -> None:
    be = FakeBackend()
    pinned = be.mark_pinned(torch.ones(3))
    on_dev = be.mark_on_device(torch.ones(5))
    loader = PrefetchLoader(
        [{"p": pinned, "d": on_dev, "n": 3, "s": "x"}], device=CUDA0, tracer=FakeTracer(be.log), _backend=be
    )
    (out,) = list(loader)
    assert out["d"] is on_dev  # left alone, not copied
    assert torch.equal(out["p"], pinned) and out["p"] is not pinned
    assert out["n"] == 3 and out["s"] == "x"
    assert be.pins == []  # already pinned: used as it is
    assert [e for e in be.log if e[0] == "copy"] == [("copy", "copy0", (3,), True)]
    assert ("counter", "h2d_bytes", 12) in be.log


def test_pin_memory_false_and_blocking_copies() -> None:
    loader, be = fake_loader([torch.zeros(2)], pin_memory=False, non_blocking=False)
    assert len(list(loader)) == 1
    assert be.pins == []
    assert ("copy", "copy0", (2,), False) in be.log


def test_objects_with_to_are_moved_on_the_copy_stream() -> None:
    calls: list[tuple[Any, ...]] = []

    class Encoding:
        def __init__(self, be: FakeBackend) -> None:
            self.be = be

        def to(self, device: torch.device, non_blocking: bool = False) -> str:
            assert self.be.active is not None and self.be.active.name == "copy0"
            calls.append((device, non_blocking))
            return "moved"

    be = FakeBackend()
    loader = PrefetchLoader(
        [[Encoding(be), np.ones(2)]], device=CUDA0, tracer=FakeTracer(be.log), _backend=be
    )
    (out,) = list(loader)
    assert out[0] == "moved" and calls == [(CUDA0, True)]
    assert isinstance(out[1], np.ndarray)  # numpy leaves pass through


def test_disabled_tracer_does_no_extra_work() -> None:
    loader, be = fake_loader([torch.zeros(1)] * 3, recording=False, enabled=False)
    assert len(list(loader)) == 3
    assert not {"open", "close", "side", "counter"} & set(names(be.log))
    assert all(not e.timing for e in be.events)
    # one plain "copy done" event per batch, no start events; one "last use" per batch
    assert len([e for e in be.events if e.stream is be.streams[0]]) == 3
    assert len([e for e in be.events if e.stream is be.consumer]) == 3


def test_unsampled_steps_report_nothing_but_copies_stay_timed() -> None:
    loader, be = fake_loader([torch.zeros(1)] * 3, recording=False)
    assert len(list(loader)) == 3
    assert not {"open", "close", "side", "counter"} & set(names(be.log))


def test_sampling_is_decided_at_hand_over_for_the_consuming_step() -> None:
    """every_n_steps >= 2: batch N+1 is staged while step N is not sampled, yet step N+1 is.
    The copy is timed anyway and reported in full when the sampled step consumes it."""
    be = FakeBackend()
    tracer = FakeTracer(be.log, recording=False)
    loader = PrefetchLoader([torch.zeros(1)] * 3, device=CUDA0, tracer=tracer, _backend=be)
    it = iter(loader)
    next(it)  # batch 0 handed over unsampled; batch 1 staged while not recording
    tracer.recording = True
    be.log.clear()
    next(it)  # batch 1 consumed by a sampled step: exposed wait, copy span and bytes
    assert [e[0] for e in be.log if e[0] in ("open", "side", "counter")] == ["open", "side", "counter"]
    tracer.recording = False
    be.log.clear()
    next(it)  # an unsampled consumer: nothing reported
    assert not {"open", "side", "counter"} & set(names(be.log))


def test_failure_while_staging_keeps_the_previous_batch() -> None:
    loader, be = fake_loader([torch.full((1,), float(i)) for i in range(4)])
    be.fail_pin_at = 1  # pinning batch 1 fails
    it = iter(loader)
    assert next(it).item() == 0.0  # batch 0 still delivered
    with pytest.raises(RuntimeError, match="pinned allocation failed"):
        next(it)
    be.fail_pin_at = None
    assert [b.item() for b in it] == [2.0, 3.0]


def test_device_from_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    be = FakeBackend(count=4, current=0)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert PrefetchLoader([], _backend=be).device == torch.device("cuda", 3)
    assert PrefetchLoader([], device="cuda", _backend=be).device == torch.device("cuda", 3)
    assert PrefetchLoader([], device=1, _backend=be).device == torch.device("cuda", 1)
    # CUDA_VISIBLE_DEVICES narrowed to one GPU per rank: LOCAL_RANK is out of range
    be_one = FakeBackend(count=1, current=0)
    assert PrefetchLoader([], _backend=be_one).device == torch.device("cuda", 0)
    monkeypatch.delenv("LOCAL_RANK")
    be.current = 2
    assert PrefetchLoader([], _backend=be).device == torch.device("cuda", 2)


def test_device_resolved_at_first_iteration_and_everything_under_it() -> None:
    be = FakeBackend(count=4, current=0)
    loader = PrefetchLoader([torch.zeros(1)] * 2, tracer=FakeTracer(be.log), _backend=be)
    be.current = 2  # the user calls torch.cuda.set_device after building the loader
    assert len(list(loader)) == 2
    assert set(be.devices_entered) == {torch.device("cuda", 2)}


def test_default_tracer_looked_up_when_iteration_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    import stepscope.lifecycle

    be = FakeBackend()
    lookups = itertools.count()

    def fake_current() -> FakeTracer:
        next(lookups)
        return FakeTracer(be.log)

    monkeypatch.setattr(stepscope.lifecycle, "current_tracer", fake_current)
    loader = PrefetchLoader([torch.zeros(1)] * 2, device=CUDA0, _backend=be)
    assert next(lookups) == 0  # not at construction
    assert len(list(loader)) == 2
    assert len(list(loader)) == 2
    assert next(lookups) == 3  # once per epoch
    assert ("counter", "h2d_bytes", 4) in be.log


def test_internal_copies_are_hidden_from_the_automatic_h2d_timing() -> None:
    loader, be = fake_loader([torch.zeros(1)] * 2)
    h2d.set_step_tracer(FakeTracer([]))  # as inside a sampled step() on this thread
    try:
        assert h2d._active() is not None
        assert len(list(loader)) == 2
        assert h2d._active() is not None  # restored afterwards
    finally:
        h2d.set_step_tracer(None)
    assert be.auto_h2d_active == [None, None]


def test_real_tracer_gets_exposed_copy_hidden_and_bytes(mem_tracer: Any) -> None:
    """Through the real Tracer with CUDA-clock logic on fake events: 5 ms copies fully
    hidden behind 10 ms of compute, bytes counted, nothing forced to wait."""
    be = FakeBackend()
    be.copy_ms, be.instant = 5.0, True
    tr = mem_tracer(
        clock=CudaClock(event_factory=lambda: be.new_event(True), current_device=lambda: 0),
        auto=False,
        flush_every_n_steps=1,
    )
    loader = PrefetchLoader([torch.zeros(8)] * 4, device=CUDA0, tracer=tr, _backend=be)
    for _batch in loader:
        with tr.step():
            be.now += 10.0
    tr.finish()
    recs = tr.sink.records
    assert len(recs) == 4
    for rec in recs:
        h2d_phase = [p for p in rec["phases"] if p["name"] == "h2d"]
        assert len(h2d_phase) == 1 and h2d_phase[0]["ms"] == 0.0
        assert rec["side_ms"] == {"h2d_copy": 5.0}
        assert rec["h2d_hidden_ms"] == 5.0
        assert rec["counters"]["h2d_bytes"] == 32
    assert "sync" not in names(be.log)


def test_real_init_on_cpu_passes_batches_and_reports_no_h2d(tmp_path: Any) -> None:
    batches = [{"x": torch.full((2,), float(i)), "id": i} for i in range(3)]
    stepscope.init(out_dir=str(tmp_path), flush_every_n_steps=1)
    try:
        seen = []
        for batch in PrefetchLoader(batches):
            with stepscope.step():
                seen.append(batch)
    finally:
        stepscope.finish()
    assert len(seen) == 3 and all(a is b for a, b in zip(seen, batches, strict=True))
    recs = read_run(tmp_path)
    assert len(recs) == 3
    for rec in recs:
        assert "h2d" not in {p["name"] for p in rec["phases"]}
        assert "h2d_bytes" not in rec.get("counters", {})
        assert "side_ms" not in rec and "h2d_hidden_ms" not in rec
