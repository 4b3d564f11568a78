"""``kvtier bench transfer``: the GPU data path against the host link.

For every layout family and chunk size, through :class:`kvtier.gpu.engine.CudaTransferEngine`
as the worker drives it (saves queued per step and flushed by ``poll``; loads of 16 MiB
jobs after ``tick``), on its ``dma`` and its ``kernel`` path::

    GB/s = bytes moved / wall time from the first enqueue to the last completion

over at least ``--gib`` GiB of randomly scattered block ids (host work, gather and bookkeeping
included), for saves alone, loads alone and both at once; then the same while a bf16
8192x8192x8192 GEMM loops on the default stream, with the GEMM's slowdown. Next to them, in
the same run: the pinned-memcpy ceiling (median of ``--reps`` 1 GiB copies each way and both
ways at once) and the naive path (one ``copy_`` per piece). Every measured transfer is
spot-checked against the reference codec. Writes a table (stdout and ``.md``), JSON and a PNG
under ``--out``.

Layout families (a chunk of target size C; where one block of the model is larger than C, the
cache is one rank's shard: KV heads split as by tensor parallelism, then layers as by a
pipeline stage; the actual chunk bytes are reported):

- ``mha``: Llama-3.1-8B (32 layers, 8 KV heads of 128, bf16, block 16), FlashAttention's
  ``(nb, 2, 16, heads, 128)`` per layer;
- ``mla_bf16`` / ``mla_fp8``: DeepSeek-V3 latent cache (61 layers), FlashMLA's
  ``(nb, 64, 576)`` bf16 or fp8 (uint8) rows, block 64;
- ``kv_fp8_scales``: Llama-3.1-8B shape, split K/V fp8 ``(2, nb, 16, heads, 128)`` (ROCm
  backends) with per-token-per-head float32 ``k_scale``/``v_scale`` ``(nb, 16, heads)`` on
  the layer;
- ``indexer``: the DeepSeek-V3.2 indexer cache alone, ``(nb, 64, 132)`` uint8 (61 layers);
- ``hybrid``: 4 attention layers ``(nb, 2, 16, 8, 128)`` bf16 plus a recurrent-state group of
  24 mamba2 layers (conv ``(3, 4352)`` + ssm ``(64, 64, 128)`` bf16 per layer, 24.6 MiB per
  state object); one state object per 16 MiB of KV. One block count serves both groups (as
  in vLLM), so its attention cache is small and blocks repeat across chunks.

Registered layouts (:mod:`~.registered`), each once at kvtier's own chunk for it: the caches
vLLM 0.25.1 registers on the H200 for Kimi-Linear, DeepSeek-V3.2 (MLA + indexer), GLM-5
(``fp8_ds_mla`` + indexer), MiniMax-M3 (dense, block-compact sparse and index caches) and
DeepSeek-V3 with its MTP draft layer, at their real layer counts. ``--kernel-streams`` sets the
engine's kernel streams per direction (1: one stream, the engine before two).

Needs CUDA, except ``--smoke`` (tiny sizes on CPU tensors through the test host runtime,
:mod:`kvtier.testing.host_runtime`, and ``TRITON_INTERPRET=1``; checks the code, not the
speed).

Modules: :mod:`~.cases` (families, cells and their jobs), :mod:`~.timing` (driving the engine
as the worker does, spot checks), :mod:`~.gemm` (runs under a GEMM), :mod:`~.baselines`
(ceiling, raw probes, naive path), :mod:`~.report` (targets, table, JSON, PNG),
:mod:`~.pools` (the host memory: ``--host-pool pinned|slab|store``),
:mod:`~.runner` (the run). This module is what :mod:`kvtier.bench` registers; it stays light
(no torch) because the CLI imports it to build its parser.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from kvtier.bench.transfer.cases import FAMILIES, REGISTERED_LAYOUTS
from kvtier.bench.transfer.pools import POOLS

HELP = "GPU<->host KV transfer GB/s per layout and chunk size, vs the pinned-memcpy ceiling"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="bench/results", help="folder for JSON, PNG and table")
    p.add_argument("--families", default=",".join(FAMILIES),
                   help=f"comma-separated subset of {','.join(FAMILIES)}, or a registered "
                        f"layout at its own chunk: {','.join(REGISTERED_LAYOUTS)}")
    p.add_argument("--chunks", default="256KiB,2MiB,8MiB", help="chunk sizes")
    p.add_argument("--modes", default="dma,kernel", help="engine paths to measure")
    p.add_argument("--gib", type=float, default=1.0, help="GiB moved per measurement")
    p.add_argument("--reps", type=int, default=5, help="1 GiB copies per ceiling")
    p.add_argument("--no-gemm", action="store_true", help="skip the runs under a GEMM")
    p.add_argument("--dma-min-piece", default=None,
                   help="the auto path's threshold to report (default: the engine's)")
    p.add_argument("--kernel-streams", type=int, default=None,
                   help="kernel streams per direction (default: the engine's, "
                        "kvtier.gpu.engine.KERNEL_STREAMS; 1 = one stream, as before)")
    p.add_argument("--sweep", action="store_true",
                   help="the kernel path's width/grid/batch sweep, saves and loads under the "
                        "GEMM, on every cell (default: the indexer 2 MiB cell only)")
    p.add_argument("--verify", action="store_true",
                   help="checksums at save and verified at load, as verify_checksums does")
    p.add_argument("--host-pool", default="pinned", choices=POOLS,
                   help="the host memory copied into: pinned (cudaHostAlloc), slab (an "
                   "engine's in-process pool: registered), store (a private kvtier store's "
                   "shared pool, attached and registered as a worker does)")
    p.add_argument("--tag", default="", help="extra text in the output file names")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes on CPU (host runtime, TRITON_INTERPRET=1): checks the code")


def run(args: argparse.Namespace) -> int:
    """The whole bench (:func:`kvtier.bench.transfer.runner.run`); the exit code."""
    from kvtier.bench.transfer.runner import run as run_bench

    return run_bench(args)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=HELP)
    add_arguments(p)
    return run(p.parse_args(argv))
