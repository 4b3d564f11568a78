"""The fake model: what every KV position holds and which token comes next.

A position's KV bytes are a pure function of (token prefix, layer, rank): position ``p`` of a
sequence holds ``mix(h_p, layer, rank)`` where ``h_p`` chains every token up to and including
``p``. So anyone holding a request's tokens can recompute what any of its blocks must contain
(the oracle does, independently of kvtier), and any block written for another prefix, another
layer or another rank differs. The next token is a function of the last chain value, so the
whole output of a prompt is known in advance (multi-turn workloads use that).

Every position holds :data:`POS_BYTES` bytes per layer (one little-endian uint64).
"""

from __future__ import annotations

import numpy as np

MASK = (1 << 64) - 1
POS_BYTES = 8
SEED = 0x6B7674696572  # "kvtier"
VOCAB = 1000
FIRST_TOKEN = 10  # tokens below are never sampled (special ids)

_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB
_GOLD = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    z = (z ^ (z >> 30)) * _C1 & MASK
    z = (z ^ (z >> 27)) * _C2 & MASK
    return z ^ (z >> 31)


def extend_chain(chain: list[int], tokens: list[int] | tuple[int, ...]) -> list[int]:
    """Extend ``chain`` (chain values of ``tokens[:len(chain)]``) to cover all of ``tokens``."""
    h = chain[-1] if chain else SEED
    for t in tokens[len(chain):]:
        h = _mix64((h + (t + 1) * _GOLD) & MASK)
        chain.append(h)
    return chain


def chain_of(tokens: list[int] | tuple[int, ...]) -> list[int]:
    return extend_chain([], tokens)


def next_token(chain: list[int]) -> int:
    return FIRST_TOKEN + (chain[-1] >> 11) % (VOCAB - FIRST_TOKEN)


def generate(prompt: list[int], n: int) -> list[int]:
    """The ``n`` tokens the fake model produces after ``prompt`` (greedy, deterministic)."""
    chain = chain_of(prompt)
    out: list[int] = []
    toks = list(prompt)
    for _ in range(n):
        t = next_token(chain)
        out.append(t)
        toks.append(t)
        extend_chain(chain, toks)
    return out


def salt(layer: int, rank: int) -> np.uint64:
    return np.uint64((((layer + 1) * _GOLD) ^ ((rank + 1) * _C2) ^ 0x5A5A) & MASK)


def values(chain: np.ndarray, layer: int, rank: int) -> np.ndarray:
    """The uint64 each position holds (``chain``: uint64 array of chain values)."""
    with np.errstate(over="ignore"):
        z = chain ^ salt(layer, rank)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_C1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_C2)
        return z ^ (z >> np.uint64(31))


STATE_TENSORS = 2  # a mamba layer registers two state tensors (conv, ssm), 8 bytes a block each


def state_value(chain_value: int, layer: int, tensor: int, rank: int) -> np.int64:
    """The uint64 (as int64) state tensor ``tensor`` of state layer ``layer`` holds after the
    tokens whose last chain value is ``chain_value`` (:data:`SEED` for no tokens): distinct
    from every KV value of any layer, and from another tensor, layer or rank."""
    v = values(np.asarray([chain_value], dtype=np.uint64),
               1000 + layer * STATE_TENSORS + tensor, rank)
    return v.view(np.int64)[0]
