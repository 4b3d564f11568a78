"""kvtier.config: one typed configuration from kv_connector_extra_config and KVTIER_* variables."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.config import (
    ENV_PREFIX,
    NON_SETTING_ENV,
    ConfigError,
    KvtierConfig,
    format_bytes,
    parse_bytes,
)
from kvtier.geometry import resolve_chunk_tokens

GiB = 2**30
MiB = 2**20


def load(extra: dict[str, object] | None = None, env: dict[str, str] | None = None
         ) -> KvtierConfig:
    return KvtierConfig.load(extra or {}, env or {})


# --- sources and precedence -------------------------------------------------------------------

def test_defaults_need_nothing() -> None:
    c = load()
    assert c.dram_size == 4 * GiB and c.policy == "slru" and c.chunk_tokens is None


def test_read_from_dict_bare_and_prefixed() -> None:
    c = load({"dram_size": "64GiB", "kvtier.policy": "lru", "chunk_tokens": 512,
              "save_generated_tokens": False})
    assert c.dram_size == 64 * GiB
    assert c.policy == "lru" and c.chunk_tokens == 512 and c.save_generated_tokens is False


def test_read_from_environment_with_one_prefix() -> None:
    env = {"KVTIER_DRAM_SIZE": "8GiB", "KVTIER_POLICY": "s3fifo", "KVTIER_MAX_PINS": "12",
           "KVTIER_COST_MODEL": "false", "KVTIER_LINK_GBPS": "55.5", "OTHER": "x"}
    c = load(env=env)
    assert (c.dram_size, c.policy, c.max_pins, c.cost_model, c.link_gbps) == (
        8 * GiB, "s3fifo", 12, False, 55.5)


def test_dict_wins_over_environment() -> None:
    c = load({"dram_size": "16GiB"}, {"KVTIER_DRAM_SIZE": "8GiB", "KVTIER_POLICY": "lru"})
    assert c.dram_size == 16 * GiB and c.policy == "lru"


def test_load_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_ADMISSION", "second_sight")
    assert KvtierConfig.load({}).admission == "second_sight"
    monkeypatch.setenv("KVTIER_ADMISSON", "always")
    with pytest.raises(ConfigError, match="KVTIER_ADMISSION"):
        KvtierConfig.load({})


def test_no_setting_injects_faults(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault injection is test machinery (kvtier.testing.faults), never a user setting."""
    assert not [n for n in KvtierConfig.field_names() if "fault" in n]
    monkeypatch.setenv("KVTIER_FAULT_SKIP_LOAD_CHUNK", "0")
    with pytest.raises(ConfigError, match="unknown kvtier environment variable "
                                          "'KVTIER_FAULT_SKIP_LOAD_CHUNK'"):
        KvtierConfig.load({})
    monkeypatch.delenv("KVTIER_FAULT_SKIP_LOAD_CHUNK")
    with pytest.raises(ConfigError, match="unknown kvtier setting 'fault_fail_loads'"):
        KvtierConfig.load({"fault_fail_loads": 1})


def test_the_configuration_is_frozen() -> None:
    c = load()
    with pytest.raises(Exception, match="frozen"):
        c.dram_size = 1  # type: ignore[misc]


# --- unknown keys ------------------------------------------------------------------------------

def test_unknown_dict_key_names_the_closest_field() -> None:
    with pytest.raises(ConfigError) as e:
        load({"dram_sise": "1GiB"})
    assert "'dram_sise'" in str(e.value) and "did you mean 'dram_size'" in str(e.value)


def test_unknown_prefixed_dict_key() -> None:
    with pytest.raises(ConfigError, match=r"did you mean 'kvtier\.policy'"):
        load({"kvtier.polcy": "lru"})


def test_unknown_key_without_close_match_lists_the_settings() -> None:
    with pytest.raises(ConfigError) as e:
        load({"completely_unrelated": 1})
    assert "known settings" in str(e.value) and "dram_size" in str(e.value)


def test_environment_variable_that_names_no_field() -> None:
    with pytest.raises(ConfigError) as e:
        load(env={"KVTIER_DRAM_SIZ": "1GiB"})
    msg = str(e.value)
    assert "environment variable 'KVTIER_DRAM_SIZ'" in msg
    assert "did you mean 'KVTIER_DRAM_SIZE'" in msg


def test_environment_variable_with_no_close_match() -> None:
    with pytest.raises(ConfigError, match="KVTIER_GPU_STAGING_SIZE"):
        load(env={"KVTIER_FOO": "1"})


def test_test_switches_are_not_settings() -> None:
    # scripts/test.sh documents KVTIER_SOAK=1: a soak run must still start the connector.
    assert "KVTIER_SOAK" in NON_SETTING_ENV
    assert load(env={"KVTIER_SOAK": "1"}) == load()


def test_same_setting_twice_in_the_dict() -> None:
    with pytest.raises(ConfigError, match=r"given twice.*keep one"):
        load({"dram_size": "1GiB", "kvtier.dram_size": "2GiB"})


