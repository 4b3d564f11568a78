"""kvtier's configuration: one typed object, read from vLLM's ``kv_connector_extra_config``
dict and from ``KVTIER_*`` environment variables.

Contract:
- Byte sizes carry explicit units: ``"64GiB"``, ``"512MiB"``, ``"1.5GB"``. A string without a
  unit (``"64"``, from a flag or a variable) is an error (is it bytes? GiB?), as is an
  ambiguous suffix such as ``"64G"``. A JSON integer is a number of bytes: vLLM's argument
  expander turns ``{"dram_size": 1G}`` into ``1073741824``, and ``model_dump()`` writes sizes
  as integers, which validate back to the same configuration.
- Counts and numbers are not booleans: ``true`` for ``max_pins`` is an error, not 1.
- Unknown keys are errors, in the dict and in the environment (a ``KVTIER_`` variable that
  names no field), and the message names the closest field. The only ``KVTIER_`` variables
  that are not settings are those in :data:`NON_SETTING_ENV` (switches of the test scripts,
  the start-up report file of kvtier.vllm.startup).
- The dict wins over the environment: the engine's own configuration is the more specific one.
  A key given twice in the dict (``dram_size`` and ``kvtier.dram_size``) is an error.
- Every error names where the bad value came from (the dict key or the environment variable).
  A variable whose prefix is a misspelling of ``KVTIER_`` (``KVTEIR_DRAM_SIZE``) and whose rest
  names a setting is ignored with a warning.
- Impossible combinations are rejected at start-up with what to write instead, including a
  chunk size that is not a multiple of every KV-cache group's block size
  (:func:`kvtier.geometry.resolve_chunk_tokens`, where the chunk geometry lives).
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from kvtier.log import get_logger

ENV_PREFIX = "KVTIER_"
DICT_PREFIX = "kvtier."
# KVTIER_ variables that are not settings: switches of scripts/test.sh, and the file a
# kvtier-aware parent hands its engine processes for start-up failures (kvtier.vllm.startup).
# KVTIER_TEST_REDIS*: the Redis servers scripts/test.sh started for the tests (tests/_redis.py)
NON_SETTING_ENV = frozenset({"KVTIER_SOAK", "KVTIER_STARTUP_REPORT", "KVTIER_TEST_REDIS",
                             "KVTIER_TEST_REDIS_CLUSTER", "KVTIER_TEST_REDIS_REQUIRED"})
DEFAULT_DRAM_SIZE = 4 * 2**30
DEFAULT_STAGING_SIZE = 256 * 2**20
_DEPRECATED_ALIASES = {"disk_max_defer_ms": "prepare_timeout_ms",
                       "disk_max_defer_steps": "prepare_max_steps",
                       "defer_cold_requests": "cache_aware_admission"}

logger = get_logger("config")

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
    """Parse a size with an explicit unit ("64GiB", "1.5 GB", "512MiB") into bytes; an integer
    (JSON's, after vLLM expanded "1G") is bytes already.

    Unit-less strings, floats and booleans are rejected: in text the unit is part of the value.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"a byte size cannot be negative, got {value}")
        return value
    if not isinstance(value, str):
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
        guess = _unit_guess(unit)
        raise ValueError(
            f"unknown unit {unit!r} in {value!r}: use B, KB, MB, GB, TB (powers of 1000) "
            f"or KiB, MiB, GiB, TiB (powers of 1024), e.g. '{number}{guess}'"
        )
    factor = _UNITS[unit.upper()]
    size = Decimal(number) * factor  # exact: "0.1KB" is 100 bytes, not 100.00000000000001
    if size != size.to_integral_value():
        raise ValueError(
            f"{value!r} is not a whole number of bytes: write it in a smaller unit"
        )
    return int(size)


def _unit_guess(unit: str) -> str:
    """The unit someone writing ``unit`` most likely meant ("G" -> "GiB", "mib" -> "MiB")."""
    u = unit.upper()
    for spelled in _UNIT_SPELLING:
        if spelled.upper() == u:
            return spelled
    letter = u[:1]
    if letter in "KMGT" and u in (letter, letter + "I", letter + "IB", letter + "B"):
        return f"{letter}iB"
    if u.startswith(("KILO", "MEGA", "GIGA", "TERA")):
        return f"{letter}iB"
    return "GiB"


