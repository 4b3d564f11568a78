"""tools/gpu_bare_run.py, the parts that run without a GPU: the engine arguments it passes
(copied, sized for a shared GPU), its JSON results (never half-written, never lost to an
object JSON cannot hold), the ``--all`` driver's summary, the 0.25.1 fp8_ds_mla spec fix, and
the DeepGEMM header file set that travels beside the gpu-kit."""

from __future__ import annotations

import ast
import json
import pathlib
import shutil
import tarfile
import zipfile
from types import ModuleType
from typing import Any

import pytest

from _tools import load_tool
from kvtier.testing.seed_models import SEED_MODELS

ROOT = pathlib.Path(__file__).resolve().parents[1]
VLLM025 = ROOT / ".cache" / "vllm-0.25.1" / "vllm"
WHEEL025 = ROOT / ".cache" / "wheels" / "vllm-0.25.1-cp38-abi3-manylinux_2_28_x86_64.whl"
RESULTS = ROOT / "bench" / "results" / "2026-12-01-bare-gpu-h200-vllm025"


def _tool() -> ModuleType:
    return load_tool("gpu_bare_run")


tool = _tool()


def _args(tmp_path: pathlib.Path, *extra: str) -> Any:
    return tool.parse_args(["--arch", "deepseek_v3_mtp", "--out", str(tmp_path), *extra])


def test_engine_args_are_a_copy_vllm_may_edit(tmp_path: pathlib.Path) -> None:
    declared = json.dumps(SEED_MODELS["deepseek_v3_mtp"].engine_args, sort_keys=True)
    kw = tool.engine_kwargs(_args(tmp_path), "deepseek_v3_mtp", str(tmp_path))
    kw["speculative_config"]["target_model_config"] = object()  # what vLLM 0.25.1 does
    assert json.dumps(SEED_MODELS["deepseek_v3_mtp"].engine_args, sort_keys=True) == declared
    again = tool.engine_kwargs(_args(tmp_path), "deepseek_v3_mtp", str(tmp_path))
    assert "target_model_config" not in again["speculative_config"]


def test_every_run_caps_max_num_seqs(tmp_path: pathlib.Path) -> None:
    for name in SEED_MODELS:
        assert tool.engine_kwargs(_args(tmp_path), name, str(tmp_path))["max_num_seqs"] == 128
    kw = tool.engine_kwargs(_args(tmp_path, "--max-num-seqs", "64"), "kimi_linear", "m")
    assert kw["max_num_seqs"] == 64
    assert "--max-num-seqs" in tool.child_argv(_args(tmp_path), "kimi_linear")


def test_a_config_object_in_a_result_is_written_as_its_repr(tmp_path: pathlib.Path) -> None:
    class ModelConfig:
        def __repr__(self) -> str:
            return "ModelConfig(model='m')"

    path = tmp_path / "r.json"
    tool.write_json(str(path), {"engine_args": {"speculative_config": {
        "method": "mtp", "target_model_config": ModelConfig()}}})
    spec = json.loads(path.read_text())["engine_args"]["speculative_config"]
    assert spec == {"method": "mtp", "target_model_config": "ModelConfig(model='m')"}
    assert not (tmp_path / "r.json.tmp").exists()


def test_a_truncated_child_json_is_a_failed_result(tmp_path: pathlib.Path) -> None:
    # the file the first --all run left for deepseek_v3_mtp (json.dump raised half-way)
    path, log = tmp_path / "deepseek_v3_mtp.json", tmp_path / "deepseek_v3_mtp.log"
    shutil.copy(RESULTS / "deepseek_v3_mtp.json", path)
    log.write_text("engine log\n")
    result = tool.read_child_result("deepseek_v3_mtp", str(path), str(log), 1)
    assert result["ok"] is False and result["arch"] == "deepseek_v3_mtp"
    assert result["error"].startswith("unreadable result JSON (1): JSONDecodeError")
    assert '"target_model_config": ' in result["json_tail"]
    assert result["log_tail"] == "engine log\n"
    assert not path.exists() and (tmp_path / "deepseek_v3_mtp.json.unreadable").exists()


@pytest.mark.parametrize("content,why", [("[1, 2]", "a JSON list, not an object"),
                                         ("", "Expecting value")])
def test_a_child_json_that_is_no_object_is_a_failed_result(tmp_path: pathlib.Path,
                                                           content: str, why: str) -> None:
    (tmp_path / "a.json").write_text(content)
    (tmp_path / "a.log").write_text("")
    result = tool.read_child_result("a", str(tmp_path / "a.json"), str(tmp_path / "a.log"), 0)
    assert result["ok"] is False and why in result["error"]


