"""Every environment variable adaspec reads (the ADASPEC_* knobs, and CC, LD_LIBRARY_PATH,
XDG_CACHE_HOME), read once into one validated pydantic-settings object."""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextvars import ContextVar
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from .errors import SettingsError

PREFIX = "ADASPEC_"
# Read under their own names, not as ADASPEC_ knobs (field -> variable)
HOST = {"xdg_cache_home": "XDG_CACHE_HOME", "cc": "CC", "ld_library_path": "LD_LIBRARY_PATH"}
# gates ADASPEC_GATE may list (an ordered set): the built-in ones, and any registered with
# adaspec.policy.gates.register_gate
GATE_NAMES: dict[str, None] = {"commit": None, "entropy": None}
ROLLBACK_CHOICES = ("auto", "delta", "ssm", "layers", "refeed")
ISA_CHOICES = ("auto", "avx512", "avx2")
WEIGHT_CHOICES = ("auto", "fp32", "bf16", "q8", "q4")  # a drafter's weights (kernels/shadow.py)
STORED_CHOICES = ("auto", "on", "off")  # GGUF weights at their stored bits (kernels/stored.py)
ARITHMETIC_CHOICES = ("exact", "q8")  # a model's GEMMs (kernels/arithmetic.py)
SHARD_CHOICES = ("auto", "pipeline", "tensor")  # how a target spans ranks (distributed/shard.py)
TREE_NODES_MAX = 256
TREE_NODES_AUTO = 16  # the largest tree `auto` tries

# The mapping the next Settings() reads in place of os.environ (from_env's argument)
_environ: ContextVar[Mapping[str, str] | None] = ContextVar("adaspec_environ", default=None)


def default_cache(xdg_cache_home: str | None = None) -> Path:
    return Path(xdg_cache_home or Path.home() / ".cache") / "adaspec"