def format_bytes(n: int) -> str:
    """The inverse of :func:`parse_bytes` for display: the largest binary unit that is exact."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        factor = _UNITS[unit.upper()]
        if n >= factor and n % factor == 0:
            return f"{n // factor}{unit}"
    return f"{n}B"


def _not_a_boolean(value: object) -> object:
    """JSON ``true`` is not the count 1 (pydantic's lax mode would take it as such)."""
    if isinstance(value, bool):
        raise ValueError(f"a number is needed here, got the boolean {value!r}")
    return value


ByteSize = Annotated[int, BeforeValidator(parse_bytes)]
PositiveByteSize = Annotated[int, BeforeValidator(parse_bytes), Field(gt=0)]
Count = Annotated[int, BeforeValidator(_not_a_boolean)]
Number = Annotated[float, BeforeValidator(_not_a_boolean)]

PolicyName = Literal["lru", "slru", "s3fifo"]
AdmissionName = Literal["always", "second_sight"]


class KvtierConfig(BaseModel):
    """Every setting of kvtier. Field docs are the user documentation (``kvtier config``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dram_size: PositiveByteSize = Field(
        default=DEFAULT_DRAM_SIZE,
        description="Host DRAM for stored KV, per engine, all ranks together (e.g. '64GiB').",
    )
    chunk_tokens: Count | None = Field(
        default=None,
        ge=1,
        description="Tokens per stored chunk; a multiple of every KV-cache group's block size. "
        "Default: the smallest multiple of their LCM that is at least 256.",
    )
    policy: PolicyName = Field(default="slru", description="Eviction policy: lru, slru, s3fifo.")
    slru_protected_fraction: Number = Field(
        default=0.8, gt=0.0, lt=1.0, description="SLRU: share of slots in the protected segment."
    )
    s3fifo_small_fraction: Number = Field(
        default=0.1, gt=0.0, lt=1.0, description="S3-FIFO: share of slots in the small queue."
    )
    admission: AdmissionName = Field(
        default="always",
        description="'second_sight' saves a chunk only once its prefix was seen twice.",
    )
    admission_memory: Count = Field(
        default=1 << 20, ge=1, description="Keys remembered by second-sight admission."
    )
    save_generated_tokens: bool = Field(
        default=True,
        description="Also save chunks of generated tokens (an agent's next turn starts with them).",
    )
    state_size: PositiveByteSize | None = Field(
        default=None,
        description="DRAM reserved for recurrent-state objects, out of dram_size. Default: a "
        "quarter of dram_size when the model has recurrent state, else none; a model with "
        "only recurrent state uses all of dram_size.",
    )
    max_pending_saves: Count = Field(
        default=256, ge=1, description="Chunks queued or in flight for saving; beyond, saves drop."
    )
    max_pending_loads: Count = Field(
        default=1024, ge=1, description="Chunks in flight for loading; beyond, hits are declined."
    )
    max_pins: Count = Field(
        default=1 << 16, ge=1, description="Chunks pinned by decided loads at once."
    )
    gpu_staging_size: PositiveByteSize = Field(
        default=DEFAULT_STAGING_SIZE,
        description="Device staging memory for transfers, at most dram_size. Default: 256MiB, "
        "or dram_size if that is smaller.",
    )
    transfer_path: Literal["auto", "dma", "kernel"] = Field(
        default="auto",
        description="GPU transfers: batched DMA, a Triton gather into staging, or auto (per "
        "KV-cache group by piece size, as measured on an H200).",
    )
    # Off by default until measured on the H200 against the parked loads (issue 15).
    layerwise_loads: bool = Field(
        default=False,
        description="Restore a hit inside the step that computes the rest of its prompt, "
        "layer by layer (vLLM's synchronous loads): the request is not parked, and each "
        "attention layer waits on the GPU only for its own bytes, so the copy overlaps the "
        "forward. Only for one KV-cache group of plain attention, without EAGLE/MTP drafts, "
        "with verify_checksums off and CUDA graphs that are not FULL for every batch (and "
        "without a node-wide store under vLLM's asynchronous scheduler); elsewhere kvtier "
        "warns once and parks the request for its load as without it. Under the "
        "asynchronous scheduler a load that fails once promised (only a CUDA error or a bug "
        "can) stops the engine; under the synchronous one vLLM recomputes it.",
    )
    # Off by default until measured on the H200 against the per-layer registration.
    cross_layer_blocks: bool = Field(
        default=False,
        description="Ask vLLM (0.25.1) for one KV-cache tensor of all layers, a block's bytes "
        "of every layer together (as its native offloading does), where the model has one "
        "KV-cache group of plain attention, no EAGLE/MTP drafts and an unquantized cache: a "
        "chunk then moves as whole blocks by DMA. vLLM 0.25.1 allocates it only in its V1 model "
        "runner (VLLM_USE_V2_MODEL_RUNNER=0); elsewhere kvtier warns once and moves per-layer "
        "blocks.",
    )
    kv_cache_layout: Literal["engine", "NHD", "HND"] = Field(
        default="engine",
        description="The KV-cache layout the connector asks vLLM for (0.25.1's "
        "get_required_kvcache_layout): engine = vLLM's own choice (NHD); HND is what vLLM's "
        "native offloading asks for. kvtier moves either as opaque bytes.",
    )
    pin_step_size: PositiveByteSize = Field(
        default=2**30, description="Host memory is pinned with CUDA in steps of this size."
    )
    link_gbps: Number = Field(
        default=20.0, gt=0, description="Host-link GB/s assumed until transfers measure it."
    )
    prefill_seconds_per_token: Number = Field(
        default=50e-6, gt=0, description="Prefill cost assumed until steps measure it."
    )
    step_seconds: Number = Field(
        default=0.02, ge=0, description="Engine step latency assumed until measured (parking cost)."
    )
    cost_model: bool = Field(
        default=True, description="Decline loads that cost more than recomputing (else load all)."
    )
    # Off by default until both engines are measured under 1% (docs/notes/checksums.md §9):
    # on the H200 the device checksums reported false mismatches for large layouts and cost
    # up to a third of the bidirectional DMA rate; on a 2-core CPU a restore took 78% longer.
    verify_checksums: bool = Field(
        default=False,
        description="Checksum every chunk at save and verify it before a restore: a mismatch "
        "fails the load (vLLM recomputes those tokens), is counted (checksum_failures) and "
        "logged, and the chunk is dropped. On vLLM 0.25.1 with several KV-cache groups, where "
        "a load cannot fail once promised, hits are verified before they are promised. Off by "
        "default for now: its cost is not yet under 1% on either engine.",
    )
    cache_aware_admission: bool = Field(
        default=False,
        description="Cache-aware admission: while others run or load, a waiting request "
        "waits (bounded: defer_max_steps, defer_max_ms) when the chunk after its HBM hit is "
        "being computed or loaded by a running request (it shares that request's blocks "
        "next step instead of computing or loading them again), or when HBM cannot hold it "
        "now (the requests behind it that fit go first; vLLM's first-come-first-served "
        "scan would stop at it). Never under vLLM's priority policy. Off by default until "
        "it wins on every workload measured.",
    )
    defer_cold_requests: bool | None = Field(
        default=None,
        description="Deprecated alias of cache_aware_admission.",
    )
    # The bounds are starvation bounds, not tuning: past one, a request is never deferred
    # again, so a request that does not fit stops vLLM's first-come-first-served scan until it
    # fits, as without admission. An expiry in the middle of a run gives that order back to
    # everything behind it (on a CPU model of the reference run, 144 engine steps without
    # expiries, 309-347 with bounds that expire mid-run, 428 without admission): the defaults
    # outlast the reference runs, which take 8-30 s.
    defer_max_steps: Count = Field(
        default=4096, ge=1, description="Engine steps a request may be deferred, at most."
    )
    defer_max_ms: Number = Field(
        default=30_000.0, gt=0,
        description="Milliseconds a request may be deferred from its first deferral, at most.",
    )
    # a deferred request is asked again every step vLLM's scan reaches it: a few microseconds
    # on kvtier's side (no lookup: admission decides first), plus vLLM's own prefix-cache
    # lookup of it; the scan reaches past the deferred ones only as far as this many
    defer_max_requests: Count = Field(
        default=64, ge=1,
        description="Requests deferred at once, at most (each is asked again every step).",
    )
    prepare_timeout_ms: Number = Field(
        default=1000.0, gt=0,
        description="The longest a request waits, from its first deferred lookup, while its "
        "hit is made ready in DRAM before it is promised: chunks promoted from the disk or "
        "remote tier (and the remote tier's lookup of what it holds), "
        "or verified where hits are verified before they are promised (see verify_checksums). "
        "Past it (or prepare_max_steps) the request goes on with what is ready.",
    )
    prepare_max_steps: Count = Field(
        default=10_000, ge=0,
        description="Engine steps a request may wait while its hit is made ready in DRAM "
        "(see prepare_timeout_ms).",
    )
    allow_fail_policy: bool = Field(
        default=False,
        description="Start even if vLLM's kv_load_failure_policy is not 'recompute'.",
    )
    disk_path: str | None = Field(
        default=None,
        description="Directory of the local disk tier under DRAM (a local disk, not tmpfs or "
        "a network filesystem; one engine per directory), above the remote tier when "
        "remote_url is set too. Unset: no disk tier.",
    )
    disk_size: PositiveByteSize | None = Field(
        default=None, description="Bytes the disk tier may use (e.g. '500GiB'); needs disk_path."
    )
    disk_max_pending_chunks: Count = Field(
        default=256, ge=1,
        description="Chunks in flight to or from the disk tier, and, separately, to or from "
        "the remote tier; beyond, that tier's demotions, write-throughs and promotions are "
        "skipped.",
    )
    disk_max_defer_steps: Count | None = Field(
        default=None, ge=0,
        description="Deprecated alias of prepare_max_steps (one bound for every preparation).",
    )
    disk_max_defer_ms: Number | None = Field(
        default=None, ge=0,
        description="Deprecated alias of prepare_timeout_ms (one bound for every preparation).",
    )
    # The remote tier (kvtier.tiers.remote): a Redis or Valkey shared by several engines.
    remote_url: str | None = Field(
        default=None,
        description="redis://host:port or rediss://host:port (TLS) of the shared remote tier "
        "below DRAM, and below the disk tier when disk_path is set too (lookups ask DRAM, "
        "the disk, then the remote store); no credentials in it (remote_username, "
        "remote_password). Unset: none.",
    )
    remote_cluster: bool = Field(
        default=False, description="The remote_url is one node of a Redis Cluster."
    )
    remote_username: str | None = Field(
        default=None, description="ACL user of the remote tier (AUTH username password)."
    )
    remote_password: SecretStr | None = Field(
        default=None, description="Password of the remote tier (never logged)."
    )
    remote_tls_ca_file: str | None = Field(
        default=None, description="CA bundle that verifies the remote tier's TLS certificate."
    )
    remote_tls_cert_file: str | None = Field(
        default=None, description="Client certificate for TLS to the remote tier (mutual TLS)."
    )
    remote_tls_key_file: str | None = Field(
        default=None, description="Key of remote_tls_cert_file."
    )
    remote_key_prefix: str = Field(
        default="kvtier", pattern=r"^[A-Za-z0-9_.-]{1,64}$",
        description="First part of every remote key ('<prefix>:...'): what an ACL key pattern "
        "('~<prefix>:*') confines a deployment's user to.",
    )
    remote_size: PositiveByteSize = Field(
        default=2**40, description="Bytes of the remote tier this engine counts on holding."
    )
    remote_timeout_ms: Number = Field(
        default=200.0, gt=0,
        description="Longest one remote call may take (connect, read or write) before it "
        "fails: a miss or a dropped write, counted by the circuit breaker.",
    )
    remote_part_size: PositiveByteSize = Field(
        default=2**20, description="Chunks are stored in values of at most this many bytes."
    )
    remote_ttl_s: Count = Field(
        default=0, ge=0, description="Seconds a remote chunk lives (0: until the server evicts)."
    )
    remote_breaker_failures: Count = Field(
        default=3, ge=1,
        description="Consecutive failed remote calls that open the circuit breaker (then "
        "every call is a miss or a dropped write, at once, until a probe succeeds).",
    )
    remote_breaker_cooldown_ms: Number = Field(
        default=1000.0, gt=0, description="Open-breaker time before the next probe call."
    )
    store_url: str | None = Field(
        default=None,
        description="The node-wide store to attach to (`kvtier store`), as "
        "unix:///absolute/socket/path; its pool and index replace this engine's own "
        "(dram_size is then this engine's quota in the store), and so do its tiers below "
        "DRAM (`kvtier store --disk-path`). Unset: an in-process pool.",
    )
    model_revision: str = Field(
        default="", description="Weight revision; part of the key namespace."
    )
    namespace_extra: str = Field(
        default="", description="Free text mixed into the key namespace (e.g. a deployment id)."
    )

    @field_validator("store_url")
    @classmethod
    def _store_url_form(cls, v: str | None) -> str | None:
        if v is not None and (not v.startswith("unix:///") or "\x00" in v):
            raise ValueError(f"store_url must be unix:///absolute/socket/path (what `kvtier "
                             f"store` prints when ready), got {v!r}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _deprecated_aliases(cls, data: Any) -> Any:
        """Renamed settings: the disk tier's deferral bounds became the one preparation
        bound, defer_cold_requests became cache_aware_admission (it defers more than cold
        requests). An old setting sets the new one unless that is given too."""
        if not isinstance(data, Mapping):
            return data
        out = dict(data)
        for old, new in _DEPRECATED_ALIASES.items():
            if out.get(old) is not None and out.get(new) is None:
                out[new] = out[old]
        return out

    @model_validator(mode="before")
    @classmethod
    def _default_staging(cls, data: Any) -> Any:
        """An unset gpu_staging_size is 256MiB or dram_size, whichever is smaller, so that
        the one rule (staging <= dram_size) holds for defaults and settings alike, and a
        ``model_dump()`` validates back."""
        if not isinstance(data, Mapping) or data.get("gpu_staging_size") is not None:
            return data
        try:
            dram = parse_bytes(data.get("dram_size", DEFAULT_DRAM_SIZE))
        except ValueError:
            return data  # dram_size's own error says what is wrong
        if dram <= 0:
            return data
        return {**data, "gpu_staging_size": min(DEFAULT_STAGING_SIZE, dram)}

    @model_validator(mode="after")
    def _check_combinations(self) -> KvtierConfig:
        if self.state_size is not None and self.state_size >= self.dram_size:
            raise ValueError(
                f"state_size ({format_bytes(self.state_size)}) must be smaller than dram_size "
                f"({format_bytes(self.dram_size)}): raise dram_size or lower state_size"
            )
        if self.gpu_staging_size > self.dram_size:
            raise ValueError(
                f"gpu_staging_size ({format_bytes(self.gpu_staging_size)}) is larger than "
                f"dram_size ({format_bytes(self.dram_size)}): write gpu_staging_size of at "
                f"most {format_bytes(self.dram_size)} (staging only needs a few chunks)"
            )
        if self.store_url is not None and (self.disk_path is not None
                                           or self.remote_url is not None):
            raise ValueError(
                "store_url excludes disk_path and remote_url: an engine attached to the "
                "store uses the store's tiers below DRAM, configured on the store (kvtier "
                "store --disk-path DIR --disk-size SIZE); unset disk_path and remote_url"
            )
        if (self.disk_path is None) != (self.disk_size is None):
            raise ValueError(
                "disk_path and disk_size go together: set both for a disk tier, or neither"
            )
        if self.remote_url is not None:
            _check_remote(self)
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
        source: dict[str, str] = {}
        for var, raw in environ.items():
            if not var.startswith(ENV_PREFIX) or var in NON_SETTING_ENV:
                _warn_if_misspelt_prefix(var, names)
                continue
            name = var[len(ENV_PREFIX) :].lower()
            if name not in names:
                raise ConfigError(_unknown(var, name, names, "environment variable",
                                           ENV_PREFIX))
            values[name] = raw
            source[name] = f"environment variable {var}"
        seen_in_dict: dict[str, str] = {}
        for key, raw in (extra_config or {}).items():
            if not isinstance(key, str):
                raise ConfigError(f"kvtier setting keys are strings, got {key!r}")
            name = key[len(DICT_PREFIX) :] if key.startswith(DICT_PREFIX) else key
            if name not in names:
                prefix = DICT_PREFIX if key.startswith(DICT_PREFIX) else ""
                raise ConfigError(_unknown(key, name, names, "setting", prefix))
            if name in seen_in_dict:
                raise ConfigError(
                    f"kvtier setting {name!r} is given twice in kv_connector_extra_config "
                    f"(as {seen_in_dict[name]!r} and {key!r}): keep one"
                )
            seen_in_dict[name] = key
            values[name] = raw
            source[name] = f"kv_connector_extra_config[{key!r}]"
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            raise ConfigError(_explain(e, source)) from None


def _warn_if_misspelt_prefix(var: str, names: Sequence[str]) -> None:
    """``KVTEIR_DRAM_SIZE``: the rest names a setting and the prefix is close to KVTIER, so
    someone meant a setting that kvtier will not see."""
    prefix, sep, rest = var.partition("_")
    want = ENV_PREFIX.rstrip("_")
    if not sep or prefix.upper() == want or rest.lower() not in names:
        return
    if difflib.SequenceMatcher(None, prefix.upper(), want).ratio() >= 0.75:
        logger.warning("environment variable %s is ignored: its prefix is not %s; did you "
                       "mean %s?", var, ENV_PREFIX, ENV_PREFIX + rest.upper())


def _unknown(key: str, name: str, choices: list[str], what: str, prefix: str = "") -> str:
    """``name`` is ``key`` without its prefix; suggestions compare names, not prefixes."""
    close = difflib.get_close_matches(name.lower(), choices, n=1, cutoff=0.6)
    if close:
        spelled = prefix + (close[0].upper() if prefix == ENV_PREFIX else close[0])
        hint = f"did you mean {spelled!r}?"
    else:
        known = [prefix + (c.upper() if prefix == ENV_PREFIX else c) for c in choices]
        hint = f"known settings: {', '.join(known)}"
    return f"unknown kvtier {what} {key!r}: {hint}"


def _explain(err: ValidationError, source: Mapping[str, str]) -> str:
    lines = []
    for e in err.errors():
        field = str(e["loc"][0]) if e["loc"] else ""
        where = source.get(field) or (f"setting {field!r}" if field else "configuration")
        msg = e["msg"].removeprefix("Value error, ")
        got = f" (got {e['input']!r})" if field else ""
        lines.append(f"kvtier {where}: {msg}{got}")
    return "; ".join(lines)


def _check_remote(c: KvtierConfig) -> None:
    """The remote tier's settings that only make sense together (message never names the
    password)."""
    from urllib.parse import urlsplit

    url = urlsplit(c.remote_url or "")
    if url.scheme not in ("redis", "rediss") or not url.hostname:
        raise ValueError("remote_url is redis://host:port or rediss://host:port")
    if url.username or url.password:
        raise ValueError("remote_url carries no credentials: set remote_username and "
                         "remote_password instead (they are never logged)")
    tls = [c.remote_tls_ca_file, c.remote_tls_cert_file, c.remote_tls_key_file]
    if url.scheme == "redis" and any(tls):
        raise ValueError("remote_tls_* settings need a rediss:// remote_url")
    if (c.remote_tls_cert_file is None) != (c.remote_tls_key_file is None):
        raise ValueError("remote_tls_cert_file and remote_tls_key_file go together")
    if c.remote_username is not None and c.remote_password is None:
        raise ValueError("remote_username needs remote_password")
