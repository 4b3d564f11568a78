"""kvtier.keys: prefix-chained chunk keys under a namespace (docs/design.md §2.3)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier.keys as keys_mod
from kvtier.config import KvtierConfig
from kvtier.keys import UNSUPPORTED, Namespace, RequestKeys, chunk_key, encode_extra
from kvtier.layout import GroupKind
from kvtier.planner import Decline, Geometry, GroupGeometry, make_slab_layout
from kvtier.scheduler import OffloadScheduler

ROOT = Path(__file__).resolve().parent.parent
SOAK = bool(os.environ.get("KVTIER_SOAK"))
C = 16  # tokens per chunk in most tests


def ns(**changes: object) -> Namespace:
    base = Namespace(model="meta-llama/Llama-3.1-8B", layout_fingerprint="ab" * 16,
                     kv_cache_dtype="auto", chunk_tokens=C, model_revision="r1",
                     fixed_scales={"model.layers.0.attn._k_scale": 1.0}, tp_size=1,
                     extra="prod")
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def keys_of(tokens: list[int], namespace: Namespace | None = None, salt: str | None = None,
            extra: Callable[[int, int], object] | None = None, chunk: int = C) -> list[bytes]:
    rk = RequestKeys((namespace or ns()).digest(), chunk, cache_salt=salt, extra_keys=extra)
    rk.update(tokens)
    return rk.keys


TOKENS = [random.Random(7).randrange(0, 150_000) for _ in range(10 * C + 5)]


# --- stability across processes -----------------------------------------------------------------

_SCRIPT = r"""
import json
from kvtier.keys import Namespace, RequestKeys
ns = Namespace(model="m", layout_fingerprint="f", kv_cache_dtype="fp8_e4m3", chunk_tokens=4,
               model_revision="rev", fixed_scales={"a": 0.5, "b": 2.0}, tp_size=2, extra="x")
def extra(s, e):
    return (("mm", "hash-%d" % s, 1), ("lora", "name", "/p"), b"\x00\xff", 3.25, None, True)
