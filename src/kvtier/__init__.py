"""kvtier: a KV-cache offload tier for vLLM (host DRAM behind the GPU prefix cache).

This package's top level stays import-light (no torch, no vLLM, no third-party import): the
version is read from here by the build (pyproject's dynamic version) and by ``kvtier
--version``, which must work even where the dependencies are broken.
"""

__version__ = "0.1.0"
