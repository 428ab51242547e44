"""Every ADASPEC_* environment knob, read once into one validated settings object."""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from .errors import SettingsError

PREFIX = "ADASPEC_"
GATE_CHOICES = ("both", "entropy", "commit", "off")
ROLLBACK_CHOICES = ("auto", "delta", "ssm", "layers", "refeed")
ISA_CHOICES = ("auto", "avx512", "avx2")


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "adaspec"


class Settings(BaseModel):
    """Knobs with their defaults; `ADASPEC_<NAME>` overrides `<name>`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Which BLAS to load into mlx on Linux: auto | routed | mkl | openblas | off | a path
    blas: str = "auto"
    # routed BLAS: the small-M kernel's instruction set: auto (AVX-512 where the CPU has it) |
    # avx512 | avx2
    kernel_isa: str = "auto"
    cache: Path = Field(default_factory=default_cache)
    prefill_step: int = Field(2048, ge=1, le=1 << 20)
    # recurrent targets: how rollback restores recurrent state (auto = cheapest for the arch)
    rollback: str = "auto"
    # PLD: n-gram sizes matched (longest first) and tokens proposed per step.
    pld_max_ngram: int = Field(3, ge=1, le=64)
    pld_min_ngram: int = Field(1, ge=1, le=64)
    pld_draft_len: int = Field(10, ge=1, le=256)
    # a PLD draft is "strong" (may lift a floor) when its match runs this many tokens back
    pld_strong_match: int = Field(6, ge=1, le=256)
    # DFlash: block size (0 = the checkpoint's own), drafter context kept as sink + recent window
    dflash_block: int = Field(0, ge=0, le=64)
    dflash_ctx_window: int = Field(2048, ge=16, le=1 << 20)
    dflash_ctx_sink: int = Field(4, ge=0, le=1024)
    # Gates (DESIGN §5): which are active, and their thresholds
    gate: str = "commit"
    gate_ar_p1: float = Field(0.90, gt=0, le=1)
    gate_tie_p1: float = Field(0.45, ge=0, le=1)
    gate_entropy_sustain: int = Field(2, ge=1, le=1000)
    gate_margin: float = Field(1.0, gt=0, le=100)
    gate_commit_sustain: int = Field(3, ge=1, le=1000)
    gate_warmup: int = Field(2, ge=0, le=1000)
    gate_ema_weight: float = Field(0.5, gt=0, le=1)
    gate_min_t_ar_ms: float = Field(0.5, gt=0, le=10000)
    # re-measure the plain-step time when the context grew by this fraction
    gate_t_ar_refresh: float = Field(0.25, gt=0, le=100)
    # After a floor: plain steps before probing again, growth per losing probe, its cap, and
    # how many speculative steps a probe must survive to win.
    probe_backoff: int = Field(8, ge=1, le=1 << 20)
    probe_growth: float = Field(2.0, ge=1, le=100)
    probe_max_backoff: int = Field(256, ge=1, le=1 << 20)
    probe_len: int = Field(6, ge=1, le=1000)
    # while floored, a cheap drafter's strong candidate (PLD: full-length match) starts a probe
    probe_lift: bool = True
    # Draft length: adaptive (maximize expected tokens per second) within [min, max]
    draft_adaptive: bool = True
    draft_min: int = Field(1, ge=1, le=256)
    draft_max: int = Field(16, ge=1, le=256)
    # auto drafter: use PLD when its n-gram match is at least this long, DFlash otherwise
    auto_pld_min_match: int = Field(2, ge=1, le=64)
    # draft-model drafter: stop a draft at the first token the draft model gives less than this
    # probability (0 = draft as many as the policy allows)
    draft_model_min_p1: float = Field(0.0, ge=0, lt=1)

    @field_validator("blas")
    @classmethod
    def _blas_choice(cls, v: str) -> str:
        v = v.strip()
        if v.lower() in {"auto", "routed", "mkl", "openblas", "off"}:
            return v.lower()
        if "/" in v or v.endswith(".so") or ".so." in v:
            return v
        raise ValueError(
            "accepted: auto, routed, mkl, openblas, off, or a path to a BLAS shared library"
        )

    @field_validator("gate", "rollback", "kernel_isa")
    @classmethod
    def _choice(cls, v: str, info: ValidationInfo) -> str:
        choices = {"gate": GATE_CHOICES, "rollback": ROLLBACK_CHOICES, "kernel_isa": ISA_CHOICES}[
            str(info.field_name)
        ]
        v = v.strip().lower()
        if v not in choices:
            raise ValueError(f"accepted: {', '.join(choices)}")
        return v

    def check(self) -> Settings:
        if self.gate_tie_p1 > self.gate_ar_p1:
            raise SettingsError(
                f"ADASPEC_GATE_TIE_P1={self.gate_tie_p1} is larger than ADASPEC_GATE_AR_P1="
                f"{self.gate_ar_p1}; accepted: tie_p1 <= ar_p1"
            )
        if self.draft_min > self.draft_max:
            raise SettingsError(
                f"ADASPEC_DRAFT_MIN={self.draft_min} is larger than ADASPEC_DRAFT_MAX="
                f"{self.draft_max}; accepted: min <= max"
            )
        if self.probe_backoff > self.probe_max_backoff:
            raise SettingsError(
                f"ADASPEC_PROBE_BACKOFF={self.probe_backoff} is larger than "
                f"ADASPEC_PROBE_MAX_BACKOFF={self.probe_max_backoff}; accepted: backoff <= max"
            )
        if self.pld_min_ngram > self.pld_max_ngram:
            raise SettingsError(
                f"ADASPEC_PLD_MIN_NGRAM={self.pld_min_ngram} is larger than "
                f"ADASPEC_PLD_MAX_NGRAM={self.pld_max_ngram}; accepted: min <= max"
            )
        return self

    def as_env(self) -> dict[str, str]:
        """The effective settings, keyed by environment variable name."""
        return {PREFIX + k.upper(): str(v) for k, v in self.model_dump().items()}


def env_name(field: str) -> str:
    return PREFIX + field.upper()


def from_env(environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Build settings from ADASPEC_* variables (then `overrides`); unknown or bad values raise."""
    environ = os.environ if environ is None else environ
    fields = Settings.model_fields
    values: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(PREFIX):
            continue
        name = key[len(PREFIX) :].lower()
        if name not in fields:
            known = ", ".join(env_name(f) for f in fields)
            raise SettingsError(f"unknown environment variable {key}={raw!r}; known: {known}")
        values[name] = raw
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return Settings(**values).check()
    except ValidationError as exc:
        raise SettingsError(_explain(exc, values)) from None


def _explain(exc: ValidationError, values: Mapping[str, Any]) -> str:
    parts = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else "?"
        raw = values.get(field, "<missing>")
        parts.append(f"{env_name(field)}={raw!r} is invalid: {err['msg']}")
    return "; ".join(parts)


@lru_cache(maxsize=1)
def get() -> Settings:
    """Settings from the process environment, read once."""
    return from_env()
