"""The local hit vLLM 0.25.1 tells a connector for a hybrid model, made safe
(docs/vllm-api.md §0 item 8; issue 13).

With any connector attached, 0.25.1 computes a mamba hybrid's local hit per group and tells
the connector the *longest* (``v1/core/sched/scheduler.py:687-715``): the attention groups
may hit ``L`` tokens while a state group holds no state after ``L`` tokens. The runner then
starts the recurrence at ``L`` from the state block ``(L - 1) // block_size`` of the state
group's table (``v1/worker/mamba_utils.py`` ``preprocess_mamba``), which is vLLM's null block
or a fresh one: silently wrong output, whatever the connector answers unless its load brings
a state.

The reverse holds too: a state group may hold the state after ``L`` tokens while an
attention group's cached blocks stop at ``A < L`` (another prompt's entries were evicted, or
dropped by kvtier as below); vLLM then takes ``L`` as computed for every group and the forward
reads attention blocks ``[A, L)`` that nobody computed, and a kvtier load (which starts at
``L``) does not bring them either.

What kvtier does (:func:`attention_hit_in_hbm`, :func:`state_boundary_in_hbm`,
:func:`forget_hits_beyond`, :func:`forget_states_beyond`):

- its hit goes past ``L`` to a chunk boundary whose state it stores: the load brings that
  state with the attention chunks (all or nothing per boundary): nothing else to do;
- otherwise it finds ``S``, the longest prefix (at most ``L``) after which every state group
  has its state in HBM, drops the attention groups' prefix-cache entries of this prompt's
  blocks in ``[S, L)`` from vLLM's block pool (``BlockPool.evict_blocks``: blocks in use stay
  with their requests, only their cache entries go) and defers the request (``None``); at
  the next step vLLM's hit is ``S`` for every group, where a state exists, and kvtier's hit
  (if any) starts from there. The cost is HBM prefix-cache entries that no state matches.
- where the attention groups' own hit ``A`` is below ``L``, ``S`` is looked for at most at
  ``A``, and the state groups' entries after ``S`` up to ``L`` are dropped as well, before any
  hit kvtier could offer (its load would start at ``L``): the request is deferred and vLLM's
  next hit is ``S`` for every group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvtier.layout import GroupKind
from kvtier.vllm.groups import EngineGroups

MAX_DUPLICATES = 64
"""Cached copies of one block hash dropped at most (vLLM keeps duplicates; a bound, never a
loop without end)."""


def _hash_at(block_hashes: Sequence[Any], hash_block_size: int, tokens: int) -> Any:
    """The chained block hash of the prompt's first ``tokens`` tokens (a multiple of
    ``hash_block_size``): each hash covers its whole prefix."""
    return block_hashes[tokens // hash_block_size - 1]


def _groups_of(groups: EngineGroups, state: bool) -> list[tuple[int, int]]:
    return [(e, s.block_size) for e, s in zip(groups.engine_ids, groups.specs)
            if (s.kind is GroupKind.STATE) == state]


def state_boundary_in_hbm(pool: Any, block_hashes: Sequence[Any], groups: EngineGroups,
                          local_hit: int) -> int:
    """The longest prefix of at most ``local_hit`` tokens after which every state group's
    state is cached in ``pool`` (0: none; ``local_hit`` where the model has no state group)."""
    state = _groups_of(groups, state=True)
    if not state or local_hit <= 0:
        return local_hit
    hbs = int(pool.hash_block_size)
    step = math.lcm(hbs, *(bs for _, bs in state))
    tokens = min(local_hit, len(block_hashes) * hbs) // step * step
    while tokens > 0:
        h = _hash_at(block_hashes, hbs, tokens)
        if all(pool.get_cached_block(h, [e]) for e, _ in state):
            return tokens
        tokens -= step
    return 0


def attention_hit_in_hbm(pool: Any, block_hashes: Sequence[Any], groups: EngineGroups,
                         local_hit: int) -> int:
    """The longest prefix of at most ``local_hit`` tokens whose blocks every full-attention
    group has cached in ``pool``, from the first (``local_hit`` where there is none)."""
    hbs = int(pool.hash_block_size)
    hit = local_hit
    for engine_id, bs in _groups_of(groups, state=False):
        if groups.specs[groups.engine_ids.index(engine_id)].kind is not GroupKind.FULL:
            continue  # a window group's hit is its window's, not a prefix
        n = 0
        while (n + 1) * bs <= hit and pool.get_cached_block(
                _hash_at(block_hashes, hbs, (n + 1) * bs), [engine_id]):
            n += 1
        hit = min(hit, n * bs)
    return hit


def forget_states_beyond(pool: Any, block_hashes: Sequence[Any], groups: EngineGroups,
                         start: int, end: int) -> int:
    """Drop the prefix-cache entries of the state groups' states of this prompt after more
    than ``start`` and at most ``end`` tokens; returns how many were dropped."""
    return _forget(pool, block_hashes, groups, start, end, state=True)


def forget_hits_beyond(pool: Any, block_hashes: Sequence[Any], groups: EngineGroups,
                       start: int, end: int) -> int:
    """Drop the prefix-cache entries of the attention groups' blocks of this prompt covering
    tokens ``[start, end)``; returns how many were dropped."""
    return _forget(pool, block_hashes, groups, start, end, state=False)


def _forget(pool: Any, block_hashes: Sequence[Any], groups: EngineGroups, start: int, end: int,
            state: bool) -> int:
    """Evict the cached blocks ``start // bs .. end // bs - 1`` of the state (or attention)
    groups; block ``j`` ends at token ``(j + 1) * bs`` (for a state group: the state after
    it)."""
    hbs = int(pool.hash_block_size)
    dropped = 0
    for engine_id, bs in _groups_of(groups, state=state):
        for j in range(start // bs, end // bs):
            h = _hash_at(block_hashes, hbs, (j + 1) * bs)
            for _ in range(MAX_DUPLICATES):
                cached = pool.get_cached_block(h, [engine_id])
                if not cached:
                    break
                pool.evict_blocks({cached[0].block_id})
                dropped += 1
    return dropped