rk = RequestKeys(ns.digest(), 4, cache_salt="tenant-a", extra_keys=extra)
rk.update(list(range(1000, 1030)))
print(json.dumps([ns.digest().hex()] + [k.hex() for k in rk.keys]))
"""


def _run_keys(hashseed: str) -> list[str]:
    env = dict(os.environ, PYTHONHASHSEED=hashseed)
    out = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                         text=True, cwd=ROOT, timeout=120, check=True)
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def test_same_keys_in_another_process_with_another_hash_seed() -> None:
    a, b = _run_keys("0"), _run_keys("4242")
    assert a == b and len(a) == 1 + 30 // 4
    ns_ = {}
    exec(_SCRIPT.replace("print(", "result = ("), ns_)  # and in this process
    assert json.loads(ns_["result"]) == a
    # Known answer: a change to the key format invalidates every stored chunk; make it loud.
    # The namespace digest and every link of the chain: later keys pin how a key chains to
    # its parent (the salt and the extra keys of every chunk), not only the first chunk's.
    assert a == KNOWN_KEYS, f"key format changed: the keys are now {a}"


KNOWN_KEYS = [
    "4a429384e5015ef610c99d1ce1aa25f7",  # the namespace digest
    "c62a51865ad6f9f957f0cd509df9409b",  # chunk 0: namespace, salt, tokens 1000-1003
    "1452715fc7e93162cd7755e05f0dcfdb",
    "dd30813c0d05cfd6919f798b3ed4e044",
    "d6635d4f60f87cc8da3db891567edf82",
    "effc17422bdddef19453ff6ed78e08c6",
    "65c3a246997e16f862e735c9742664c0",
    "c8a17c6bfc41cb4aaeb934d8a46fd9e0",  # chunk 6: tokens 1024-1027 (1028-1029 not full)
]


# --- what changes a key ----------------------------------------------------------------------------

@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(Namespace)])
def test_every_namespace_field_changes_every_key(field: str) -> None:
    changed = {
        "model": "other/model", "layout_fingerprint": "cd" * 16, "kv_cache_dtype": "fp8_e5m2",
        "chunk_tokens": C + 1, "model_revision": "r2",
        "fixed_scales": {"model.layers.0.attn._k_scale": 0.5}, "tp_size": 2, "extra": "dev",
        "codec_version": 99,
    }[field]
    a, b = keys_of(TOKENS), keys_of(TOKENS, ns(**{field: changed}))
    assert len(a) == len(b) == 10
    assert all(x != y for x, y in zip(a, b))


def test_rank_is_not_a_key_field() -> None:
    names = {f.name for f in dataclasses.fields(Namespace)}
    assert not {"rank", "tp_rank", "pp_rank"} & names


@settings(max_examples=60 if not SOAK else 2000, deadline=None)
@given(pos=st.integers(0, len(TOKENS) - 1), delta=st.integers(1, 1000))
def test_changing_any_token_changes_its_chunk_and_all_later_keys(pos: int, delta: int) -> None:
    other = list(TOKENS)
    other[pos] = (other[pos] + delta) % 2**32
    a, b = keys_of(TOKENS), keys_of(other)
    first = pos // C
    assert a[:first] == b[:first]
    assert all(x != y for x, y in zip(a[first:], b[first:]))


def test_changing_any_extra_key_changes_the_key() -> None:
    base = ("mm", "img-1", 3)

    def extra_with(value: object, at: int) -> Callable[[int, int], object]:
        return lambda s, e: (value,) if s // C == at else (base,)

    a = keys_of(TOKENS, extra=extra_with(base, 4))
    for v in [("mm", "img-2", 3), ("mm", "img-1", 4), ("lora", "img-1", 3), "img-1", b"img-1",
              1, 1.0, True, None, ()]:
        b = keys_of(TOKENS, extra=extra_with(v, 4))
        assert a[:4] == b[:4] and all(x != y for x, y in zip(a[4:], b[4:])), v


def test_salt_enters_the_first_chunk() -> None:
    plain, s1, s2 = keys_of(TOKENS), keys_of(TOKENS, salt="a"), keys_of(TOKENS, salt="b")
    assert all(len({x, y, z}) == 3 for x, y, z in zip(plain, s1, s2))
    # the salt is a separate field: extra keys that spell it out do not collide with it
    mimic = keys_of(TOKENS, extra=lambda s, e: ["a", None] if s == 0 else None)
    assert mimic[0] != s1[0]


def test_chunk_boundary_changes_the_key() -> None:
    # Same tokens, same namespace bytes, another chunk size: no key in common.
    digest = ns().digest()
    for c2 in (8, 32):
        rk = RequestKeys(digest, c2)
        rk.update(TOKENS)
        assert not set(rk.keys) & set(keys_of(TOKENS))
    # The token count is hashed: a chunk's tokens cannot be re-cut into another chunk.
    assert chunk_key(b"p", [1, 2], b"") != chunk_key(b"p", [1], b"")
    assert chunk_key(b"p", [1, 0], b"") != chunk_key(b"p", [1], b"\x00\x00\x00\x00")


def test_vllm_extra_keys_are_included() -> None:
    """vLLM's own per-block extra keys (kv_cache_utils.generate_block_hash_extra_keys):
    multimodal hashes with offsets, LoRA name and path, cache salt, prompt-embeds digests."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    def request(lora: str | None, mm_hash: str) -> SimpleNamespace:
        feature = SimpleNamespace(identifier=mm_hash,
                                  mm_position=SimpleNamespace(offset=20, length=30))
        return SimpleNamespace(
            mm_features=[feature], cache_salt="s",
            lora_request=SimpleNamespace(lora_name=lora, lora_path=f"/lora/{lora}") if lora
            else None, prompt_embeds=None)

    def vllm_extra(req: SimpleNamespace) -> Callable[[int, int], object]:
        return lambda s, e: generate_block_hash_extra_keys(req, s, e, 0)[0]  # type: ignore

    base = keys_of(TOKENS, extra=vllm_extra(request("a", "h1")))
    rk = RequestKeys(ns().digest(), C, extra_keys=vllm_extra(request("a", "h1")))
    rk.update(TOKENS)
    assert not rk.unsaveable and rk.keys == base
    other_mm = keys_of(TOKENS, extra=vllm_extra(request("a", "h2")))
    assert other_mm[0] == base[0] and other_mm[1] != base[1]  # the image starts in chunk 1
    other_lora = keys_of(TOKENS, extra=vllm_extra(request("b", "h1")))
    assert all(x != y for x, y in zip(base, other_lora))


def test_extra_keys_kvtier_cannot_include_make_the_request_unsaveable() -> None:
    for bad in (UNSUPPORTED, object(), {"mm": "dict"}, ("ok", object()), [1, {2}]):
        rk = RequestKeys(ns().digest(), C,
                         extra_keys=lambda s, e, bad=bad: bad if s >= 3 * C else None)
        assert rk.update(TOKENS) == 3
        assert rk.unsaveable
        assert rk.update([*TOKENS, *TOKENS]) == 3  # no keys ever after
    assert encode_extra(object()) is None and encode_extra(UNSUPPORTED) is None
    assert encode_extra(None) == encode_extra(()) == encode_extra([]) == b""


UNENCODABLE_EXTRAS = [2**64, -(2**63) - 1, ("lora", 2**64), "mm-\ud800", [b"x", "\udfff"]]