class Settings(BaseSettings):
    """Knobs with their defaults; `ADASPEC_<NAME>` overrides `<name>` (HOST fields: their own
    variable), keyword arguments override both. Invalid values raise SettingsError."""

    model_config = SettingsConfigDict(
        env_prefix=PREFIX, frozen=True, extra="forbid", populate_by_name=True
    )

    # The host environment (declared first: the cache default depends on XDG_CACHE_HOME)
    xdg_cache_home: str | None = Field(None, validation_alias=HOST["xdg_cache_home"])
    cc: str | None = Field(None, validation_alias=HOST["cc"])  # compiles the routed kernel
    ld_library_path: str = Field("", validation_alias=HOST["ld_library_path"])  # finds MKL
    # Which BLAS to load into mlx on Linux: auto | routed | mkl | openblas | off | a path
    blas: str = "auto"
    # routed BLAS: the small-M kernel's instruction set: auto (AVX-512 where the CPU has it) |
    # avx512 | avx2
    kernel_isa: str = "auto"
    # Linux x86-64 CPU: mlx's compiled kernels built for this CPU and attention with a vectorized
    # softmax, each giving stock mlx's exact bits (adaspec/kernels/jit.py, attention.py)
    fast_ops: bool = True
    # the command line's glibc per-thread allocator cache, chunks per size (0 = glibc's default)
    malloc_tcache: int = Field(1000, ge=0, le=65535)
    cache: Path = Field(default_factory=lambda data: default_cache(data.get("xdg_cache_home")))
    prefill_step: int = Field(2048, ge=1, le=1 << 20)
    # a forward's graph is handed to mlx's stream in this many pieces as it is built, so the
    # first layers compute while the rest are built (1 = in one piece, when it is read)
    forward_pieces: int = Field(10, ge=1, le=256)
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
    # Gates (docs/gates.md): which are active (a comma-separated list, or off), and their thresholds
    gate: str = "commit"
    gate_ar_p1: float = Field(0.90, gt=0, le=1)
    gate_tie_p1: float = Field(0.45, ge=0, le=1)
    gate_entropy_sustain: int = Field(2, ge=1, le=1000)
    gate_margin: float = Field(1.0, gt=0, le=100)
    gate_commit_sustain: int = Field(3, ge=1, le=1000)
    gate_warmup: int = Field(2, ge=0, le=1000)
    gate_ema_weight: float = Field(0.5, gt=0, le=1)
    # the commit gate's EMA weight: slow, so a drafter whose first draft token is accepted about
    # half the time is judged on ~20 steps, not on its last two or three
    gate_commit_ema_weight: float = Field(0.1, gt=0, le=1)
    gate_min_t_ar_ms: float = Field(0.5, gt=0, le=10000)
    # re-measure the plain-step time when the context grew by this fraction and by at least
    # this many tokens (a plain step's cost barely moves below a few thousand tokens)
    gate_t_ar_refresh: float = Field(1.0, gt=0, le=100)
    gate_t_ar_refresh_min: int = Field(512, ge=0, le=1 << 24)
    # After a floor: plain steps before probing again, growth per losing probe, its cap, and
    # how many speculative steps a probe must survive to win.
    probe_backoff: int = Field(8, ge=1, le=1 << 20)
    probe_growth: float = Field(2.0, ge=1, le=100)
    probe_max_backoff: int = Field(256, ge=1, le=1 << 20)
    probe_len: int = Field(6, ge=1, le=1000)
    # while floored, a cheap drafter's strong candidate (PLD: full-length match) starts a probe
    probe_lift: bool = True
    # a greedy chain from a drafter that can leave its ids unevaluated (DFlash) is verified
    # without reading it first: draft and verify run as one computation
    overlap_draft: bool = True
    # Draft length: adaptive (maximize expected tokens per second) within [min, max]
    draft_adaptive: bool = True
    draft_min: int = Field(1, ge=1, le=256)
    draft_max: int = Field(16, ge=1, le=256)
    # weight of the newest step in the draft-length rule's acceptance and cost EMAs
    draft_ema_weight: float = Field(0.3, gt=0, le=1)
    # ... and in the slow acceptance EMAs that decide whether a costly arm is held back
    arm_hold_ema_weight: float = Field(0.1, gt=0, le=1)
    # auto drafter: use PLD when its n-gram match is at least this long, DFlash otherwise
    auto_pld_min_match: int = Field(2, ge=1, le=64)
    # suffix drafter: most tokens of this process's own outputs kept searchable (0 = no online
    # learning), and whether they persist under ADASPEC_CACHE across restarts
    suffix_max_online: int = Field(1_000_000, ge=0, le=1 << 31)
    suffix_persist: bool = False
    # draft-model drafter: stop a draft at the first token the draft model gives less than this
    # probability (0 = draft as many as the policy allows)
    draft_model_min_p1: float = Field(0.0, ge=0, lt=1)
    # draft-model drafter: the weights its small-row GEMMs read: fp32 (as loaded), bf16 (bf16
    # copies, adaspec/kernels/shadow.py), q8 (its own GEMMs in the 8-bit arithmetic,
    # kernels/arithmetic.py), q4 (as q8, on 4-bit copies of a GGUF model's wider weights,
    # kernels/requant.py) or auto (q4 with AVX-512 VNNI, q8 there for a model without stored
    # weights, else bf16 when the routed kernel runs)
    draft_model_weights: str = "auto"
    # Draft trees: most nodes a drafter may propose as a tree in one step; 0 = chains only (the
    # default until trees are measured to pay here), auto = the policy sizes trees and falls
    # back to chains when they do not pay
    tree_nodes: str = "0"
    # modules (or .py files) imported before drafters are looked up, comma-separated: each
    # registers drafters with adaspec.register_drafter (the CLI's --plugin adds more)
    plugins: str = ""
    # GGUF models: keep quantized weights as stored and let the routed kernel read them (on),
    # or expand them to fp32 (off); auto = on where the routed kernel runs
    stored_weights: str = "auto"
    # The arithmetic of every model's weight GEMMs: exact (stock mlx's fp32 sums, identical to
    # mlx-lm) or q8 (8-bit activations, integer dot products: lossless against its own AR,
    # not identical to mlx-lm; kernels/arithmetic.py)
    arithmetic: str = "exact"
    # Under mlx.launch / mpirun: how the target is split over the ranks (auto = pipeline), and
    # how long a rank waits on a collective before it ends itself (a peer that hangs)
    shard: str = "auto"
    dist_timeout: float = Field(120.0, gt=0, le=86400)
    # adaspec serve: requests decoded together (one shared verify forward; 1 = one at a time,
    # each forward feeds at most the routed kernel's 32 rows), and requests waiting beyond
    # those before new ones get 503 with Retry-After
    serve_concurrency: int = Field(8, ge=1, le=32)
    serve_queue: int = Field(64, ge=0, le=1 << 16)

    @field_validator("tree_nodes", mode="before")
    @classmethod
    def _tree_nodes(cls, v: Any) -> str:
        v = str(v).strip().lower()
        if v == "auto" or (v.isdigit() and int(v) <= TREE_NODES_MAX):
            return v if v == "auto" else str(int(v))
        raise ValueError(f"accepted: auto, or 0..{TREE_NODES_MAX} (0 = chains only)")

    @property
    def plugin_modules(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in self.plugins.split(",") if p.strip())

    @property
    def tree_cap(self) -> int:
        """The node budget's cap: TREE_NODES_AUTO for auto, else the number given."""
        return TREE_NODES_AUTO if self.tree_nodes == "auto" else int(self.tree_nodes)

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

    @field_validator("gate")
    @classmethod
    def _gate_list(cls, v: str) -> str:
        v = str(v).strip().lower()
        if v in ("off", "both"):
            return v
        names = [n.strip() for n in v.split(",")]
        if all(n in GATE_NAMES for n in names):
            return ",".join(dict.fromkeys(names))
        raise ValueError(
            f"accepted: a comma-separated list of {', '.join(GATE_NAMES)}; both (= "
            "commit,entropy); or off"
        )

    @property
    def gate_names(self) -> tuple[str, ...]:
        """The active gates, in the order given (none for off; both = commit,entropy)."""
        if self.gate in ("off", "both"):
            return () if self.gate == "off" else ("commit", "entropy")
        return tuple(self.gate.split(","))

    @field_validator(
        "rollback", "kernel_isa", "draft_model_weights", "stored_weights", "shard", "arithmetic"
    )
    @classmethod
    def _choice(cls, v: str, info: ValidationInfo) -> str:
        choices = {
            "rollback": ROLLBACK_CHOICES,
            "kernel_isa": ISA_CHOICES,
            "draft_model_weights": WEIGHT_CHOICES,
            "stored_weights": STORED_CHOICES,
            "shard": SHARD_CHOICES,
            "arithmetic": ARITHMETIC_CHOICES,
        }[str(info.field_name)]
        v = v.strip().lower()
        if v not in choices:
            raise ValueError(f"accepted: {', '.join(choices)}")
        return v

    @model_validator(mode="after")
    def _ordered(self) -> Settings:
        if self.gate_tie_p1 > self.gate_ar_p1:
            raise ValueError(
                f"ADASPEC_GATE_TIE_P1={self.gate_tie_p1} is larger than ADASPEC_GATE_AR_P1="
                f"{self.gate_ar_p1}; accepted: tie_p1 <= ar_p1"
            )
        if self.draft_min > self.draft_max:
            raise ValueError(
                f"ADASPEC_DRAFT_MIN={self.draft_min} is larger than ADASPEC_DRAFT_MAX="
                f"{self.draft_max}; accepted: min <= max"
            )
        if self.probe_backoff > self.probe_max_backoff:
            raise ValueError(
                f"ADASPEC_PROBE_BACKOFF={self.probe_backoff} is larger than "
                f"ADASPEC_PROBE_MAX_BACKOFF={self.probe_max_backoff}; accepted: backoff <= max"
            )
        if self.pld_min_ngram > self.pld_max_ngram:
            raise ValueError(
                f"ADASPEC_PLD_MIN_NGRAM={self.pld_min_ngram} is larger than "
                f"ADASPEC_PLD_MAX_NGRAM={self.pld_max_ngram}; accepted: min <= max"
            )
        return self

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise SettingsError(_explain(exc)) from None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # arguments, then the environment; no .env file, no secrets directory
        environ = _environ.get()
        return init_settings, _Environ(settings_cls, os.environ if environ is None else environ)

    def as_env(self) -> dict[str, str]:
        """The effective ADASPEC_* settings, keyed by environment variable name."""
        return {env_name(k): str(v) for k, v in self.model_dump().items() if k not in HOST}

    def changed(self) -> dict[str, str]:
        """The ADASPEC_* settings whose value differs from its default: name -> the default
        (the defaults under this host environment, e.g. ADASPEC_CACHE's under XDG_CACHE_HOME)."""
        host = {HOST[k]: v for k, v in self.model_dump().items() if k in HOST and v}
        default = from_env(host).as_env()
        return {k: default[k] for k, v in self.as_env().items() if v != default[k]}

    def describe(self) -> list[str]:
        """One `NAME=value` line per ADASPEC_* setting; a value that differs from the default
        is marked with it: `ADASPEC_GATE=off  (default commit)`."""
        changed = self.changed()
        return [
            f"{k}={v}" + (f"  (default {changed[k] or '(none)'})" if k in changed else "")
            for k, v in self.as_env().items()
        ]