def test_all_writes_the_summary_from_real_children(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "bare"
    assert tool.main(["--all", "--write-only", "--only", "kimi_linear,qwen3_next",
                      "--out", str(out), "--model-root", str(tmp_path / "models")]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(summary) == ["kimi_linear", "qwen3_next"]
    child = json.loads((out / "qwen3_next.json").read_text())
    assert child["write_only"] is True and child["wall_s"] == summary["qwen3_next"]["wall_s"]
    assert child["seed_engine_args"] == {"gdn_prefill_backend": "triton"}


def test_the_mla_spec_fix_sets_the_quant_mode_and_nothing_else() -> None:
    torch = pytest.importorskip("torch")
    kv = pytest.importorskip("vllm.v1.kv_cache_interface")
    ds_mla = kv.MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576,
                                 dtype=torch.uint8, cache_dtype_str="fp8_ds_mla")
    assert ds_mla.kv_quant_mode == kv.KVQuantMode.NONE  # as 0.25.1 builds it
    fixed = tool.with_quant_mode(ds_mla)
    assert fixed.kv_quant_mode == kv.KVQuantMode.FP8_PER_TENSOR
    assert fixed.page_size_bytes == ds_mla.page_size_bytes
    assert {**vars(fixed), "kv_quant_mode": None} == {**vars(ds_mla), "kv_quant_mode": None}
    bf16 = kv.MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576,
                               dtype=torch.bfloat16, cache_dtype_str="auto")
    assert tool.with_quant_mode(bf16) is bf16
    full = kv.FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.uint8)
    assert tool.with_quant_mode(full) is full
    assert tool.apply_vllm_fixes() == []  # 0.32 here: its spec sets the mode itself


def _function(path: pathlib.Path, cls: str, name: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text())
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name)


@pytest.mark.skipif(not VLLM025.is_dir(), reason="vLLM 0.25.1 sources not unpacked in .cache")
def test_vllm025_mla_spec_lacks_the_quant_mode_the_runner_reshapes_by() -> None:
    """Why the fix exists: 0.25.1 builds the MLA spec without kv_quant_mode, and its runner
    reshapes a NONE-mode spec with cache_dtype_str "auto" (576 elements, not 656 bytes)."""
    spec_fn = _function(VLLM025 / "model_executor/layers/attention/mla_attention.py",
                        "MLAAttention", "get_kv_cache_spec")
    keywords = {k.arg for n in ast.walk(spec_fn) if isinstance(n, ast.Call) for k in n.keywords}
    assert "cache_dtype_str" in keywords and "kv_quant_mode" not in keywords
    runner = (VLLM025 / "v1/worker/gpu_model_runner.py").read_text()
    assert '"auto"\n                        if kv_cache_spec.kv_quant_mode == KVQuantMode.NONE' \
        in runner


@pytest.mark.skipif(not WHEEL025.is_file(), reason="vLLM 0.25.1 wheel not in .cache/wheels")
def test_deepgemm_headers_pack_install_and_check(tmp_path: pathlib.Path) -> None:
    packed = tool.pack_deepgemm_include(str(WHEEL025), str(tmp_path / "dg"))
    with tarfile.open(packed["path"]) as tar:
        names = tar.getnames()
        assert all(n.startswith(tool.DEEPGEMM_INCLUDE) for n in names)
        assert tool.DEEPGEMM_PROBE in names and len(names) == packed["files"]
        site = tmp_path / "site"
        tar.extractall(site, filter="data")
    with zipfile.ZipFile(WHEEL025) as z:
        wheel_headers = [n for n in z.namelist()
                         if n.startswith(tool.DEEPGEMM_INCLUDE) and not n.endswith("/")]
        record = z.read("vllm-0.25.1.dist-info/RECORD")
    assert len(names) == len(wheel_headers)
    (site / "vllm-0.25.1.dist-info").mkdir()
    (site / "vllm-0.25.1.dist-info" / "RECORD").write_bytes(record)
    status = tool.deepgemm_status(str(site))
    assert status["headers"] is True and status["headers_match_record"] is True
    (site / tool.DEEPGEMM_PROBE).write_text("// another DeepGEMM\n")
    assert tool.deepgemm_status(str(site))["headers_match_record"] is False
    shutil.rmtree(site / "vllm")
    assert tool.deepgemm_status(str(site))["headers"] is False
