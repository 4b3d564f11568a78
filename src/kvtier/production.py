"""Chunks that running requests are putting into HBM: by computing their prompt, or by loading
it from kvtier.

Cache-aware admission (:mod:`kvtier.deferral`) asks, for a waiting request, whether the chunk
right after its HBM hit is one of these: then the request waits for that chunk to land in
vLLM's prefix cache (a longer local hit next step) instead of computing or loading the same
chunk a second time into blocks of its own. vLLM shares what another request computes in the
same step (blocks are cached when they are allocated), but not what it computes in later steps
of a chunked prefill, nor what a parked request is loading (its blocks are cached only once the
load lands).

Contract:
- :meth:`produce` registers a request's chunk keys once (a request already registered keeps
  its keys: chunks it has since put into HBM stay listed, harmless, since they are in the
  prefix cache and a waiting request's hit covers them); :meth:`stop` drops them (prefill
  done, preempted, finished); both are idempotent;
- :meth:`producer` names a request producing ``key``, or None; with several, any of them;
- memory is bounded by the keys of the requests registered now (one entry per key and
  request).
"""

from __future__ import annotations

from collections.abc import Sequence


class ChunkProducers:
    def __init__(self) -> None:
        self._by_key: dict[bytes, set[str]] = {}
        self._keys_of: dict[str, list[bytes]] = {}

    def produce(self, req_id: str, keys: Sequence[bytes]) -> None:
        """``req_id`` is computing or loading the chunks ``keys`` into HBM."""
        if req_id in self._keys_of or not keys:
            return
        self._keys_of[req_id] = list(keys)
        for k in keys:
            self._by_key.setdefault(k, set()).add(req_id)

    def stop(self, req_id: str) -> None:
        """``req_id`` puts nothing more into HBM (its prefill is done, or it left)."""
        for k in self._keys_of.pop(req_id, ()):
            ids = self._by_key.get(k)
            if ids is not None:
                ids.discard(req_id)
                if not ids:
                    del self._by_key[k]

    def producer(self, key: bytes) -> str | None:
        ids = self._by_key.get(key)
        return next(iter(ids)) if ids else None

    def producing(self, req_id: str) -> bool:
        return req_id in self._keys_of

    def __len__(self) -> int:
        """Requests registered now."""
        return len(self._keys_of)