class _Environ(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping, which first rejects
    ADASPEC_* names that are no setting (a typo would otherwise be ignored)."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self.environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        fields = self.settings_cls.model_fields
        _reject_unknown(self.environ, fields)
        # names are read exactly as written (upper case); the source matches them lower-cased
        known = {env_name(f) for f in fields}
        return {k.lower(): v for k, v in self.environ.items() if k in known}


def env_name(field: str) -> str:
    return HOST.get(field) or PREFIX + field.upper()


def _reject_unknown(environ: Mapping[str, str], fields: Mapping[str, FieldInfo]) -> None:
    """Refuse a name starting with ADASPEC_ in any case that is not exactly (upper case
    included) a setting's; the message suggests the close names, else lists them all."""
    known = [env_name(f) for f in fields if f not in HOST]
    unknown = [k for k in environ if k.upper().startswith(PREFIX) and k not in known]
    if not unknown:
        return
    import difflib

    parts, listed = [], False
    for key in unknown:
        if key.upper() in known:
            parts.append(f"{key}={environ[key]!r} (names are upper case: {key.upper()})")
            continue
        # compared without the prefix, which every name shares
        close = difflib.get_close_matches(
            key[len(PREFIX) :].upper(), [k[len(PREFIX) :] for k in known], n=2
        )
        listed = listed or not close
        hint = f" (did you mean {' or '.join(PREFIX + c for c in close)}?)" if close else ""
        parts.append(f"{key}={environ[key]!r}{hint}")
    plural = "s" if len(unknown) > 1 else ""
    rest = (
        f"known: {', '.join(known)}" if listed else "every setting: README's Environment variables"
    )
    raise SettingsError(f"unknown environment variable{plural} {'; '.join(parts)}; {rest}")


def from_env(environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Settings from `environ` (default: the process environment) and `overrides` (None: not
    given); unknown or bad values raise SettingsError."""
    token = _environ.set(os.environ if environ is None else environ)
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    finally:
        _environ.reset(token)


def _explain(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        if err["type"] == "default_factory_not_called":  # the cache default, after another error
            continue
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "bool_parsing":
            msg = "accepted: true, false, 1, 0, yes, no, on, off"
        if not err["loc"]:  # a rule across fields: its message names them
            parts.append(msg)
            continue
        name = str(err["loc"][0])
        if err["type"] == "extra_forbidden":  # a keyword argument that is no setting
            known = ", ".join(f for f in Settings.model_fields)
            parts.append(f"unknown setting {name}={err['input']!r}; known: {known}")
            continue
        var = name if name in HOST.values() else env_name(name)
        sep = "; " if msg.startswith("accepted") else ": "
        parts.append(f"{var}={err.get('input', '<missing>')!r} is invalid{sep}{msg}")
    return "; ".join(parts)


@lru_cache(maxsize=1)
def get() -> Settings:
    """Settings from the process environment, read once."""
    return from_env()
