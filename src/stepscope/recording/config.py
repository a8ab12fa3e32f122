"""The tracer's configuration: a keyword-only dataclass, validated, with STEPSCOPE_* overrides."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

from stepscope.common import escape
from stepscope.common.errors import ConfigError
from stepscope.common.slow_step import DEFAULT_K, DEFAULT_MIN_SLOWDOWN, DEFAULT_PATIENCE
from stepscope.recording.schema import AUTO_PHASES

SINKS = ("jsonl", "sqlite")
#: Largest ``flops_per_step`` accepted (a 405B model at 16M tokens is 4e19).
MAX_FLOPS_PER_STEP = 1e30


@dataclass(kw_only=True)
class AutoProfileConfig:
    """When a step counts as anomalous, and how much profiling that may cost.

    A step triggers when its time exceeds both ``median + k * 1.4826 * MAD`` of the last
    ``window`` steps and ``(1 + min_slowdown) * median``, for ``patience`` steps in a row.

    Example::

        stepscope.init(auto_profile=AutoProfileConfig(k=4.0, steps=5, max_captures=2))
    """

    #: Steps in the running baseline (CPU-clock time from one step's end to the next).
    window: int = 50
    #: Steps of history needed before anything can trigger (skips start-up steps).
    min_history: int = 20
    #: Robust z-score: how many scaled MADs above the median a slow step must be.
    k: float = DEFAULT_K
    #: Minimum relative slowdown over the median (0.5 = 50 % slower); guards against a tiny MAD.
    min_slowdown: float = DEFAULT_MIN_SLOWDOWN
    #: Consecutive slow steps before arming (1 = the first one).
    patience: int = DEFAULT_PATIENCE
    #: Steps captured per trigger.
    steps: int = 3
    #: Profiler warm-up steps before the captured ones (not in the trace).
    warmup: int = 1
    #: At most this many captures per rank and run (healthy-rank comparisons count too).
    max_captures: int = 3
    #: Steps after a capture ends before the next trigger may fire.
    cooldown: int = 100
    #: In a distributed run, also capture one rank that did not trigger, for comparison.
    compare_healthy: bool = True

    def __post_init__(self) -> None:
        for name, minimum in (("window", 4), ("min_history", 2), ("patience", 1), ("steps", 1),
                              ("warmup", 0), ("max_captures", 1), ("cooldown", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise ConfigError(f"auto_profile {name} must be an int >= {minimum}; got {v!r}")
        if self.min_history > self.window:
            raise ConfigError(
                f"auto_profile min_history must be <= window; got min_history={self.min_history}, "
                f"window={self.window}"
            )
        for name in ("k", "min_slowdown"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0:
                raise ConfigError(f"auto_profile {name} must be a number >= 0; got {v!r}")
        if not isinstance(self.compare_healthy, bool):
            raise ConfigError(f"auto_profile compare_healthy must be a bool; got {self.compare_healthy!r}")


def resolve_auto_profile(value: Any) -> AutoProfileConfig | None:
    """``init(auto_profile=...)`` as a config: ``True``, an :class:`AutoProfileConfig`, or off."""
    if value is False or value is None:
        return None
    if value is True:
        return AutoProfileConfig()
    if isinstance(value, AutoProfileConfig):
        return value
    raise ConfigError(f"auto_profile must be True, False or an AutoProfileConfig; got {value!r}")


def check_flop_config(flops_per_step: Any, model_flops: Any, peak_tflops: Any) -> None:
    """Validate the ``init()`` FLOP arguments (raises ``ConfigError``, a ``ValueError``)."""
    if flops_per_step is not None and (
        isinstance(flops_per_step, bool)
        or not isinstance(flops_per_step, int | float)
        or not flops_per_step > 0
        or not flops_per_step <= MAX_FLOPS_PER_STEP
    ):
        raise ConfigError(f"flops_per_step must be a positive number up to 1e30 or None; "
                          f"got {str(flops_per_step)[:40]}")
    if model_flops not in (None, "auto"):
        raise ConfigError(f"model_flops must be 'auto' or None; got {model_flops!r}")
    if flops_per_step is not None and model_flops is not None:
        raise ConfigError("give either flops_per_step or model_flops='auto', not both")
    if peak_tflops is not None and (
        isinstance(peak_tflops, bool)
        or not isinstance(peak_tflops, int | float)
        or not peak_tflops > 0
        or peak_tflops == float("inf")
    ):
        raise ConfigError(f"peak_tflops must be a positive number (TFLOP/s) or None; got {peak_tflops!r}")


@dataclass(kw_only=True)
class Config:
    """What to record, where, and how often.

    Example::

        cfg = Config(out_dir="runs/exp1", every_n_steps=10, sink="sqlite")
    """

    #: Run directory; one ``rank{R}.jsonl`` (or ``.sqlite``) per rank plus ``meta.json``.
    out_dir: str = "runs/stepscope"
    #: First step index recorded (inclusive).
    start_step: int = 0
    #: Last step index recorded (exclusive); ``None`` = no end.
    end_step: int | None = None
    #: Record one step in every ``n`` within the window.
    every_n_steps: int = 1
    #: Hand records to the writer every ``n`` sampled steps (and at ``finish()``/exit).
    flush_every_n_steps: int = 10
    #: Ranks that record; ``None`` = all.
    ranks: frozenset[int] | None = None
    #: ``"jsonl"`` (default, append-only) or ``"sqlite"`` (table ``step_time_samples``).
    sink: str = "jsonl"
    #: Automatic phases: ``True`` = all of them, ``False`` = none (manual mode), or a set of
    #: names from ``dataloader``, ``h2d``, ``forward``, ``backward``, ``optimizer``.
    auto: frozenset[str] = AUTO_PHASES
    #: ``False`` makes every call a cheap no-op and writes nothing.
    enabled: bool = True
    #: Steps whose CUDA events are still pending before the oldest is dropped (counted).
    max_pending_steps: int = 256
    #: Optional ``(start, end)`` step window for a ``torch.profiler`` capture.
    profile_steps: tuple[int, int] | None = None
    #: Rank 0 prints a one-line cross-rank summary every ``n`` steps; 0 = off.
    log_every_n_steps: int = 0
    #: Capture a ``torch.profiler`` trace when a step is anomalously slow: ``True`` for the
    #: defaults, or an :class:`AutoProfileConfig`.
    auto_profile: Any = False
    #: Run identifier shared by all ranks; default from env or generated.
    run_id: str | None = None
    #: Time ``torch.distributed`` collectives issued inside sampled steps (the record's
    #: ``collectives`` section); ``STEPSCOPE_COLLECTIVES=0`` turns it off.
    collectives: bool = True
    #: Seconds between heartbeat writes of ``rank{R}.status.json`` (``stepscope status``);
    #: 0 = no heartbeat file and no crash evidence.
    heartbeat_s: float = 5.0
    #: Write all threads' Python stacks to ``rank{R}.stacks.txt`` once a step has been open
    #: this many seconds (once per stuck step); ``None`` = never. Needs ``heartbeat_s`` > 0.
    dump_stacks_after_s: float | None = None
    #: [metrics] FLOPs of one step on this rank (for TFLOP/s and MFU); or use ``model_flops``.
    flops_per_step: float | None = None
    #: [metrics] ``"auto"``: count the model's FLOPs on the first sampled step (that step is
    #: marked ``untimed`` and left out of timing statistics).
    model_flops: str | None = None
    #: [metrics] Peak TFLOP/s of one device, overriding the built-in table (MFU denominator).
    peak_tflops: float | None = None
    #: [export] Publish metrics over OTLP/HTTP (``OTEL_EXPORTER_OTLP_*`` configure the endpoint);
    #: needs the ``otel`` extra.
    otel: bool = False
    #: [export] Serve Prometheus metrics on this port + the local rank; ``None`` = off.
    prometheus_port: int | None = None
    #: [export] Address the Prometheus endpoint listens on.
    prometheus_addr: str = "0.0.0.0"
    #: [export] Ranks (and nodes) that publish per-rank (per-node) series: the most outlying
    #: of the latest cross-rank exchange; the job's aggregates are always published.
    #: ``None``: every rank and node (series grow with the world).
    export_top_ranks: int | None = 8

    def __post_init__(self) -> None:
        self.auto = _normalise_auto(self.auto)
        if self.ranks is not None:
            self.ranks = _normalise_ranks(self.ranks)
        _check_int("start_step", self.start_step, minimum=0)
        if self.end_step is not None:
            _check_int("end_step", self.end_step, minimum=0)
            if self.end_step <= self.start_step:
                raise ConfigError(
                    f"end_step must be greater than start_step (exclusive end); "
                    f"got start_step={self.start_step}, end_step={self.end_step}"
                )
        _check_int("every_n_steps", self.every_n_steps, minimum=1)
        _check_int("flush_every_n_steps", self.flush_every_n_steps, minimum=1)
        _check_int("max_pending_steps", self.max_pending_steps, minimum=1)
        _check_int("log_every_n_steps", self.log_every_n_steps, minimum=0)
        _check_seconds("heartbeat_s", self.heartbeat_s, allow_zero=True)
        if self.dump_stacks_after_s is not None:
            _check_seconds("dump_stacks_after_s", self.dump_stacks_after_s, allow_zero=False)
        if self.auto_profile is not False:
            resolve_auto_profile(self.auto_profile)  # raises ConfigError on a bad value
        check_flop_config(self.flops_per_step, self.model_flops, self.peak_tflops)  # [metrics]
        _check_export(self.otel, self.prometheus_port, self.prometheus_addr)  # [export]
        if self.export_top_ranks is not None:
            _check_int("export_top_ranks", self.export_top_ranks, minimum=0)
        if self.sink not in SINKS:
            raise ConfigError(f"sink must be one of {SINKS}; got {self.sink!r}")
        if not isinstance(self.out_dir, str | os.PathLike) or not os.fspath(self.out_dir):
            raise ConfigError(f"out_dir must be a non-empty path; got {self.out_dir!r}")
        self.out_dir = os.fspath(self.out_dir)
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"enabled must be a bool; got {self.enabled!r}")
        if not isinstance(self.collectives, bool):
            raise ConfigError(f"collectives must be a bool; got {self.collectives!r}")
        if self.run_id is not None and (not isinstance(self.run_id, str) or not self.run_id
                                        or len(self.run_id) > 200):
            raise ConfigError(f"run_id must be None or a non-empty str of at most 200 characters; "
                              f"got {self.run_id!r} ({type(self.run_id).__name__})")
        if self.run_id is not None:
            self.run_id = escape.name(self.run_id)  # lone surrogates written out
        if self.profile_steps is not None:
            ps = tuple(self.profile_steps) if isinstance(self.profile_steps, tuple | list) else ()
            if (len(ps) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                        for v in ps) or ps[1] <= ps[0]):
                raise ConfigError(
                    f"profile_steps must be (start, end) with 0 <= start < end; "
                    f"got {self.profile_steps!r}"
                )
            self.profile_steps = (int(ps[0]), int(ps[1]))

    def samples(self, step: int) -> bool:
        """Whether step index ``step`` is recorded (rank filtering is done once, at init)."""
        if step < self.start_step or (self.end_step is not None and step >= self.end_step):
            return False
        return (step - self.start_step) % self.every_n_steps == 0

    def next_sampled(self, step: int) -> int | None:
        """The first index ``>= step`` that :meth:`samples` records, ``None`` when none is."""
        start, n = self.start_step, self.every_n_steps
        nxt = start if step <= start else step + (start - step) % n
        return None if self.end_step is not None and nxt >= self.end_step else nxt

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, frozenset):
                v = sorted(v)
            elif not isinstance(v, str | int | float | bool | list | tuple | dict | type(None)):
                v = repr(v)
            out[f.name] = v
        return out


def _check_export(otel: Any, port: Any, addr: Any) -> None:
    if not isinstance(otel, bool):
        raise ConfigError(f"otel must be a bool; got {otel!r}")
    if port is not None:
        _check_int("prometheus_port", port, minimum=1)
        if port > 65535:
            raise ConfigError(f"prometheus_port must be <= 65535; got {port}")
    if not isinstance(addr, str) or not addr:
        raise ConfigError(f"prometheus_addr must be a non-empty str; got {addr!r}")


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int; got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}; got {value}")


def _check_seconds(name: str, value: Any, *, allow_zero: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise ConfigError(f"{name} must be a number of seconds; got {value!r}")
    if value < 0 or (value == 0 and not allow_zero) or value == float("inf"):
        low = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{name} must be finite and {low}; got {value}")


def _normalise_auto(auto: Any) -> frozenset[str]:
    if auto is True:
        return AUTO_PHASES
    if auto is False or auto is None:
        return frozenset()
    if isinstance(auto, str) or not isinstance(auto, Iterable):
        raise ConfigError(
            f"auto must be True, False or a set of phase names from {sorted(AUTO_PHASES)}; "
            f"got {auto!r}"
        )
    names = frozenset(auto)
    unknown = names - AUTO_PHASES
    if unknown:
        raise ConfigError(
            f"auto got unknown phase names {sorted(unknown)}; allowed: {sorted(AUTO_PHASES)}"
        )
    return names


def _normalise_ranks(ranks: Any) -> frozenset[int]:
    if isinstance(ranks, int) and not isinstance(ranks, bool):
        ranks = [ranks]
    if isinstance(ranks, str) or not isinstance(ranks, Iterable):
        raise ConfigError(f"ranks must be None or an iterable of ints; got {ranks!r}")
    out = frozenset(ranks)
    bad = [r for r in out if isinstance(r, bool) or not isinstance(r, int) or r < 0]
    if bad:
        raise ConfigError(f"ranks must be non-negative ints; got {sorted(map(repr, bad))}")
    return out


def _env_flag(raw: str) -> bool:
    """Any value but an explicit off (``0``/``false``/``no``/``off``) turns the feature on."""
    return raw.lower() not in ("0", "false", "no", "off")


#: ``STEPSCOPE_<NAME>`` variables that override an ``init()`` argument: parser, what it expects.
_ENV_TYPED: dict[str, tuple[Any, str]] = {
    **{name: (int, "an int") for name in (
        "start_step", "end_step", "every_n_steps", "flush_every_n_steps", "log_every_n_steps")},
    "heartbeat_s": (float, "a number"),
    "dump_stacks_after_s": (float, "a number"),
    "collectives": (_env_flag, "a flag"),
    "otel": (_env_flag, "a flag"),  # [export]
    "export_top_ranks": (int, "an int"),  # [export]
}


def env_overrides(environ: dict[str, str] | os._Environ[str] | None = None) -> dict[str, Any]:
    """Config fields set through ``STEPSCOPE_*`` environment variables.

    ``STEPSCOPE_DISABLE=1`` disables; ``STEPSCOPE_OUT_DIR``, ``STEPSCOPE_SINK``,
    ``STEPSCOPE_START_STEP`` etc. override the matching ``init()`` argument.
    """
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    if env.get("STEPSCOPE_DISABLE", "").strip().lower() in ("1", "true", "yes", "on"):
        out["enabled"] = False
    if env.get("STEPSCOPE_OUT_DIR"):
        out["out_dir"] = env["STEPSCOPE_OUT_DIR"]
    if env.get("STEPSCOPE_SINK"):
        out["sink"] = env["STEPSCOPE_SINK"]
    for name, (parse, kind) in _ENV_TYPED.items():
        raw = env.get(f"STEPSCOPE_{name.upper()}", "").strip()
        if raw:
            try:
                out[name] = parse(raw)
            except ValueError:
                raise ConfigError(f"STEPSCOPE_{name.upper()} must be {kind}; got {raw!r}") from None
    if env.get("STEPSCOPE_PROMETHEUS_PORT"):
        try:
            out["prometheus_port"] = int(env["STEPSCOPE_PROMETHEUS_PORT"])
        except ValueError:
            raise ConfigError(f"STEPSCOPE_PROMETHEUS_PORT must be an int; "
                              f"got {env['STEPSCOPE_PROMETHEUS_PORT']!r}") from None
    raw_ranks = env.get("STEPSCOPE_RANKS")
    if raw_ranks:
        try:
            out["ranks"] = frozenset(int(r) for r in raw_ranks.split(",") if r.strip())
        except ValueError:
            raise ConfigError(f"STEPSCOPE_RANKS must be comma-separated ints; got {raw_ranks!r}") from None
    return out
