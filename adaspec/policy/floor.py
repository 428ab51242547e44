"""The floor and its re-probes, as a pure state machine: after a floor, plain steps for a
backoff that grows with each lost probe; then a probe (speculative steps on trial); a strong
candidate may lift the floor early on its own backoff. The policy's shared floor and each held
arm's hold run on it."""

from __future__ import annotations

from dataclasses import dataclass, replace


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
