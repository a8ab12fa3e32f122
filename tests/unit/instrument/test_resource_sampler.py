"""Throughput, counters, memory (CUDA with fakes, host RSS), NVML sampling and their verdicts."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import psutil
import pytest
import torch

import stepscope
from stepscope.analysis.run import analyze_run
from stepscope.common.errors import StepscopeWarning
from stepscope.instrument import resource_sampler as res
from stepscope.instrument.resource_sampler import NvmlSampler, ResourceMonitor, TorchCudaMemory, start_nvml
from stepscope.recording.schema import SCHEMA_VERSION

MiB = 1 << 20


# ------------------------------------------------------------------ throughput & counters


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3", 2**0.5])
def test_bad_counts_warn_and_are_not_counted(mem_tracer, bad):
    tr = mem_tracer(auto=False)
    with pytest.warns(StepscopeWarning, match="tokens must be"), tr.step(tokens=bad):
        pass
    with pytest.warns(StepscopeWarning, match="samples must be"), tr.step(samples=bad):
        pass
    with tr.step():
        tr.count("tokens", bad)  # warned once already: silent now
    tr.finish()
    assert all("throughput" not in r for r in tr.sink.records)


def test_count_outside_a_step_warns_and_counts_nothing(mem_tracer):
    tr = mem_tracer(auto=False)
    with pytest.warns(StepscopeWarning, match="outside a step"):
        tr.count("tokens", 5)
    with tr.step():
        pass
    tr.finish()
    assert "throughput" not in tr.sink.records[0]


def test_throughput_from_step_arguments_and_counters(mem_tracer):
    tr = mem_tracer(auto=False, every_n_steps=2)
    for i in range(6):
        with tr.step(tokens=1000, samples=8):
            if i % 2 == 0:
                tr.count("tokens", 24)
                tr.count("tokens", 0)
            time.sleep(0.002)
    tr.finish()
    recs = tr.sink.records
    assert [r["step"] for r in recs] == [0, 2, 4]
    for r in recs:
        t = r["throughput"]
        assert t["tokens"] == 1024 and t["samples"] == 8
        assert t["tokens_per_s"] == pytest.approx(1024 / (r["step_ms"] / 1e3), rel=1e-3)
        assert t["samples_per_s"] == pytest.approx(8 / (r["step_ms"] / 1e3), rel=1e-3)
        assert "tokens" not in r.get("counters", {}), "counted once, in the throughput section"
        assert "flops" not in r and "device" not in r and r["device_name"] == "cpu"


def test_unsampled_step_counts_do_not_leak_into_the_next_step(mem_tracer):
    tr = mem_tracer(auto=False, every_n_steps=2)
    with tr.step(tokens=7):
        pass
    with tr.step(tokens=99):  # not sampled
        tr.count("tokens", 1)
    with tr.step():
        pass
    tr.finish()
    recs = tr.sink.records
    assert recs[0]["throughput"]["tokens"] == 7
    assert "throughput" not in recs[1], "nothing given for step 2: the section is absent"


def test_module_level_step_and_count(tmp_path):
    stepscope.init(out_dir=str(tmp_path), auto=False)
    for _ in range(3):
        with stepscope.step(samples=4):
            stepscope.count("tokens", 512)
    stepscope.finish()
    recs = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    assert [r["throughput"]["tokens"] for r in recs] == [512] * 3
    assert all(r["throughput"]["samples"] == 4 for r in recs)


# ------------------------------------------------------------------ memory


class FakeCudaMemory:
    """Records the calls the monitor makes; values in bytes."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.peak = 0
        self.current = 0

    def user_reset(self) -> None:
        """The job's own ``torch.cuda.reset_peak_memory_stats`` (HF, torchtitan do this)."""
        self.peak = self.current

    def alloc(self, n: int) -> None:
        self.current += n
        self.peak = max(self.peak, self.current)

    def free(self, n: int) -> None:
        self.current -= n

    def read(self) -> tuple[int, int, int]:
        self.calls.append("read")
        return self.peak, self.peak + 2 * MiB, self.current

    def alloc_stats(self) -> tuple[int, int]:
        self.calls.append("alloc_stats")
        return 3, 0


