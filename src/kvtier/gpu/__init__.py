"""The GPU data path (CUDA streams, events, batched copies). Imported only where CUDA is."""
