"""Chunk keys: a prefix-chained blake2b hash under a namespace.

``key(i) = H(key(i-1) || n || tokens of chunk i || len || extra keys of chunk i)`` with
``key(-1)`` the namespace digest, which covers the model identity and weight revision, the
layout fingerprint, the KV dtype string and fixed scales, the chunk size and the codec
version; ``n`` (the token count) and ``len`` (the extra keys' byte length) make the input
unambiguous. The per-request ``cache_salt`` enters chunk 0's extra keys as
``[salt, extra]`` (every chunk with extra keys or a salt is encoded as such a pair, so a salt
can never be mimicked by extra keys), and tenants never share chunks.
The TP/PP rank is not part of a key: it is a sub-address of where a rank's shard lives.

With speculative decoding by EAGLE/MTP drafts, the stored bytes of a chunk's last position
depend on the token *after* the chunk: a draft layer's KV at position ``p`` is computed from
the target's hidden state at ``p`` and the embedding of token ``p + 1``. Such an engine keys
each chunk with that one ``lookahead`` token too (``tokens of chunk i`` is then
``tokens[i*c : (i+1)*c + 1]``), so a stored chunk is found only by a request that continues
it with the same token; a chunk is keyable once that token is known.

Keys are stable across processes and restarts: no ``hash()``, no per-process seed.
Extra keys (vLLM's per-block extra keys: multimodal hashes, LoRA, prompt embeddings) must be
made of None, bool, int, float, str, bytes and tuples/lists of those, with ints in
[-2**63, 2**64) and strings (the salt too) encodable as UTF-8; token ids must lie in
[0, 2**32). Anything else makes the request *unsaveable*: it is neither saved nor loaded, and
the caller counts it. Keying never raises for what a request carries.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import msgpack

from kvtier.layout import CODEC_VERSION

KEY_BYTES = 16

ExtraKeysFn = Callable[[int, int], object]
"""Extra keys for the token range [start, end) of a request; return UNSUPPORTED if unknown."""


class _Unsupported:
    def __repr__(self) -> str:
        return "UNSUPPORTED"


UNSUPPORTED = _Unsupported()


def _hash(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for p in parts:
        h.update(p)
    return h.digest()


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for stored bytes to be valid for an engine."""

    model: str
    layout_fingerprint: str
    kv_cache_dtype: str
    chunk_tokens: int
    model_revision: str = ""
    fixed_scales: Mapping[str, float] = field(default_factory=dict)
    tp_size: int = 1
    extra: str = ""
    codec_version: int = CODEC_VERSION

    def digest(self) -> bytes:
        desc = [
            "kvtier-ns-v1",
            self.model,
            self.model_revision,
            self.layout_fingerprint,
            self.kv_cache_dtype,
            sorted((k, float(v)) for k, v in self.fixed_scales.items()),
            self.chunk_tokens,
            self.tp_size,
            self.extra,
            self.codec_version,
        ]
        return _hash(msgpack.packb(desc, use_bin_type=True))


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    a = array("I", tokens)  # 4-byte unsigned on every supported platform
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


_PLAIN = (type(None), bool, int, float, str, bytes)


def _plain_ok(x: object) -> bool:
    if isinstance(x, _PLAIN):
        return True
    if isinstance(x, (tuple, list)):
        return all(_plain_ok(v) for v in x)
    return False


def encode_extra(extra: object, salt: str | None = None) -> bytes | None:
    """Deterministic bytes for one chunk's extra keys (and the request's salt, for chunk 0),
    or None if they hold something we cannot encode."""
    if extra is UNSUPPORTED:
        return None
    empty = extra is None or (isinstance(extra, (tuple, list)) and len(extra) == 0)
    if empty and not salt:
        return b""
    try:
        if not _plain_ok(extra):
            return None
        return msgpack.packb([salt or None, None if empty else extra], use_bin_type=True)
    except (OverflowError, UnicodeEncodeError, ValueError, RecursionError):
        # an int outside msgpack's 64-bit range, a str with a lone surrogate (not UTF-8),
        # absurd nesting: not encodable, so not keyable
        return None


def chunk_key(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """One link of the chain. ``tokens`` are ints in [0, 2**32)."""
    return _hash(parent, len(tokens).to_bytes(4, "little"), _tokens_bytes(tokens),
                 len(extra).to_bytes(4, "little"), extra)


class RequestKeys:
    """The chunk keys of one request, extended incrementally as its tokens grow.

    ``update(tokens)`` hashes only chunks that became full since the last call; the whole
    prompt is never rehashed. Once extra keys cannot be encoded the request is marked
    unsaveable and no further keys are produced. ``lookahead`` tokens after each chunk are
    part of its key (see the module docstring); the extra keys stay the chunk's own.
    """

    def __init__(
        self,
        namespace: bytes,
        chunk_tokens: int,
        cache_salt: str | None = None,
        extra_keys: ExtraKeysFn | None = None,
        lookahead: int = 0,
    ) -> None:
        if chunk_tokens <= 0:
            raise ValueError("chunk_tokens must be positive")
        if lookahead < 0:
            raise ValueError("lookahead must not be negative")
        self.namespace = namespace
        self.chunk_tokens = chunk_tokens
        self.cache_salt = cache_salt
        self.extra_keys = extra_keys
        self.lookahead = lookahead
        self.keys: list[bytes] = []
        self.unsaveable = False

    @property
    def num_chunks(self) -> int:
        return len(self.keys)

    def update(self, tokens: Sequence[int]) -> int:
        """Hash the newly full chunks of ``tokens`` (the request's tokens so far).

        Returns the number of full chunks keyed. ``tokens`` must extend what was seen before.
        """
        c, ahead = self.chunk_tokens, self.lookahead
        n = len(tokens)
        if n < (len(self.keys) + 1) * c + ahead or self.unsaveable:
            return len(self.keys)  # the common decode step: no chunk became full
        target = (n - ahead) // c
        while not self.unsaveable and len(self.keys) < target:
            i = len(self.keys)
            start, end = i * c, (i + 1) * c
            extra_obj: object = self.extra_keys(start, end) if self.extra_keys else None
            extra = encode_extra(extra_obj, self.cache_salt if i == 0 else None)
            if extra is None:
                self.unsaveable = True
                break
            parent = self.keys[-1] if self.keys else self.namespace
            try:
                self.keys.append(chunk_key(parent, tokens[start:end + ahead], extra))
            except (OverflowError, TypeError):  # a token id that is not a uint32
                self.unsaveable = True
        return len(self.keys)