def test_memory_peak_is_the_running_high_water_mark_and_the_users_counters_are_left_alone():
    cuda = FakeCudaMemory()
    mon = ResourceMonitor(device="cpu", cuda=cuda, host=False)
    out = []
    user_peaks = []
    for step, (a, f) in enumerate([(100 * MiB, 100 * MiB), (10 * MiB, 0), (5 * MiB, 0)]):
        if step == 2:
            cuda.user_reset()  # the job resets its own counter between steps
        mon.on_step_start(step)
        cuda.alloc(a)
        cuda.free(f)
        out.append(mon.step_fields(step, 0, 5.0, {}, mon.on_step_end(step))["memory"])
        user_peaks.append(cuda.peak)
    assert out[0] == {"peak_allocated_mb": 100.0, "peak_reserved_mb": 102.0, "allocated_mb": 0.0,
                      "alloc_retries": 3, "ooms": 0}
    # Before: stepscope reset the peak at every step, so the job's own max_memory_allocated()
    # read 10 MiB after step 1. Now the job keeps its 100 MiB high-water mark...
    assert user_peaks[:2] == [100 * MiB, 100 * MiB]
    assert out[1]["peak_allocated_mb"] == 100.0 and out[1]["allocated_mb"] == 10.0
    # ...and a reset by the job is followed, not fought: 10 MiB left + 5 MiB new.
    assert out[2]["peak_allocated_mb"] == 15.0 and out[2]["allocated_mb"] == 15.0
    assert "reset" not in cuda.calls and cuda.calls[:2] == ["read", "alloc_stats"]


def test_cuda_memory_reads_never_synchronize(monkeypatch):
    """TorchCudaMemory against a fake torch.cuda whose sync points raise."""

    def boom(*a, **k):
        raise AssertionError("host sync")

    nested = {"allocated_bytes": {"all": {"peak": 64 * MiB, "current": 8 * MiB}},
              "reserved_bytes": {"all": {"peak": 96 * MiB}}}
    seen: list[str] = []
    for name in ("synchronize", "current_stream", "Event", "Stream", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, boom)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", boom)  # the job's counters
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda d: seen.append("nested") or nested)
    monkeypatch.setattr(torch.cuda, "memory_stats",
                        lambda d: seen.append("flat") or {"num_alloc_retries": 2, "num_ooms": 1})
    mon = ResourceMonitor(device="cpu", cuda=TorchCudaMemory(0), host=False)
    mon.on_step_start(0)
    snap = mon.on_step_end(0)
    assert seen == ["nested"], "the hot path makes exactly one read and resets nothing"
    mem = mon.step_fields(0, 0, 5.0, {}, snap)["memory"]
    assert mem == {"peak_allocated_mb": 64.0, "peak_reserved_mb": 96.0, "allocated_mb": 8.0,
                   "alloc_retries": 2, "ooms": 1}


def test_cpu_records_have_rss_and_no_cuda_fields(mem_tracer):
    tr = mem_tracer(auto=False, flush_every_n_steps=1)
    for _ in range(3):
        with tr.step():
            pass
    tr.finish()
    now = psutil.Process().memory_info().rss / MiB
    for r in tr.sink.records:
        mem = r["memory"]
        assert set(mem) <= {"rss_mb", "workers_rss_mb"}
        assert 0.5 * now < mem["rss_mb"] < 2 * now


def test_dataloader_workers_rss_is_summed(mem_tracer):
    ds = torch.utils.data.TensorDataset(torch.randn(64, 4))
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True)
    tr = mem_tracer(auto={"dataloader"}, flush_every_n_steps=1)
    it = iter(tr.wrap_loader(loader))
    for _ in range(4):
        next(it)
        with tr.step():
            pass
    assert len(psutil.Process().children()) >= 2
    tr.finish()
    mem = tr.sink.records[0]["memory"]
    assert mem["workers_rss_mb"] > 1.0
    del it, loader


# ------------------------------------------------------------------ NVML (fake module)


class FakeNvml:
    NVML_CLOCK_SM = 1
    NVML_TEMPERATURE_GPU = 0

    def __init__(self, clock: float = 1980.0, fail_power_after: int | None = None) -> None:
        self.clock = clock
        self.power_calls = 0
        self.fail_power_after = fail_power_after

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        return "h"

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return "h"

    def nvmlDeviceGetUtilizationRates(self, h):
        return type("U", (), {"gpu": 97})()

    def nvmlDeviceGetClockInfo(self, h, kind):
        assert kind == self.NVML_CLOCK_SM
        return self.clock

    def nvmlDeviceGetPowerUsage(self, h):
        self.power_calls += 1
        if self.fail_power_after is not None and self.power_calls > self.fail_power_after:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return 650_000  # mW

    def nvmlDeviceGetTemperature(self, h, kind):
        return 71


