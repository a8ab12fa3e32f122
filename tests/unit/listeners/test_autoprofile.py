"""Auto-profile: the slow-step detector, bounded captures, triggers.jsonl, a healthy rank."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from stepscope.common.errors import ConfigError
from stepscope.listeners.autoprofile import SlowStepDetector
from stepscope.recording.config import AutoProfileConfig, resolve_auto_profile
from stepscope.recording.dist import become_local_rank, spawn_local
from stepscope.recording.schema import TRIGGERS_FILE


def _feed(det: SlowStepDetector, values) -> list[int]:
    return [i for i, v in enumerate(values) if det.update(v) is not None]


def test_detector_needs_history_patience_and_a_real_slowdown():
    cfg = AutoProfileConfig(window=30, min_history=20, k=5.0, min_slowdown=0.5, patience=2)
    base = [10.0 + 0.1 * (i % 3) for i in range(25)]
    # A single spike is not a slow window (patience 2).
    assert _feed(SlowStepDetector(cfg), [*base, 40.0, 10.0, 10.1]) == []
    # Two in a row trigger, on the second.
    hits = _feed(SlowStepDetector(cfg), [*base, 40.0, 41.0, 10.0])
    assert hits == [26]
    # Far above k*MAD (tiny MAD) but only 20 % slower: below min_slowdown, no trigger.
    assert _feed(SlowStepDetector(cfg), [*base, 12.0, 12.0, 12.0]) == []
    # Slow steps before min_history are start-up, not anomalies.
    assert _feed(SlowStepDetector(cfg), [10.0] * 5 + [50.0] * 3 + base) == []


def test_detector_reports_its_numbers():
    det = SlowStepDetector(AutoProfileConfig(min_history=10, window=20, patience=1))
    for _ in range(15):
        det.update(8.0)
    hit = det.update(30.0)
    assert hit is not None
    assert hit["baseline_ms"] == 8.0 and hit["step_ms"] == 30.0
    assert hit["threshold_ms"] == pytest.approx(12.0)  # MAD 0: the 50 % floor decides
    assert "median 8.0 ms" in hit["reason"]


@pytest.mark.parametrize(
    "kwargs",
    [{"window": 2}, {"steps": 0}, {"k": -1.0}, {"min_slowdown": "a"}, {"patience": True},
     {"min_history": 60, "window": 50}, {"compare_healthy": 1}, {"max_captures": 0}],
)
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ConfigError):
        AutoProfileConfig(**kwargs)


def test_resolve_auto_profile():
    assert resolve_auto_profile(False) is None
    assert resolve_auto_profile(True) == AutoProfileConfig()
    cfg = AutoProfileConfig(steps=2)
    assert resolve_auto_profile(cfg) is cfg
    with pytest.raises(ConfigError, match="auto_profile"):
        resolve_auto_profile("yes")


# Margins for a loaded CI machine (2 busy cores): a slow step is 24x the base step and
# min_slowdown=4.0 puts the threshold at 5x the median (~26 ms), so a false trigger needs two
# scheduling delays of over 20 ms in a row (patience 2), and a slow step beats the threshold
# by 4x even if load doubles the median.
SLOW_FLOOR = 4.0


def _train(tracer, steps: int, slow, slow_s: float = 0.12, base_s: float = 0.005) -> None:
    model = torch.nn.Linear(16, 16)
    x = torch.randn(8, 16)
    for i in range(steps):
        with tracer.step():
            model(x).sum().backward()
            time.sleep(slow_s if i in slow else base_s)


def test_slow_window_is_captured_and_the_healthy_part_is_not(mem_tracer, tmp_path):
    # A 5x floor keeps scheduler jitter on a busy CI machine from looking like a slow window.
    cfg = AutoProfileConfig(min_history=15, window=30, steps=3, warmup=1, cooldown=100,
                            min_slowdown=SLOW_FLOOR)
    tracer = mem_tracer(out_dir=str(tmp_path), auto_profile=cfg)
    _train(tracer, 40, slow=range(20, 26))
    tracer.finish()
    lines = [json.loads(x) for x in (tmp_path / TRIGGERS_FILE).read_text().splitlines()]
    assert len(lines) == 1, lines
    t = lines[0]
    assert t["status"] == "captured" and t["role"] == "affected" and t["rank"] == 0
    assert t["step"] == 21  # the second slow step (patience 2)
    assert t["window"] == [23, 26]  # warm-up at 22, then 3 captured steps, all slow
    assert t["step_ms"] > 100.0 and t["baseline_ms"] < 30.0
    assert "single process" in t["note"]
    trace = tmp_path / t["trace"]
    assert trace.exists() and trace.stat().st_size > 0
    # Exactly one trace: nothing for the healthy steps before or after.
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.pt.trace.json*")) == [
        t["trace"]
    ]
    assert tracer.autoprofile.captures == 1


def test_captures_are_bounded_with_cooldown(mem_tracer, tmp_path):
    cfg = AutoProfileConfig(min_history=10, window=20, steps=1, warmup=0, cooldown=8, max_captures=2,
                            min_slowdown=SLOW_FLOOR)
    tracer = mem_tracer(out_dir=str(tmp_path), auto_profile=cfg)
    # Four slow windows: the second starts inside the first one's cooldown (steps 22-31),
    # the fourth finds the budget of two spent.
    slow = {*range(20, 23), *range(26, 29), *range(40, 43), *range(55, 58)}
    _train(tracer, 62, slow=slow)
    tracer.finish()
    lines = [json.loads(x) for x in (tmp_path / TRIGGERS_FILE).read_text().splitlines()]
    assert [x["step"] for x in lines] == [21, 41], lines
    assert all(x["status"] == "captured" for x in lines)
    assert len(list(tmp_path.rglob("*.pt.trace.json*"))) == 2


def test_user_profile_window_wins(mem_tracer, tmp_path):
    cfg = AutoProfileConfig(min_history=10, window=20, patience=1, steps=1, min_slowdown=SLOW_FLOOR)
    tracer = mem_tracer(out_dir=str(tmp_path), auto_profile=cfg, profile_steps=(50, 51))
    _train(tracer, 14, slow=range(12, 13))
    tracer.finish()
    (line,) = [json.loads(x) for x in (tmp_path / TRIGGERS_FILE).read_text().splitlines()]
    assert line["status"] == "skipped" and line["trace"] is None
    assert "profile_steps" in line["note"]


# ----------------------------------------------------------------- real gloo ranks



def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    import stepscope

    become_local_rank(rank, world, port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # Threshold >= 5x the 8 ms pace (40 ms); rank 1's slow steps take 150 ms.
        cfg = AutoProfileConfig(min_history=15, window=30, steps=2, warmup=1, min_slowdown=SLOW_FLOOR)
        stepscope.init(out_dir=out, auto=False, flush_every_n_steps=5, auto_profile=cfg)
        # Paced loop without a collective per step, so rank 1's slow window does not slow
        # rank 0; a barrier every 10 steps (an eval, say) keeps them within 10 steps, which
        # shows on rank 0 as single slow steps, below the patience of 2.
        # A fixed pause after each step, not a schedule to catch up with: after waiting at a
        # barrier a rank must not run its next steps back to back, which would drop its
        # baseline to the bare step cost and let load jitter trigger it.
        pause = 0.008
        for i in range(110):
            with stepscope.step():
                if rank == 1 and 20 <= i < 30:
                    time.sleep(0.15)
            time.sleep(pause)
            if i % 10 == 9:
                dist.barrier()
        stepscope.finish()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_slow_rank_captures_and_a_healthy_rank_compares(tmp_path):
    spawn_local(_worker, 2, tmp_path)
    lines = [json.loads(x) for x in (tmp_path / TRIGGERS_FILE).read_text().splitlines()]
    by_role = {x["role"]: x for x in lines}
    assert [x["rank"] for x in lines if x["role"] == "affected"] == [1], lines
    aff, healthy = by_role["affected"], by_role.get("healthy")
    assert 20 <= aff["step"] < 30 and aff["status"] == "captured"
    assert healthy is not None, lines
    assert healthy["rank"] == 0 and healthy["trigger_ranks"] == [1]
    assert healthy["trigger_step"] == aff["step"] and healthy["status"] == "captured"
    for x in (aff, healthy):
        assert (tmp_path / x["trace"]).exists()
        assert x["trace"].endswith(f"rank{x['rank']}.pt.trace.json.gz")
    # The run report links the captures and summarises each trace (CPU traces here).
    from stepscope.analysis.run import analyze_run
    from stepscope.analysis.triggers import link_triggers

    doc = analyze_run(tmp_path)
    assert sorted((t["role"], t["rank"]) for t in doc["run"]["captures"]) == [("affected", 1), ("healthy", 0)]
    for t in doc["run"]["captures"]:
        assert t["trace_summary"]["platform"] == "cpu", t["trace_summary"]
    windows = [{"start_step": 20, "end_step": 29}, {"start_step": 80, "end_step": 90}]
    linked, skipped = link_triggers(tmp_path, windows)
    assert len(linked) == 2 and skipped == []
    assert windows[0]["captures"] == [0, 1] and windows[1]["captures"] == []


# ----------------------------------------------------------------- stress: profiler vs. side group


def _stress_worker(rank: int, world: int, port: int, out: str, steps: int) -> None:
    import faulthandler

    import torch.distributed as dist

    import stepscope
    from stepscope.listeners.profiler import Profiler

    faulthandler.enable()  # a crash prints every thread's Python stack to stderr
    become_local_rank(rank, world, port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # A capture on every slow step, one profiled step each, no cooldown; a live exchange
        # (an asynchronous all-gather on the side group) at every step.
        cfg = AutoProfileConfig(window=8, min_history=4, k=0.0, min_slowdown=2.0, patience=1, steps=1,
                                warmup=0, cooldown=0, max_captures=1000)
        tracer = stepscope.init(out_dir=out, auto=False, flush_every_n_steps=1, auto_profile=cfg)
        view = tracer.live
        stops = {"n": 0, "in_flight": 0}
        stop = Profiler.stop

        def counting_stop(self: Profiler) -> None:
            # Evidence that the run reached the hazard: a side gather not yet completed
            # (the peer has not issued its half) when the profiler stops.
            stops["n"] += 1
            stops["in_flight"] += any(not w.is_completed() for w, _ in getattr(view, "_works", ()))
            stop(self)

        Profiler.stop = counting_stop  # type: ignore[method-assign]
        model = torch.nn.Linear(32, 32)
        x = torch.randn(16, 32)
        for i in range(steps):
            with stepscope.step():
                model(x).sum().backward()
                # Ranks take turns being slow (3 ms base, 40 ms slow: 13x, far over the 3x floor),
                # so captures start and stop on both while the peer is at another step.
                time.sleep(0.04 if i % 6 == 0 and (i // 6) % 2 == rank else 0.003)
            if i % 25 == 24:
                dist.barrier()  # bounds the drift between ranks
        stepscope.finish()
        with open(os.path.join(out, f"stops{rank}.json"), "w") as f:
            json.dump(stops, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_profiler_start_stop_with_side_gathers_in_flight_never_crashes(tmp_path):
    """Auto-profile capture cycles with the live exchange busy: every rank must exit 0.

    The crash this guards against (SIGSEGV in rank 1 right after
    ``profiler_stop``): a gloo ``async_op=True`` collective issued while torch.profiler is
    recording creates a RecordFunction that is active, so the Work copies the issuing
    thread's thread-local state (which holds the profiler's KinetoThreadLocalState) into
    its before/end callbacks, run later on a gloo worker thread. If the profiler stops while
    that Work is still in flight, the gloo thread writes into the profiler's record queue
    while ``disableProfiler()`` finalises it, and the state is later destroyed from the
    Work's destructor: native backtrace ``~TorchOpStorage <- ~ThreadLocalSubqueue <-
    ~KinetoThreadLocalState <- ~ThreadLocalState <- ~AsyncWork``. Reproduced outside
    stepscope with a bare profile()/all_gather loop; no crash when the gathers complete
    before stop, or when they were issued before start, or when issued with
    RecordFunction off. The live view issues one such gather per exchange, and the
    auto-profiler starts and stops torch.profiler at step ends between them.

    Here every step exchanges and every slow step starts a one-step capture, so stops
    with a gather still in flight happen many times per run; the test checks that they did.
    """
    steps = 90
    spawn_local(_stress_worker, 2, tmp_path, steps)
    lines = [json.loads(x) for x in (tmp_path / TRIGGERS_FILE).read_text().splitlines()]
    for rank in (0, 1):
        mine = [x for x in lines if x["rank"] == rank]
        assert sum(x["status"] == "captured" for x in mine) >= 5, mine
        assert all(x["status"] in ("captured", "incomplete") for x in mine), mine
    stops = [json.loads((tmp_path / f"stops{r}.json").read_text()) for r in (0, 1)]
    assert sum(s["n"] for s in stops) >= 10, stops
    # The hazard was reached, not dodged by timing.
    assert sum(s["in_flight"] for s in stops) >= 3, stops