@pytest.mark.parametrize("bad", UNENCODABLE_EXTRAS, ids=repr)
def test_extra_keys_that_cannot_be_encoded_make_the_request_unsaveable(bad: object) -> None:
    """Plain types whose values msgpack cannot encode (an int of 2**64, a lone surrogate)
    mark the request unsaveable; they raised OverflowError / UnicodeEncodeError before."""
    assert encode_extra(bad) is None
    rk = RequestKeys(ns().digest(), C, extra_keys=lambda s, e: bad if s >= 2 * C else None)
    assert rk.update(TOKENS) == 2 and rk.unsaveable
    assert rk.update([*TOKENS, *TOKENS]) == 2


def test_a_salt_that_cannot_be_encoded_makes_the_request_unsaveable() -> None:
    assert encode_extra(None, salt="tenant-\ud800") is None
    rk = RequestKeys(ns().digest(), C, cache_salt="tenant-\ud800")
    assert rk.update(TOKENS) == 0 and rk.unsaveable


@pytest.mark.parametrize("token", [2**32, -1])
def test_a_token_id_outside_uint32_makes_the_request_unsaveable(token: int) -> None:
    tokens = [*TOKENS[: 3 * C], token, *TOKENS[3 * C:]]
    rk = RequestKeys(ns().digest(), C)
    assert rk.update(tokens) == 3 and rk.unsaveable


def test_the_scheduler_declines_and_counts_requests_it_cannot_key() -> None:
    """Through OffloadScheduler.lookup / plan_saves: an extra key of 2**64 and a salt with a
    lone surrogate decline the load and skip the saves, counted once each; nothing raises."""
    geo = Geometry(C, (GroupGeometry(GroupKind.FULL, C, 4096),))
    cfg = KvtierConfig(dram_size="1MiB", chunk_tokens=C)
    sched = OffloadScheduler(cfg, geo, ns().digest(), make_slab_layout(cfg, geo, 1))
    sched.add_request("big-int", extra_keys=lambda s, e: ("lora", 2**64))
    sched.add_request("surrogate", cache_salt="tenant-\ud800")
    for req in ("big-int", "surrogate"):
        assert sched.lookup(req, TOKENS, 0) == 0
        assert sched.plan_saves(req, TOKENS, len(TOKENS), len(TOKENS)) == []
        assert sched.plan_saves(req, TOKENS, len(TOKENS), len(TOKENS)) == []
    assert sched.stats.declined[Decline.UNSAVEABLE.value] == 2
    assert sched.stats.unsaveable_requests == 2
    sched.add_request("plain")  # and the scheduler still keys and saves other requests
    sched.on_blocks("plain", [list(range(1, len(TOKENS) // C + 2))])
    assert len(sched.plan_saves("plain", TOKENS, len(TOKENS), len(TOKENS))) == len(TOKENS) // C


# --- incremental keying and its cost ------------------------------------------------------------

def test_keys_are_computed_incrementally(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = keys_mod.chunk_key

    def counting(parent: bytes, tokens: list[int], extra: bytes = b"") -> bytes:
        calls.append(len(tokens))
        return real(parent, tokens, extra)

    monkeypatch.setattr(keys_mod, "chunk_key", counting)
    rk = RequestKeys(ns().digest(), C)
    grown: list[int] = []
    for t in TOKENS:  # one token per step, like decode
        grown.append(t)
        rk.update(grown)
    assert len(calls) == len(TOKENS) // C  # each chunk hashed exactly once
    assert rk.keys == keys_of(TOKENS)  # and equal to keying the whole prompt at once
    # Prefill in uneven pieces, then decode: the same keys.
    rk2 = RequestKeys(ns().digest(), C)
    for end in (3, 40, 41, 100, len(TOKENS)):
        rk2.update(TOKENS[:end])
    assert rk2.keys == rk.keys


def test_key_cost_per_1k_tokens() -> None:
    chunk, n = 256, 65_536
    tokens = [random.Random(1).randrange(0, 150_000) for _ in range(n)]
    digest = ns(chunk_tokens=chunk).digest()
    best_prefill = best_decode = float("inf")
    for _ in range(3):
        rk = RequestKeys(digest, chunk, cache_salt="t")
        t0 = time.perf_counter()
        rk.update(tokens)
        best_prefill = min(best_prefill, time.perf_counter() - t0)
        rk = RequestKeys(digest, chunk, cache_salt="t")
        grown: list[int] = []  # vLLM's all_token_ids: one list, grown in place
        t0 = time.perf_counter()
        for t in tokens[:8192]:  # one update per decoded token
            grown.append(t)
            rk.update(grown)
        best_decode = min(best_decode, time.perf_counter() - t0)
    prefill_us = best_prefill / n * 1000 * 1e6
    decode_us = best_decode / 8192 * 1000 * 1e6
    msg = (f"kvtier key cost: {prefill_us:.1f} us per 1k tokens keyed at once (prefill), "
           f"{decode_us:.1f} us per 1k tokens one update per token (decode), chunk {chunk}")
    print(msg)
    warnings.warn(msg, UserWarning, stacklevel=1)
    assert prefill_us < 1000 and decode_us < 1000  # < 1 ms per 1k tokens