def test_nvml_samples_attach_to_the_step_interval():
    sampler = start_nvml(0, FakeNvml(), interval_s=0.01)
    assert sampler is not None
    try:
        t0 = time.time_ns()
        time.sleep(0.08)
        dev = sampler.window(t0, time.time_ns())
    finally:
        sampler.stop()
    assert dev == {"util_pct": 97.0, "sm_clock_mhz": 1980.0, "power_w": 650.0, "temp_c": 71.0}
    # A step long after the last sample (more than one interval) gets nothing.
    late = time.time_ns() + 10**9
    assert sampler.window(late, late + 10**6) == {}


def test_nvml_error_mid_run_stops_that_metric_only():
    fake = FakeNvml(fail_power_after=2)
    sampler = NvmlSampler(res._nvml_readers(fake, "h"), interval_s=0.01)
    t0 = time.time_ns()
    with pytest.warns(StepscopeWarning, match="power_w"):
        for _ in range(5):
            sampler.sample_once()
    assert "power_w" in sampler.failed and "power_w" not in sampler.readers
    last = sampler.window(time.time_ns() - 1, time.time_ns())
    assert set(last) == {"util_pct", "sm_clock_mhz", "temp_c"}
    assert sampler.window(t0, time.time_ns())["power_w"] == 650.0  # earlier samples keep it


def test_no_nvml_means_no_device_section():
    class Broken(FakeNvml):
        def nvmlInit(self) -> None:
            raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    assert start_nvml(0, Broken()) is None
    mon = ResourceMonitor(device="cpu", nvml=Broken(), host=False)
    assert "device" not in mon.step_fields(0, time.time_ns(), 5.0, {}, mon.on_step_end(0))


def test_monitor_puts_device_health_in_the_record_section():
    mon = ResourceMonitor(device="cpu", nvml=FakeNvml(clock=1410.0), host=False, nvml_interval_s=0.01)
    try:
        t0 = time.time_ns()
        mon.on_step_start(0)
        time.sleep(0.05)
        fields = mon.step_fields(0, t0, (time.time_ns() - t0) / 1e6, {}, mon.on_step_end(0))
    finally:
        mon.close()
    assert fields["device"]["sm_clock_mhz"] == 1410.0 and "name" not in fields["device"]


# ------------------------------------------------------------------ analysis on synthetic records


def _write_run(root: Path, n_ranks: int, n_steps: int, extra) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for rank in range(n_ranks):
        with open(root / f"rank{rank}.jsonl", "w") as fh:
            for step in range(n_steps):
                rec = {
                    "schema": SCHEMA_VERSION, "run_id": "synth", "rank": rank, "local_rank": rank,
                    "world_size": n_ranks, "hostname": "node", "device": f"cuda:{rank}",
                    "step": step, "start_unix_ns": 10**18 + step * 20_000_000, "clock": "cuda",
                    "step_ms": 20.0,
                    "phases": [{"name": "forward", "parent": None, "ms": 18.0, "calls": 1,
                                "start_ms": 0.0, "end_ms": 18.0}],
                    "residual_ms": 2.0, "dropped": {},
                }
                rec.update(extra(rank, step))
                fh.write(json.dumps(rec) + "\n")


def _kinds(doc):
    return [v["kind"] for v in doc["verdicts"]]


def test_throttled_device_names_the_slow_clock_rank(tmp_path):
    def extra(rank, step):
        clock = 1350.0 if rank == 2 else 1980.0 - (step % 3)
        return {"device": {"name": f"cuda:{rank}", "util_pct": 99.0, "sm_clock_mhz": clock,
                           "power_w": 690.0 - (rank == 2) * 200, "temp_c": 88.0 if rank == 2 else 60.0}}

    _write_run(tmp_path / "run", 4, 20, extra)
    doc = analyze_run(tmp_path / "run")
    throttled = [v for v in doc["verdicts"] if v["kind"] == "throttled_device"]
    assert len(throttled) == 1
    ev = throttled[0]["evidence"]
    assert ev.startswith("rank 2:") and "1350 MHz" in ev and "1979 MHz" in ev and "88" in ev
    table = {r["rank"]: r for r in doc["run"]["device"]["per_rank"]}
    assert sorted(table) == [0, 1, 2, 3]
    assert table[2]["sm_clock_mhz"] == {"min": 1350.0, "median": 1350.0, "max": 1350.0}
    assert table[0]["sm_clock_mhz"]["min"] == 1978.0 and table[0]["sm_clock_mhz"]["max"] == 1980.0


