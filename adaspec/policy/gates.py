"""Gates as pure state machines: state + observation in, (state, floor?) out. No clocks here:
the controller measures times and passes the numbers in (DESIGN §5, lucebox defaults)."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class EntropyConfig:
    ar_p1: float = 0.90  # ema of top-1 prob below this counts as a low step
    tie_p1: float = 0.45  # a single step with top-1 prob below this floors at once
    sustain: int = 2
    weight: float = 0.5  # EMA weight of the newest observation


@dataclass(frozen=True)
class EntropyState:
    ema_p1: float = 1.0
    low_streak: int = 0
    spec_steps: int = 0


def entropy_step(cfg: EntropyConfig, s: EntropyState, p1: float) -> tuple[EntropyState, bool]:
    """Observe the target's top-1 probability after a speculative step; floor on a near-tie or
    a sustained low-confidence streak."""
    ema = (1 - cfg.weight) * s.ema_p1 + cfg.weight * p1
    low = s.low_streak + 1 if ema < cfg.ar_p1 else 0
    s = EntropyState(ema, low, s.spec_steps + 1)
    return s, p1 < cfg.tie_p1 or low >= cfg.sustain


@dataclass(frozen=True)
class CommitConfig:
    margin: float = 1.0  # speculation must commit at least margin x AR's tokens per second
    sustain: int = 3
    warmup: int = 2
    weight: float = 0.1  # the EMA the margin is held against: ~20 steps of memory
    min_t_ar: float = 0.5e-3  # seconds; guards a zero or absurdly small AR time
    # a second, fast EMA floors at once when it drops below half the margin (a drafter far
    # slower than plain decoding is not given the slow EMA's ~20 steps)
    fast_weight: float = 0.5


@dataclass(frozen=True)
class CommitState:
    ema: float = 2.0
    streak: int = 0
    steps: int = 0
    fast: float = 2.0


def commit_ratio(committed: int, step_s: float, t_ar: float, min_t_ar: float) -> float:
    """Tokens this step committed per AR-step-equivalent of wall time (1.0 = break-even)."""
    t_ar = max(t_ar, min_t_ar)
    return committed * t_ar / max(step_s, 1e-9)


def commit_step(
    cfg: CommitConfig, s: CommitState, committed: int, step_s: float, t_ar: float
) -> tuple[CommitState, bool]:
    """Observe one speculative step; floor after warm-up when the slow EMA of the commit ratio
    stays below the margin for `sustain` steps, or the fast one drops below half of it."""
    r = commit_ratio(committed, step_s, t_ar, cfg.min_t_ar)
    ema = (1 - cfg.weight) * s.ema + cfg.weight * r
    fast = (1 - cfg.fast_weight) * s.fast + cfg.fast_weight * r
    streak = s.streak + 1 if ema < cfg.margin else 0
    s = CommitState(ema, streak, s.steps + 1, fast)
    warm = s.steps >= cfg.warmup
    return s, warm and (streak >= cfg.sustain or min(ema, fast) < 0.5 * cfg.margin)


@dataclass(frozen=True)
class ProbeConfig:
    backoff: int = 8  # plain steps after a first floor before speculation is probed again
    growth: float = 2.0  # backoff multiplier after each losing probe
    max_backoff: int = 256
    probe_len: int = 6  # speculative steps a probe must survive to count as a win


@dataclass(frozen=True)
class FloorState:
    """floored: decoding plainly, `ar_left` steps until the next probe. probing: speculating
    on trial after a floor, `probe_steps` survived so far."""

    floored: bool = False
    ar_left: int = 0
    backoff: int = 0  # 0 = the config's initial backoff
    probing: bool = False
    probe_steps: int = 0
    probe_ratio: float = 0.0  # sum of the probe's commit ratios so far (held arms' probes)
    floors: int = 0
    probes_won: int = 0
    probes_lost: int = 0
    # lifts (probes started early by a strong candidate) back off on their own schedule:
    # `lift_wait` plain steps before the next lift, growing with each lost lift
    lifted: bool = False
    lift_wait: int = 0
    lift_backoff: int = 0


def on_floor(cfg: ProbeConfig, s: FloorState) -> FloorState:
    """A gate fired. A failed probe grows the backoff; a first floor starts at the initial one."""
    if s.probing and s.lifted:  # a lost lift: lifts wait longer; the plain backoff is kept
        lift = min(int(max(s.lift_backoff, cfg.backoff) * cfg.growth), cfg.max_backoff)
        return replace(
            s,
            floored=True,
            ar_left=max(s.backoff, cfg.backoff),
            probing=False,
            probe_steps=0,
            probe_ratio=0.0,
            floors=s.floors + 1,
            probes_lost=s.probes_lost + 1,
            lifted=False,
            lift_wait=lift,
            lift_backoff=lift,
        )
    if s.probing:
        backoff = min(int(max(s.backoff, cfg.backoff) * cfg.growth), cfg.max_backoff)
        return replace(
            s,
            floored=True,
            ar_left=backoff,
            backoff=backoff,
            probing=False,
            probe_steps=0,
            probe_ratio=0.0,
            floors=s.floors + 1,
            probes_lost=s.probes_lost + 1,
        )
    return replace(
        s,
        floored=True,
        ar_left=cfg.backoff,
        backoff=cfg.backoff,
        probing=False,
        probe_steps=0,
        probe_ratio=0.0,
        floors=s.floors + 1,
    )


def probe_lost(cfg: CommitConfig, committed: int, step_s: float, t_ar: float) -> bool:
    """A probe is a test, not a fresh start: its first speculative step must break even
    (commit ratio >= margin) or the probe is lost at once, without a new warm-up."""
    return commit_ratio(committed, step_s, t_ar, cfg.min_t_ar) < cfg.margin


def can_lift(s: FloorState) -> bool:
    return s.floored and s.lift_wait == 0


def on_lift(s: FloorState) -> FloorState:
    """A strong candidate cuts the floor short: probe now (judged like any probe), unless
    recent lifts lost and their own backoff has not run out."""
    if not can_lift(s):
        return s
    return _start_probe(s, lifted=True)


def on_plain_step(s: FloorState) -> FloorState:
    """One floored plain step done; when the backoff runs out, the next steps are a probe."""
    if not s.floored:
        return s
    wait = max(s.lift_wait - 1, 0)
    if s.ar_left > 1:
        return replace(s, ar_left=s.ar_left - 1, lift_wait=wait)
    return _start_probe(s, lift_wait=wait)


def _start_probe(s: FloorState, **changes) -> FloorState:
    return replace(
        s, floored=False, ar_left=0, probing=True, probe_steps=0, probe_ratio=0.0, **changes
    )


def held_probe_lost(cfg: CommitConfig, probe: ProbeConfig, s: FloorState, ratio: float) -> bool:
    """A held arm's probe is judged on its own steps (this one's commit ratio is `ratio`), not
    on the estimate that held the arm back, which the plain steps since did not refresh: lost
    when the mean ratio of its steps falls below half the margin, or below the margin at its
    last step."""
    mean = (s.probe_ratio + ratio) / (s.probe_steps + 1)
    last = s.probe_steps + 1 >= probe.probe_len
    return mean < cfg.margin * (1.0 if last else 0.5)


def on_spec_step(cfg: ProbeConfig, s: FloorState, ratio: float = 0.0) -> FloorState:
    """A speculative step passed the gates; a probe that survives `probe_len` steps wins and
    resets the backoff. ratio: the step's commit ratio, summed over a probe."""
    if not s.probing:
        return s
    if s.probe_steps + 1 >= cfg.probe_len:
        return replace(
            s,
            probing=False,
            probe_steps=0,
            probe_ratio=0.0,
            backoff=cfg.backoff,
            probes_won=s.probes_won + 1,
            lifted=False,
            lift_backoff=0 if s.lifted else s.lift_backoff,
        )
    return replace(s, probe_steps=s.probe_steps + 1, probe_ratio=s.probe_ratio + ratio)
