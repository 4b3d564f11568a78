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
    it after the device is set: the registration is made for that device's context, on any
    thread (a store's new pool is pinned off the step path, on a thread whose current device
    would otherwise be device 0, whose context is not the one the worker's copies run in)."""

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise SlabError("pinning asked for, but CUDA is not available")
        self._cudart = torch.cuda.cudart()
        self.device = torch.cuda.current_device()

    def register(self, ptr: int, length: int) -> None:
        """Page-lock ``length`` bytes at ``ptr``; raises with the CUDA error code."""
        with torch.cuda.device(self.device):
            err = int(self._cudart.cudaHostRegister(ptr, length, 0))
        if err != 0:
            raise RuntimeError(f"cudaError {err}")

    def unregister(self, ptr: int) -> None:
        """Undo the registration that starts at ``ptr``."""
        with torch.cuda.device(self.device):
            self._cudart.cudaHostUnregister(ptr)