def test_equal_devices_are_not_throttled(tmp_path):
    def extra(rank, step):
        return {"device": {"util_pct": 99.0, "sm_clock_mhz": 1980.0 - 15 * (rank % 2),
                           "power_w": 650.0 + 10 * rank, "temp_c": 60.0}}

    _write_run(tmp_path / "run", 4, 20, extra)
    doc = analyze_run(tmp_path / "run")
    assert "throttled_device" not in _kinds(doc)
    assert len(doc["run"]["device"]["per_rank"]) == 4


def test_job_throughput_memory_and_pressure(tmp_path):
    def extra(rank, step):
        return {
            "throughput": {"tokens": 2048, "samples": 4, "tokens_per_s": 1000.0 + rank * 100,
                           "samples_per_s": 2.0},
            "flops": {"per_step": 10**13, "tflops": 500.0, "mfu": 0.5},
            "memory": {"peak_allocated_mb": 1000.0 + rank, "peak_reserved_mb": 1200.0,
                       "allocated_mb": 500.0, "rss_mb": 3000.0 + step, "alloc_retries": 4 * (rank == 1),
                       "ooms": 0},
        }

    _write_run(tmp_path / "run", 2, 12, extra)
    doc = analyze_run(tmp_path / "run")
    thr, mem = doc["run"]["throughput"], doc["run"]["memory"]
    assert thr["tokens_per_s"] == 2100.0 and thr["samples_per_s"] == 4.0 and thr["mfu"] == 0.5
    assert mem["peak_allocated_mb"] == 1001.0 and mem["rss_mb"] == 3011.0
    pressure = [v for v in doc["verdicts"] if v["kind"] == "memory_pressure"]
    assert len(pressure) == 1 and "rank 1: 4 allocator retries" in pressure[0]["evidence"]
    assert "expandable_segments:True" in pressure[0]["suggestion"]
    assert "memory_creep" not in _kinds(doc), "allocated flat: a rising RSS is not what GPU runs judge"
    from stepscope.report.markdown import render_markdown

    md = render_markdown(doc)
    assert "2,100 tokens/s" in md and "MFU 50.0%" in md and "peak allocated 1,001 MB" in md
    assert "| 1 | 1,100 | 50.0% | 1,001 |" in md


def test_untimed_flop_counting_step_is_left_out_of_timing(tmp_path):
    def extra(rank, step):
        return {"untimed": True, "step_ms": 5000.0} if step == 0 else {}

    _write_run(tmp_path / "run", 2, 10, extra)
    doc = analyze_run(tmp_path / "run")
    assert doc["run"]["steps"] == 9 and doc["run"]["first_step"] == 1
    assert doc["run"]["step_ms"]["median"] == 20.0


def test_no_resource_fields_give_nulls_not_zeros(tmp_path):
    _write_run(tmp_path / "run", 2, 10, lambda r, s: {})
    doc = analyze_run(tmp_path / "run")
    assert doc["run"]["throughput"] == {"tokens_per_s": None, "samples_per_s": None, "tflops": None,
                                        "mfu": None}
    assert doc["run"]["memory"]["peak_allocated_mb"] is None and doc["run"]["memory"]["rss_mb"] is None
    assert doc["run"]["device"] is None
    assert not {"memory_creep", "memory_pressure", "throttled_device"} & set(_kinds(doc))


# ------------------------------------------------------------------ memory_creep in a real process

_LOOP = textwrap.dedent(
    """
    import sys, time, torch, stepscope
    torch.set_num_threads(1)
    out, leak = sys.argv[1], sys.argv[2] == "1"
    stepscope.init(out_dir=out, auto=False, flush_every_n_steps=1)
    kept = []
    for i in range(160):
        with stepscope.step(tokens=256):
            t = torch.ones(256 * 1024)  # 1 MiB, every page touched
            loss = (t * 2).sum()
            if leak:
                kept.append(t)  # e.g. tensors kept for logging
            time.sleep(0.004)
    stepscope.finish()
    """
)


def _run_loop(tmp_path: Path, leak: bool) -> dict:
    out = tmp_path / ("leak" if leak else "steady")
    subprocess.run([sys.executable, "-c", _LOOP, str(out), "1" if leak else "0"], check=True, timeout=300)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return analyze_run(out)


def test_memory_creep_on_a_real_leak_and_not_on_a_steady_loop(tmp_path):
    leak = _run_loop(tmp_path, leak=True)
    creep = [v for v in leak["verdicts"] if v["kind"] == "memory_creep"]
    assert len(creep) == 1, leak["verdicts"]
    assert "process RSS" in creep[0]["evidence"] and "rank 0" in creep[0]["evidence"]
    found = leak["run"]["memory"]["creep"][0]
    assert found["metric"] == "rss_mb" and 80 < found["rise_mb"] < 250
    steady = _run_loop(tmp_path, leak=False)
    assert "memory_creep" not in _kinds(steady), steady["run"]["memory"]
    assert steady["run"]["memory"]["rss_mb"] < leak["run"]["memory"]["rss_mb"]


