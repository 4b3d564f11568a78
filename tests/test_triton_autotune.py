"""kvtier.testing.triton_autotune: the GPU tools' smaller, deterministic autotune search."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from kvtier.testing.triton_autotune import limit_autotune, pick  # noqa: E402


def _configs() -> list:
    return [triton.Config({"BK": bk, "BV": bv}, num_warps=w, num_stages=s)
            for bk in (32, 64) for bv in (32, 64, 128) for w in (2, 4, 8) for s in (2, 3, 4)]


def test_one_config_is_the_fewest_stages_warps_nearest_four_smallest_tiles() -> None:
    (c,) = pick(_configs(), 1)
    assert (c.num_stages, c.num_warps, c.kwargs) == (2, 4, {"BK": 32, "BV": 32})
    assert pick(list(reversed(_configs())), 1)[0].kwargs == c.kwargs  # order does not matter


def test_several_are_spread_over_the_list_first_and_last_included() -> None:
    cs = _configs()
    got = pick(cs, 4)
    assert len(got) == 4 and got[0] is cs[0] and got[-1] is cs[-1]
    assert pick(cs[:3], 4) == cs[:3] and pick(cs, 0) == cs


def test_limit_autotune_shrinks_what_the_decorator_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton, "autotune", triton.autotune)  # undone after the test
    monkeypatch.setenv("GPU_TOOLS_AUTOTUNE_KEEP", "0")  # restored after the test
    assert limit_autotune(0) == 0
    assert limit_autotune(1) == 1 and limit_autotune(1) == 1  # twice wraps once

    @triton.autotune(configs=_configs(), key=["n"])
    @triton.jit
    def kernel(x, n, BK: triton.language.constexpr, BV: triton.language.constexpr):
        pass

    assert len(kernel.configs) == 1 and kernel.configs[0].kwargs == {"BK": 32, "BV": 32}
