"""The node-wide store (issue 18): one process per host owns the DRAM pool (shared memory)
and the index; engines attach over a Unix socket and copy straight into the pool.

Modules, one concept each: :mod:`~kvtier.store.framing` (msgpack frames and descriptor
passing on the socket), :mod:`~kvtier.store.pool` (the shared-memory pool and its arenas),
:mod:`~kvtier.store.leases` (time-limited lookup leases and hard load pins, per client),
:mod:`~kvtier.store.server` (the store process), :mod:`~kvtier.store.client` (an engine's
connection), :mod:`~kvtier.store.index` (the :class:`~kvtier.index.base.Index` an engine's
scheduler uses over that connection). No vLLM, no CUDA.
"""
