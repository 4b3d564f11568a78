"""``kvtier.testing.restore.sharpen_worker_weights`` keeps MiniMax-M3's fp8 K/V in range: its
K and V are cast to float8_e4m3fn with scale 1 (0.25.1's fused insert and Triton attend take
no scale), a format without infinities (a conversion that does not saturate gives NaN beyond
448), so the sharpened weights must bound them whatever the residual stream holds. Both come right after a Gemma RMSNorm (weight w, output
``x / rms(x) * (1 + w)``; sharpened w = 1, so the output's norm is 2 * sqrt(dim)): V is one
linear map of the layer's input norm, so by Cauchy-Schwarz |v_j| <= 2 sqrt(6144) * ||W_j||
<= 2 sqrt(6144) = 156.8 (each of the 6,144 weights at most 1/sqrt(6144)); K is normed per
head, |k_i| <= 2 sqrt(128) = 22.6. The NaN M3 showed on the H200 was not an fp8 overflow
(tests/test_vllm_fixes.py has its cause)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtier.testing.restore import sharpen_worker_weights

torch = pytest.importorskip("torch")

HIDDEN, KV_HEADS, HEAD_DIM = 6144, 4, 128  # kvtier.testing.seed_models.minimax_m3
FP8_MAX = 448.0


def gemma_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight)


def test_sharpened_m3_k_and_v_stay_inside_fp8_e4m3() -> None:
    layer = torch.nn.Module()
    layer.input_norm = torch.nn.Parameter(torch.zeros(HIDDEN))
    layer.kv_proj = torch.nn.Linear(HIDDEN, 2 * KV_HEADS * HEAD_DIM, bias=False)
    layer.k_norm = torch.nn.Parameter(torch.zeros(HEAD_DIM))
    sharpen_worker_weights(SimpleNamespace(model_runner=SimpleNamespace(model=layer)))
    w = layer.kv_proj.weight.detach()
    # the worst case over every input: x parallel to a row of W
    worst_v = (2 * HIDDEN ** 0.5 * w.norm(dim=1)).max().item()
    assert worst_v < 2 * HIDDEN ** 0.5 + 1e-3 < FP8_MAX
    gen = torch.Generator().manual_seed(0)
    residual = torch.randn(256, HIDDEN, generator=gen)
    residual[:, :8] *= 1e4  # a residual stream with outlier channels
    x = gemma_rmsnorm(residual, layer.input_norm.detach())
    k, v = (x @ w.T).view(256, 2, KV_HEADS, HEAD_DIM).unbind(1)
    k = gemma_rmsnorm(k, layer.k_norm.detach())
    assert k.abs().max().item() <= 2 * HEAD_DIM ** 0.5 + 1e-3
    for t in (k, v):
        cast = t.to(torch.float8_e4m3fn).float()
        assert torch.isfinite(cast).all() and cast.abs().max().item() <= FP8_MAX
