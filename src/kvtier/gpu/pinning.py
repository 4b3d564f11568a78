"""Pinning the slab for CUDA: ``cudaHostRegister`` of host memory the DMA engines then copy
at full link speed (unpinned memory goes through a driver bounce buffer).

:class:`CudaPinner` is the :class:`kvtier.slab.Pinner` a worker whose KV cache is on a CUDA
device passes to :class:`kvtier.slab.HostSlab`; the slab decides the ranges (never splitting
a slot, see :func:`kvtier.slab.pin_ranges`), this module only talks to CUDA.
"""

from __future__ import annotations

import torch

from kvtier.slab import SlabError


class CudaPinner:
    """Registers and unregisters host ranges with the CUDA runtime of this process. Create
    it after the device is set (the registration is made for the current context)."""

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise SlabError("pinning asked for, but CUDA is not available")
        self._cudart = torch.cuda.cudart()

    def register(self, ptr: int, length: int) -> None:
        """Page-lock ``length`` bytes at ``ptr``; raises with the CUDA error code."""
        err = int(self._cudart.cudaHostRegister(ptr, length, 0))
        if err != 0:
            raise RuntimeError(f"cudaError {err}")

    def unregister(self, ptr: int) -> None:
        """Undo the registration that starts at ``ptr``."""
        self._cudart.cudaHostUnregister(ptr)
