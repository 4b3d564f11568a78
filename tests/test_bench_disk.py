"""``kvtier bench disk`` on a real directory (small sizes): it measures the tier and dd in
alternating pairs and writes its table, JSON and PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier import cli
from kvtier.bench.disk import DeviceRequests


def test_bench_disk_writes_pairs_medians_and_the_rebuild(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    out = tmp_path / "out"
    rc = cli.main(["bench", "disk", str(tmp_path), "--chunk-mib", "0.25", "--total-mib", "2",
                   "--pairs", "2", "--rebuild", "200", "--out", str(out)])
    assert rc in (0, None)
    result = json.loads((out / "disk.json").read_text())
    assert (out / "disk.png").stat().st_size > 0
    on_a_device = DeviceRequests(tmp_path)._stat is not None
    for k in ("tier_write", "tier_read", "dd_write", "dd_read"):
        g = result["gbps"][k]
        assert len(g["passes"]) == 2 and g["min"] <= g["median"] <= g["max"] and g["min"] > 0
        # the device's mean request size per pass (what says whether a dd pass was a fair
        # ceiling); none off a block device
        assert len(g["request_kib"]) == (2 if on_a_device else 0)
        assert all(kib > 0 for kib in g["request_kib"])
    assert set(result["tier_vs_dd"]) == {"write", "read"}
    for d in ("write", "read"):  # each pair's ratio, and over the pairs whose dd moved whole chunks
        pp = result["tier_vs_dd_per_pair"][d]
        tier, dd = result["gbps"][f"tier_{d}"], result["gbps"][f"dd_{d}"]
        assert pp["ratios"] == pytest.approx([t / x for t, x in zip(tier["passes"], dd["passes"])])
        assert pp["all"]["min"] <= pp["all"]["median"] <= pp["all"]["max"]
        if on_a_device:
            whole = [r for r, kib in zip(pp["ratios"], dd["request_kib"]) if kib >= 0.95 * 256]
            assert pp["whole_pairs"] == len(whole)
            assert (pp["whole"] is None) == (not whole)
    assert len(result["tier_write_fsync_ms"]) == 2  # the write passes' fsync, timed apart
    assert all(ms >= 0 for ms in result["tier_write_fsync_ms"])
    assert result["rebuild"]["chunks"] == 200
    printed = capsys.readouterr().out
    assert "tier/dd read" in printed and "rebuild of 200 chunks" in printed
    assert not (tmp_path / "kvtier-bench").exists()
