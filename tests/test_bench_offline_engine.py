"""``kvtier bench offline``'s engine arguments: every kvtier-family run (kvtier, null-copy,
layerwise) starts its planner from the measured host link, so that null-copy, which moves no
bytes and never learns the link, decides load-or-recompute as the run it is the floor of."""

from __future__ import annotations

import argparse
import pathlib

from kvtier.bench import offline_engine


def _args(tmp_path: pathlib.Path, config: str, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--config", choices=offline_engine.CONFIGS, required=True)
    offline_engine.add_workload_arguments(p)
    return p.parse_args(["--config", config, "--shape", "tiny", "--model-root",
                         str(tmp_path), *extra])


def _extra(kw: dict[str, object]) -> dict[str, object]:
    return dict(kw["kv_transfer_config"].kv_connector_extra_config)  # type: ignore[attr-defined]


def test_kvtier_family_runs_start_from_the_measured_link(tmp_path: pathlib.Path) -> None:
    for config in ("kvtier", "kvtier-null-copy", "kvtier-layerwise"):
        extra = _extra(offline_engine.engine_args(_args(tmp_path, config), 52.34))
        assert extra["link_gbps"] == 52.3, config
    # a setting given on the command line wins; no measurement (no CUDA): the default
    kw = offline_engine.engine_args(
        _args(tmp_path, "kvtier-null-copy", "--kvtier-set", "link_gbps=30"), 52.34)
    assert _extra(kw)["link_gbps"] == 30
    assert "link_gbps" not in _extra(offline_engine.engine_args(_args(tmp_path, "kvtier")))
    native = offline_engine.engine_args(_args(tmp_path, "native"), 52.34)
    assert "kv_transfer_config" not in native and native["kv_offloading_size"] > 0


def test_the_link_is_measured_only_where_there_is_a_cuda_device() -> None:
    import torch

    got = offline_engine.measured_link_gbps(nbytes=1 << 20, reps=1)
    assert (got is None) == (not torch.cuda.is_available())
    if got is not None:
        assert got > 0
