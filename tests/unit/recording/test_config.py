from __future__ import annotations

import pytest

import stepscope
from stepscope.common.errors import ConfigError
from stepscope.recording.config import Config, env_overrides


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_steps": 0}, "every_n_steps must be >= 1; got 0"),
        ({"flush_every_n_steps": -1}, "flush_every_n_steps must be >= 1; got -1"),
        ({"start_step": 5, "end_step": 5}, "end_step must be greater than start_step"),
        ({"start_step": 1.5}, "start_step must be an int; got 1.5"),
        ({"sink": "parquet"}, "sink must be one of ('jsonl', 'sqlite'); got 'parquet'"),
        ({"auto": {"forward", "fwd"}}, "unknown phase names ['fwd']"),
        ({"auto": "forward"}, "auto must be True, False or a set"),
        ({"ranks": [0, -1]}, "ranks must be non-negative ints"),
        ({"profile_steps": (5, 2)}, "profile_steps must be (start, end)"),
        ({"enabled": "yes"}, "enabled must be a bool"),
    ],
)
def test_bad_config_raises_value_error_with_the_value(kwargs, message):
    with pytest.raises(ValueError) as info:
        Config(**kwargs)
    assert isinstance(info.value, ConfigError)
    assert message in str(info.value)


def test_init_rejects_bad_arguments_before_touching_anything(tmp_path):
    with pytest.raises(ValueError, match="every_n_steps"):
        stepscope.init(out_dir=str(tmp_path / "x"), every_n_steps=0)
    assert not (tmp_path / "x").exists()


def test_sampling_window_and_stride():
    cfg = Config(start_step=10, end_step=20, every_n_steps=3)
    assert [s for s in range(30) if cfg.samples(s)] == [10, 13, 16, 19]
    assert [s for s in range(5) if Config().samples(s)] == [0, 1, 2, 3, 4]


def test_auto_normalisation():
    assert Config(auto=True).auto == {"dataloader", "h2d", "forward", "backward", "optimizer"}
    assert Config(auto=False).auto == frozenset()
    assert Config(auto=["h2d"]).auto == {"h2d"}
    assert Config(ranks=3).ranks == {3}


def test_env_overrides():
    env = {
        "STEPSCOPE_DISABLE": "1",
        "STEPSCOPE_EVERY_N_STEPS": "4",
        "STEPSCOPE_RANKS": "0,2",
        "STEPSCOPE_SINK": "sqlite",
    }
    assert env_overrides(env) == {
        "enabled": False,
        "every_n_steps": 4,
        "ranks": frozenset({0, 2}),
        "sink": "sqlite",
    }
    with pytest.raises(ValueError, match="STEPSCOPE_START_STEP must be an int; got 'x'"):
        env_overrides({"STEPSCOPE_START_STEP": "x"})


def test_next_sampled_is_the_first_index_samples_records():
    for start, end, every in [(0, None, 1), (0, None, 10), (3, 45, 10), (7, 8, 3), (2, 30, 4)]:
        cfg = Config(start_step=start, end_step=end, every_n_steps=every)
        for step in range(60):
            want = next((s for s in range(step, 200) if cfg.samples(s)), None)
            assert cfg.next_sampled(step) == want, (start, end, every, step)