def test_creep_test_ignores_one_jump_and_noise():
    steps = list(range(200))
    for at in (60, 100, 120, 160):
        flat_jump = [300.0 if s < at else 340.0 for s in steps]
        assert res_creep(steps, flat_jump) is None, at
    small_leak = [300.0 + 0.5 * s for s in steps]  # 100 MB over the run, 500 KB a step
    assert res_creep(steps, small_leak) is not None
    drift = [300.0 + 0.015 * s for s in steps]  # +1% over the run: allocator/page-cache drift
    assert res_creep(steps, drift) is None
    big_but_small_share = [4000.0 + 0.5 * s for s in steps]  # +100 MB on 4 GB: 2.5%
    assert res_creep(steps, big_but_small_share) is None
    noisy = [300.0 + (7 * s % 11) for s in steps]
    assert res_creep(steps, noisy) is None
    rising = [300.0 + 0.5 * s + (7 * s % 3) for s in steps]
    assert res_creep(steps, rising)["slope_mb_per_step"] == pytest.approx(0.5, rel=0.05)


def res_creep(steps, values):
    from stepscope.analysis.resource_use import creep_test

    return creep_test(steps, values, "rss_mb")


# ------------------------------------------------------------------ GPU (skipped without CUDA)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_memory_fields_on_a_real_device(tmp_path):
    stepscope.init(out_dir=str(tmp_path), auto=False, flush_every_n_steps=1)
    keep = None
    for i in range(3):
        with stepscope.step():
            x = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")  # 64 MiB
            if i == 0:
                keep = x
            del x
    stepscope.finish()
    recs = [json.loads(line) for line in (tmp_path / "rank0.jsonl").read_text().splitlines()]
    for r in recs:
        m = r["memory"]
        assert m["peak_allocated_mb"] >= 64 and m["peak_reserved_mb"] >= m["peak_allocated_mb"]
        assert m["allocated_mb"] >= 64 and m["alloc_retries"] == 0 and m["ooms"] == 0
    assert keep is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nvml_on_a_real_device():
    pytest.importorskip("pynvml")
    sampler = start_nvml(torch.cuda.current_device(), interval_s=0.05)
    if sampler is None:
        pytest.skip("NVML not usable here")
    try:
        t0 = time.time_ns()
        time.sleep(0.3)
        dev = sampler.window(t0, time.time_ns())
    finally:
        sampler.stop()
    assert dev["sm_clock_mhz"] > 0 and dev["temp_c"] > 0 and 0 <= dev["util_pct"] <= 100


def test_sqlite_sink_keeps_the_new_sections(tmp_path):
    from stepscope.recording.sinks import SqliteSink

    rec = {"schema": SCHEMA_VERSION, "rank": 0, "step": 3, "start_unix_ns": 1, "clock": "cuda",
           "step_ms": 2.0, "phases": [], "throughput": {"tokens": 8, "tokens_per_s": 4000.0},
           "flops": {"per_step": 10, "tflops": 1.0, "mfu": 0.5}, "memory": {"rss_mb": 12.5},
           "device": {"name": "cuda:0", "sm_clock_mhz": 1410.0}, "untimed": True}
    sink = SqliteSink(tmp_path, 0)
    sink.write([rec])
    sink.close()
    from stepscope.recording.schema import read_sqlite

    back = read_sqlite(tmp_path / "rank0.sqlite")[0]
    for key in ("throughput", "flops", "memory", "device", "untimed"):
        assert back[key] == rec[key], key


def test_a_failing_allocator_read_stops_memory_not_timing(mem_tracer):
    class Broken(FakeCudaMemory):
        def read(self):
            raise KeyError("allocated_bytes")

    tr = mem_tracer(auto=False, flush_every_n_steps=1)
    tr._resources = ResourceMonitor(device="cpu", cuda=Broken(), host=False)
    with pytest.warns(StepscopeWarning, match="CUDA memory stopped"):
        for _ in range(3):
            with tr.step(tokens=4):
                pass
    tr.finish()
    assert tr.enabled and len(tr.sink.records) == 3
    assert all("memory" not in r and r["throughput"]["tokens"] == 4 for r in tr.sink.records)