def test_every_field_has_an_environment_variable() -> None:
    env = {ENV_PREFIX + n.upper(): "x" for n in KvtierConfig.field_names()}
    # each name is accepted as a name (values are then validated: "x" is mostly invalid)
    with pytest.raises(ConfigError) as e:
        load(env=env)
    assert "unknown" not in str(e.value)


# --- byte sizes --------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "value"), [
    ("64GiB", 64 * GiB), ("512MiB", 512 * MiB), ("1.5GB", 1_500_000_000), ("1 KiB", 1024),
    ("0.1KB", 100), ("3TB", 3 * 10**12), ("2TiB", 2 * 2**40), ("17B", 17), (" 4 GiB ", 4 * GiB),
])
def test_sizes_with_units(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize(("value", "hint"), [
    ("64", "unit"), (64.0, "explicit unit"), (True, "explicit unit"), (-64, "negative"),
    ("64G", "'64GiB'"), ("64gib", "GiB"), ("64 gigabytes", "GiB"), ("-1GiB", "e.g. '64GiB'"),
    ("1.5B", "whole number of bytes"), ("GiB", "e.g. '64GiB'"), ("1e9B", "e.g. '64GiB'"),
])
def test_wrong_units_say_what_to_write(value: object, hint: str) -> None:
    with pytest.raises(ValueError, match=hint):
        parse_bytes(value)
    with pytest.raises(ConfigError) as e:
        load({"dram_size": value})
    assert "dram_size" in str(e.value) and hint in str(e.value)


def test_json_integers_are_bytes() -> None:
    """vLLM's expander turns {"dram_size": 1G} into 1073741824 (every int was refused, so the
    engine did not start); a string without a unit, from a flag or a variable, stays an error."""
    c = load({"dram_size": 1073741824, "gpu_staging_size": 64 * MiB, "pin_step_size": 2**30})
    assert (c.dram_size, c.gpu_staging_size, c.pin_step_size) == (GiB, 64 * MiB, GiB)
    assert parse_bytes(0) == 0 and parse_bytes(17) == 17
    with pytest.raises(ConfigError, match="KVTIER_DRAM_SIZE"):
        load(env={"KVTIER_DRAM_SIZE": "1073741824"})
    with pytest.raises(ConfigError, match="dram_size"):
        load({"dram_size": "64"})


COUNTS_AND_NUMBERS = ["chunk_tokens", "admission_memory", "max_pending_saves",
                      "max_pending_loads", "max_pins",
                      "slru_protected_fraction", "s3fifo_small_fraction", "link_gbps",
                      "prefill_seconds_per_token", "step_seconds"]


@pytest.mark.parametrize("field", COUNTS_AND_NUMBERS)
@pytest.mark.parametrize("flag", [True, False])
def test_json_booleans_are_not_counts(field: str, flag: bool) -> None:
    with pytest.raises(ConfigError) as e:
        load({field: flag})
    assert field in str(e.value) and "boolean" in str(e.value)


def test_only_switches_take_booleans() -> None:
    """Every field that is not a bool refuses true (a new count is covered or fails here);
    a deprecated alias of a switch takes true and turns the switch on."""
    for name, f in KvtierConfig.model_fields.items():
        if f.annotation is bool:
            assert getattr(load({name: True}), name) is True
        elif f.annotation == bool | None:
            assert name == "defer_cold_requests"
            assert load({name: True}).cache_aware_admission is True
        else:
            with pytest.raises(ConfigError, match=name):
                load({name: True})


ROUND_TRIPS = [
    {}, {"dram_size": "128MiB"}, {"dram_size": "64MiB", "gpu_staging_size": "8MiB"},
    {"dram_size": "8GiB", "state_size": "2GiB", "chunk_tokens": 512, "policy": "s3fifo",
     "admission": "second_sight", "save_generated_tokens": False, "link_gbps": 55.5,
     "transfer_path": "dma", "model_revision": "r1", "namespace_extra": "prod"},
]


@pytest.mark.parametrize("extra", ROUND_TRIPS)
def test_model_dump_round_trips_through_validation(extra: dict[str, object]) -> None:
    c = load(extra)
    dumped = c.model_dump()
    assert KvtierConfig.model_validate(dumped) == c
    assert load(dumped) == c  # and as a kv_connector_extra_config
    assert KvtierConfig.model_validate(c.model_dump(mode="json")) == c


@settings(max_examples=100, deadline=None)
@given(dram=st.integers(1, 2**40), staging=st.one_of(st.none(), st.integers(1, 2**40)))
def test_staging_is_never_larger_than_dram_one_rule(dram: int, staging: int | None) -> None:
    """Unset, staging is 256MiB or dram_size if smaller; set, it must fit in dram_size. The
    same rule for both, so a dump of either validates back."""
    extra: dict[str, object] = {"dram_size": dram}
    if staging is not None:
        extra["gpu_staging_size"] = staging
    if staging is not None and staging > dram:
        with pytest.raises(ConfigError, match="gpu_staging_size"):
            load(extra)
        return
    c = load(extra)
    assert c.gpu_staging_size <= c.dram_size
    assert c.gpu_staging_size == (staging if staging is not None else min(256 * MiB, dram))
    assert KvtierConfig.model_validate(c.model_dump()) == c


def test_a_misspelt_prefix_beside_valid_variables_is_warned_about(
        kvtier_caplog: pytest.LogCaptureFixture) -> None:
    env = {"KVTIER_POLICY": "lru", "KVTEIR_DRAM_SIZE": "64GiB", "KVITER_MAX_PINS": "5",
           "KV_TIER_POLICY": "lru", "HOME": "/root", "VLLM_DRAM_SIZE": "1GiB",
           "KVTEIR_NOT_A_SETTING": "1"}
    c = load(env=env)
    assert c.policy == "lru" and c.dram_size == 4 * GiB and c.max_pins == 1 << 16
    warned = [r.getMessage() for r in kvtier_caplog.records]
    assert any("KVTEIR_DRAM_SIZE" in m and "did you mean KVTIER_DRAM_SIZE" in m
               for m in warned), warned
    assert any("KVITER_MAX_PINS" in m for m in warned), warned
    assert not any(v in m for m in warned for v in ("HOME", "VLLM_DRAM_SIZE",
                                                    "KVTEIR_NOT_A_SETTING")), warned


def test_bad_size_in_environment_names_the_variable() -> None:
    with pytest.raises(ConfigError) as e:
        load(env={"KVTIER_GPU_STAGING_SIZE": "256M"})
    assert "environment variable KVTIER_GPU_STAGING_SIZE" in str(e.value)
    assert "e.g. '256MiB'" in str(e.value)  # what "M" most likely meant


def test_sizes_must_be_positive() -> None:
    for field in ("dram_size", "gpu_staging_size", "pin_step_size", "state_size"):
        with pytest.raises(ConfigError, match=field):
            load({field: "0GiB"})


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=2**50))
def test_format_then_parse_is_identity(n: int) -> None:
    assert parse_bytes(format_bytes(n)) == n


