"""kvtier's configuration: one typed object, read from vLLM's ``kv_connector_extra_config``
dict and from ``KVTIER_*`` environment variables.

Contract:
- Byte sizes carry explicit units: ``"64GiB"``, ``"512MiB"``, ``"1.5GB"``. A bare number is
  an error (is it bytes? GiB?), as is an ambiguous suffix such as ``"64G"``.
- Unknown keys are errors, in the dict and in the environment (a ``KVTIER_`` variable that
  names no field), and the message names the closest field.
- The dict wins over the environment: the engine's own configuration is the more specific one.
- Impossible combinations are rejected at start-up with what to write instead.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

ENV_PREFIX = "KVTIER_"

_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_UNIT_SPELLING = ("B", "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB")
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]+)\s*$")


class ConfigError(ValueError):
    """A configuration problem, with what to write instead."""


def parse_bytes(value: object) -> int:
    """Parse a size with an explicit unit ("64GiB", "1.5 GB", "512MiB") into bytes.

    Bare numbers and unit-less strings are rejected: the unit is part of the value.
    """
    if isinstance(value, bool) or not isinstance(value, str):
        raise ValueError(
            f"a byte size needs an explicit unit, got {value!r}: write e.g. '64GiB' or '512MiB'"
        )
    m = _SIZE_RE.match(value)
    if not m:
        raise ValueError(
            f"cannot read {value!r} as a byte size: write a number and a unit, e.g. '64GiB'"
        )
    number, unit = m.group(1), m.group(2)
    if unit not in _UNIT_SPELLING:
        raise ValueError(
            f"unknown unit {unit!r} in {value!r}: use B, KB, MB, GB, TB (powers of 1000) "
            f"or KiB, MiB, GiB, TiB (powers of 1024), e.g. '{number}GiB'"
        )
    factor = _UNITS[unit.upper()]
    size = float(number) * factor
    if size != int(size):
        raise ValueError(f"{value!r} is not a whole number of bytes")
    return int(size)


def format_bytes(n: int) -> str:
    """The inverse of :func:`parse_bytes` for display: the largest binary unit that is exact."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        factor = _UNITS[unit.upper()]
        if n >= factor and n % factor == 0:
            return f"{n // factor}{unit}"
    return f"{n}B"


ByteSize = Annotated[int, BeforeValidator(parse_bytes)]

PolicyName = Literal["lru", "slru", "s3fifo"]
AdmissionName = Literal["always", "second_sight"]


