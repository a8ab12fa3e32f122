"""Live summary: per-rank summaries, the payload codec, the cross-rank line, real gloo ranks."""

from __future__ import annotations

import json
import os
import time

import pytest

from stepscope.listeners.live import (
    PAYLOAD_BYTES,
    cross_rank_summary,
    decode_payload,
    encode_payload,
    format_line,
    summarize,
)
from stepscope.recording.dist import become_local_rank, spawn_local


def _rec(rank: int, step: int, phases: dict[str, float], residual: float = 0.5) -> dict:
    t, out = 0.0, []
    for name, ms in phases.items():
        out.append({"name": name, "parent": None, "ms": ms, "calls": 1, "start_ms": t, "end_ms": t + ms})
        t += ms
    return {"rank": rank, "step": step, "step_ms": t + residual, "phases": out, "residual_ms": residual}


def _payload(rank: int, phases: dict[str, float]) -> dict:
    recs = [_rec(rank, s, phases) for s in range(10)]
    got = decode_payload(encode_payload(summarize(recs)))
    assert got is not None
    return got


def test_summarize_medians_shares_and_top_phase():
    recs = [_rec(0, s, {"dataloader": 6.0, "h2d": 2.0, "forward": 1.5}) for s in range(9)]
    recs.append(_rec(0, 9, {"dataloader": 60.0, "h2d": 2.0, "forward": 1.5}))
    s = summarize(recs)
    assert s["steps"] == 10 and s["last_step"] == 9
    assert s["step_ms_median"] == pytest.approx(10.0)
    assert s["step_ms_max"] == pytest.approx(64.0)
    assert s["top_phase"] == "dataloader"
    assert s["phases"]["dataloader"]["median_ms"] == pytest.approx(6.0)
    # A share is total phase time over total step time (one statistic, never above 1);
    # the one 60 ms stall still shows in it.
    assert s["dataloader_share"] == pytest.approx(114.0 / 154.0)
    assert s["h2d_share"] == pytest.approx(20.0 / 154.0)
    assert summarize([]) == {"steps": 0}


def test_payload_roundtrip_and_size_bound():
    recs = [_rec(3, s, {"forward": 4.0, "backward": 8.0}) for s in range(5)]
    p = decode_payload(encode_payload(summarize(recs), {"t": 7}))
    assert p is not None
    assert p["r"] == 3 and p["s"] == 4 and p["n"] == 5 and p["e"] == {"t": 7}
    assert p["p"]["backward"][0] == pytest.approx(8.0)
    # Many user phases: the smallest are dropped so the payload fits the fixed tensor.
    many = {f"user_phase_{i:03d}": float(i + 1) for i in range(200)}
    raw = encode_payload(summarize([_rec(0, 0, many)]))
    assert 0 < len(raw) <= PAYLOAD_BYTES
    kept = decode_payload(raw)["p"]
    assert "user_phase_199" in kept and "user_phase_000" not in kept
    assert decode_payload(b"\0" * 16) is None
    assert decode_payload(b"{not json") is None
    assert encode_payload({"steps": 0}) == b""


def test_cross_rank_names_the_late_rank_not_the_waiting_ones():
    # Rank 2 waits 15 ms for data; the other three wait for it in backward (the all-reduce).
    fast = {"dataloader": 1.0, "forward": 3.0, "backward": 20.0, "optimizer": 1.0}
    slow = {"dataloader": 16.0, "forward": 3.0, "backward": 5.0, "optimizer": 1.0}
    payloads = [_payload(0, fast), _payload(1, fast), _payload(2, slow), _payload(3, fast)]
    s = cross_rank_summary([*payloads, None], world_size=5)
    assert s is not None
    assert s["ranks"] == 4 and s["world_size"] == 5
    assert s["slowest_rank"] == 2 and s["slowest_phase"] == "dataloader"
    assert s["slowest_phase_excess_ms"] == pytest.approx(15.0)
    assert s["dataloader_share_max"] > 0.5 > s["dataloader_share"]
    # Two ranks: the excesses tie; the earlier phase in the step is the cause.
    s2 = cross_rank_summary([_payload(0, fast), _payload(1, slow)], world_size=2)
    assert (s2["slowest_rank"], s2["slowest_phase"]) == (1, "dataloader")
    line = format_line(s)
    assert "r2" in line and "dataloader" in line and "4/5 ranks" in line
    assert cross_rank_summary([None, None], 2) is None