# --- other values and impossible combinations -------------------------------------------------

@pytest.mark.parametrize(("extra", "field"), [
    ({"policy": "lfu"}, "policy"), ({"slru_protected_fraction": 1.0}, "slru_protected_fraction"),
    ({"chunk_tokens": 0}, "chunk_tokens"), ({"max_pending_saves": "many"}, "max_pending_saves"),
    ({"admission": "sometimes"}, "admission"), ({"link_gbps": -3}, "link_gbps"),
])
def test_bad_values_name_the_setting_and_the_value(extra: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        load(extra)
    assert field in str(e.value) and repr(next(iter(extra.values()))) in str(e.value)


def test_state_size_must_leave_room_for_kv() -> None:
    with pytest.raises(ConfigError) as e:
        load({"dram_size": "8GiB", "state_size": "8GiB"})
    assert "raise dram_size or lower state_size" in str(e.value)
    assert load({"dram_size": "8GiB", "state_size": "2GiB"}).state_size == 2 * GiB


def test_staging_larger_than_dram_says_what_fits() -> None:
    with pytest.raises(ConfigError) as e:
        load({"dram_size": "128MiB", "gpu_staging_size": "256MiB"})
    assert "gpu_staging_size of at most 128MiB" in str(e.value)
    assert load({"dram_size": "128MiB", "gpu_staging_size": "64MiB"}).dram_size == 128 * MiB
    # the default staging is not the user's choice: with a small dram_size it is dram_size
    assert load({"dram_size": "128MiB"}).gpu_staging_size == 128 * MiB
    assert load({"dram_size": "1GiB"}).gpu_staging_size == 256 * MiB


def test_chunk_size_default_is_a_multiple_of_every_block_size() -> None:
    c = load().chunk_tokens
    assert resolve_chunk_tokens(c, [16]) == 256
    assert resolve_chunk_tokens(c, [16, 64]) == 256
    assert resolve_chunk_tokens(c, [528, 16]) == 528  # mamba hybrids raise attention blocks
    assert resolve_chunk_tokens(c, [96, 64]) == 384


def test_chunk_size_not_a_multiple_of_the_block_sizes() -> None:
    c = load({"chunk_tokens": 100}).chunk_tokens
    with pytest.raises(ConfigError) as e:
        resolve_chunk_tokens(c, [16, 64])
    assert "chunk_tokens=64 or 128" in str(e.value) and "LCM is 64" in str(e.value)
    assert resolve_chunk_tokens(load({"chunk_tokens": 512}).chunk_tokens, [16, 64]) == 512
    with pytest.raises(ConfigError, match="chunk_tokens=96"):
        resolve_chunk_tokens(load({"chunk_tokens": 40}).chunk_tokens, [96])