class KvtierConfig(BaseModel):
    """Every setting of kvtier. Field docs are the user documentation (``kvtier config``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dram_size: ByteSize = Field(
        default=4 * 2**30,
        description="Host DRAM for stored KV, per engine, all ranks together (e.g. '64GiB').",
    )
    chunk_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Tokens per stored chunk; a multiple of every KV-cache group's block size. "
        "Default: the smallest multiple of their LCM that is at least 256.",
    )
    policy: PolicyName = Field(default="slru", description="Eviction policy: lru, slru, s3fifo.")
    slru_protected_fraction: float = Field(
        default=0.8, gt=0.0, lt=1.0, description="SLRU: share of slots in the protected segment."
    )
    s3fifo_small_fraction: float = Field(
        default=0.1, gt=0.0, lt=1.0, description="S3-FIFO: share of slots in the small queue."
    )
    admission: AdmissionName = Field(
        default="always",
        description="'second_sight' saves a chunk only once its prefix was seen twice.",
    )
    admission_memory: int = Field(
        default=1 << 20, ge=1, description="Keys remembered by second-sight admission."
    )
    save_generated_tokens: bool = Field(
        default=True,
        description="Also save chunks of generated tokens (an agent's next turn starts with them).",
    )
    state_size: ByteSize | None = Field(
        default=None,
        description="DRAM reserved for recurrent-state objects, out of dram_size. Default: a "
        "quarter of dram_size when the model has recurrent state, else none.",
    )
    max_pending_saves: int = Field(
        default=256, ge=1, description="Chunks queued or in flight for saving; beyond, saves drop."
    )
    max_pending_loads: int = Field(
        default=1024, ge=1, description="Chunks in flight for loading; beyond, hits are declined."
    )
    max_pins: int = Field(
        default=1 << 16, ge=1, description="Chunks pinned by decided loads at once."
    )
    gpu_staging_size: ByteSize = Field(
        default=256 * 2**20, description="Device staging memory for transfers (at most)."
    )
    pin_step_size: ByteSize = Field(
        default=2**30, description="Host memory is pinned with CUDA in steps of this size."
    )
    link_gbps: float = Field(
        default=20.0, gt=0, description="Host-link GB/s assumed until transfers measure it."
    )
    prefill_seconds_per_token: float = Field(
        default=50e-6, gt=0, description="Prefill cost assumed until steps measure it."
    )
    step_seconds: float = Field(
        default=0.02, ge=0, description="Engine step latency assumed until measured (parking cost)."
    )
    cost_model: bool = Field(
        default=True, description="Decline loads that cost more than recomputing (else load all)."
    )
    allow_fail_policy: bool = Field(
        default=False,
        description="Start even if vLLM's kv_load_failure_policy is not 'recompute'.",
    )
    model_revision: str = Field(
        default="", description="Weight revision; part of the key namespace."
    )
    namespace_extra: str = Field(
        default="", description="Free text mixed into the key namespace (e.g. a deployment id)."
    )
    # Test-only fault switches. Documented as such: they exist so that tests can prove the
    # checks can fail; they are never set in production.
    fault_skip_load_chunk: int = Field(
        default=-1, ge=-1, description="TEST ONLY: skip the copy of this chunk index in loads."
    )
    fault_fail_loads: int = Field(
        default=0, ge=0, description="TEST ONLY: report this many loads as failed (then none)."
    )
    fault_hold_steps: int = Field(
        default=0, ge=0, description="TEST ONLY: hold every transfer in flight this many steps."
    )
    fault_raise_in_transfer: int = Field(
        default=0, ge=0, description="TEST ONLY: raise inside this many worker transfers."
    )

    @model_validator(mode="after")
    def _check_combinations(self) -> KvtierConfig:
        if self.state_size is not None and self.state_size >= self.dram_size:
            raise ValueError(
                f"state_size ({format_bytes(self.state_size)}) must be smaller than dram_size "
                f"({format_bytes(self.dram_size)}): raise dram_size or lower state_size"
            )
        if self.gpu_staging_size > self.dram_size:
            raise ValueError(
                "gpu_staging_size is larger than dram_size: staging only needs a few chunks"
            )
        return self

    @classmethod
    def field_names(cls) -> list[str]:
        return list(cls.model_fields)

    @classmethod
    def load(
        cls,
        extra_config: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> KvtierConfig:
        """Merge environment (``KVTIER_*``) and dict settings; the dict wins.

        Keys in the dict may be written bare (``dram_size``) or prefixed (``kvtier.dram_size``)
        so that one vLLM extra-config can carry several connectors' settings.
        """
        environ = os.environ if environ is None else environ
        names = cls.field_names()
        values: dict[str, Any] = {}
        for var, raw in environ.items():
            if not var.startswith(ENV_PREFIX):
                continue
            name = var[len(ENV_PREFIX) :].lower()
            if name not in names:
                raise ConfigError(_unknown(var, [ENV_PREFIX + n.upper() for n in names]))
            values[name] = raw
        for key, raw in (extra_config or {}).items():
            name = key[len("kvtier.") :] if key.startswith("kvtier.") else key
            if name not in names:
                raise ConfigError(_unknown(key, names))
            values[name] = raw
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            raise ConfigError(_explain(e)) from None


def _unknown(key: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(key, choices, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else f"known settings: {', '.join(choices)}"
    return f"unknown kvtier setting {key!r}: {hint}"


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "config"
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"kvtier setting {where!r}: {msg} (got {e.get('input')!r})")
    return "; ".join(lines)