def test_cross_rank_without_a_clear_culprit_falls_back_to_step_time():
    even = {"forward": 3.0, "backward": 5.0}
    s = cross_rank_summary([_payload(0, even), _payload(1, {"forward": 3.1, "backward": 5.0})], 2)
    assert s["slowest_rank"] == 1 and s["step_ms_max_rank"] == 1
    assert s["slowest_phase"] == "backward"  # its biggest phase


def test_single_process_live_line_and_summary(mem_tracer, capsys):
    tracer = mem_tracer(log_every_n_steps=5, flush_every_n_steps=5)
    view = tracer.live
    assert view.distributed is False and view.printer
    for _ in range(20):
        with tracer.step(), tracer.phase("dataloader"):
            time.sleep(0.002)
    tracer.finish()
    # Lines lag the records by one flush; 20 steps, every 5: at least the last three print.
    assert len(view.lines) >= 3
    assert "1/1 ranks" in view.lines[-1] and "dataloader" in view.lines[-1]
    assert "stepscope" in capsys.readouterr().out
    s = tracer.summary()
    assert s["steps"] == 20 and s["top_phase"] == "dataloader"
    assert s["dataloader_share"] > 0.5
    assert "cross_rank" not in s  # single process: local numbers only


def test_live_off_by_default(mem_tracer):
    tracer = mem_tracer()
    assert tracer.live is None
    assert not any(type(x).__name__ == "LiveView" for x in tracer._listeners)


def test_failing_live_view_disables_timing_with_one_warning(mem_tracer, monkeypatch):
    tracer = mem_tracer(log_every_n_steps=1, flush_every_n_steps=1)
    monkeypatch.setattr(tracer._writer, "submit", lambda item: 1 / 0)
    with pytest.warns(RuntimeWarning, match="timing disabled"), tracer.step():
        pass
    assert tracer.enabled is False


# ----------------------------------------------------------------- real gloo ranks



def _worker(rank: int, world: int, port: int, out: str, stall_s: float) -> None:
    import torch.distributed as dist

    import stepscope

    become_local_rank(rank, world, port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        tracer = stepscope.init(out_dir=out, auto=False, log_every_n_steps=5, flush_every_n_steps=5)
        intervals = []
        for step in range(40):
            t0 = time.perf_counter()
            with stepscope.step():
                with stepscope.phase("dataloader"):
                    time.sleep(0.012 if rank == 1 else 0.001)
                with stepscope.phase("forward"):
                    time.sleep(0.002)
            if rank == 1 and step == 7:
                time.sleep(stall_s)  # rank 1 stops stepping; rank 0 must not wait for it
            intervals.append(time.perf_counter() - t0)
        dist.barrier()  # the test's own sync, so the last exchange completes for everyone
        stepscope.finish()
        view = tracer.live
        result = {"summary": tracer.summary(),
                  "lines": list(view.lines), "max_step_s": max(intervals),
                  "exchanges": view.exchanges_done}
        with open(os.path.join(out, f"result{rank}.json"), "w") as fh:
            json.dump(result, fh)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_exchange_without_blocking(tmp_path):
    stall = 1.5
    spawn_local(_worker, 2, tmp_path, stall)
    r0 = json.loads((tmp_path / "result0.json").read_text())
    r1 = json.loads((tmp_path / "result1.json").read_text())
    # No barrier in the hot path: rank 0 kept stepping while rank 1 stalled for 1.5 s.
    assert r0["max_step_s"] < 0.5 * stall, r0["max_step_s"]
    assert r1["max_step_s"] >= stall
    for r in (r0, r1):
        cross = r["summary"]["cross_rank"]
        assert cross["ranks"] == 2 and cross["world_size"] == 2
        assert cross["slowest_rank"] == 1 and cross["slowest_phase"] == "dataloader"
        assert cross["slowest_phase_excess_ms"] > 3.0
        assert set(cross["per_rank"]) == {"0", "1"}
        assert r["exchanges"] >= 6
    # Only rank 0 prints; its line names rank 1's dataloader.
    assert r1["lines"] == []
    assert r0["lines"], r0
    assert "2/2 ranks" in r0["lines"][-1] and "r1: dataloader" in r0["lines"][-1]


def test_live_line_covers_the_last_interval_not_the_whole_window(mem_tracer):
    tracer = mem_tracer(log_every_n_steps=5, flush_every_n_steps=5)
    for i in range(30):
        with tracer.step(), tracer.phase("dataloader"):
            time.sleep(0.02 if i >= 20 else 0.001)
    tracer.finish()
    # 10 slow steps out of 30: the 30-step median stays fast, the last interval does not.
    assert tracer.summary()["step_ms_median"] < 10.0
    assert tracer.live.latest["step_ms_median"] >= 15.0
