#!/usr/bin/env python3
"""Dump the KV-cache tensor layouts that vLLM 0.25.1 registers, per attention backend.

vLLM 0.25.1 builds every attention layer's KV cache from two static methods of
the layer's attention backend: ``get_kv_cache_shape(...)`` (the logical shape
the kernels index) and ``get_kv_cache_stride_order(...)`` (the permutation that
gives the physical memory order).  The worker allocates a flat int8 buffer,
views it in *physical* order and permutes it back to the logical shape (see
``PROCEDURE`` below); that permuted view is what ``register_kv_caches``
receives.  vLLM 0.32 no longer has these methods (it builds 4-D [B, H, N, C]
views from ``KVCacheLayout``), so kvtier's tests take the 0.25.1 layouts from
the table this script writes instead of importing 0.25.1 at test time.

Usage::

    . .venv/bin/activate
    PYTHONPATH=.cache/vllm-0.25.1 python tools/gen_vllm025_layouts.py
    python tools/gen_vllm025_layouts.py .cache/vllm-0.25.1 -o tests/data/vllm025_kv_layouts.json

The positional argument is the directory that *contains* the ``vllm`` package
(default: ``$VLLM025_PATH``, else the first ``$PYTHONPATH`` entry holding a ``vllm``
package, else ``.cache/vllm-0.25.1`` (scripts/fetch_vllm025.sh unpacks it there)); it is put
first on sys.path.

For every backend class the script records, per parameter set, the result of
``get_kv_cache_shape`` and ``get_kv_cache_stride_order`` (both values of
``include_num_layers_dimension``, and both "NHD" and "HND" when the stride order
depends on ``get_kv_cache_layout()``), plus the source file and the line of the
``def`` of each method.  Backends whose module cannot be imported on CPU are
handled from source: the method's ``ast`` node gives file, line and the return
expressions, and the function is re-executed in isolation with the names it
needs imported one by one (``source_kind == "ast-exec"``); when even that fails
only the return expressions are kept (``source_kind == "ast-only"``).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import inspect
import json
import os
import re
import sys
import textwrap
import traceback
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

NUM_BLOCKS = 7  # small prime that collides with no other dimension below
NUM_LAYERS = 3  # used for the include_num_layers_dimension=True records
PROBE_NUM_BLOCKS = 1_000_003  # block-dim probe, like get_kv_cache_block_dim()
PROBE_NUM_KV_HEADS = 3  # distinct from the K/V dimension (2) when labelling dims

# Backend classes that are not in the registry enums but get a KV cache of their
# own in 0.25.1 (indexer caches, compressor state, DSV4 SWA, hidden-state cache).
EXTRA_BACKENDS: dict[str, str] = {
    "DEEPSEEK_V32_INDEXER": "vllm.v1.attention.backends.mla.indexer.DeepseekV32IndexerBackend",
    "DEEPSEEK_V4_INDEXER": "vllm.v1.attention.backends.mla.indexer.DeepseekV4IndexerBackend",
    "DEEPSEEK_SPARSE_SWA": "vllm.v1.attention.backends.mla.sparse_swa.DeepseekSparseSWABackend",
    "DEEPSEEK_V4_COMPRESSOR": "vllm.models.deepseek_v4.compressor.CompressorBackend",
    "MINIMAX_M3_INDEXER": "vllm.models.minimax_m3.common.indexer.MiniMaxM3IndexerBackend",
    "MLA_COMMON": "vllm.model_executor.layers.attention.mla_attention.MLACommonBackend",
    "CACHE_ONLY_HIDDEN_STATES": (
        "vllm.model_executor.models.extract_hidden_states.CacheOnlyAttentionBackend"
    ),
}

# Backends kvtier runs on (NVIDIA H200 GPU, CPU CI) get the full parameter grid;
# every other backend gets a reduced grid (block_size 16, one head count, one
# head size, every cache dtype) to keep the JSON small.
PRIMARY_BACKENDS = {
    "FLASH_ATTN",
    "FLASHINFER",
    "TRITON_ATTN",
    "CPU_ATTN",
    "FLEX_ATTENTION",
    "FLASHMLA",
    "FLASH_ATTN_MLA",
    "TRITON_MLA",
    "CUTLASS_MLA",
    "FLASHINFER_MLA",
    "FLASHMLA_SPARSE",
    "FLASH_ATTN_MLA_SPARSE",
    "FLASHINFER_MLA_SPARSE",
    "DEEPSEEK_V32_INDEXER",
}

PROCEDURE = (
    "How vLLM 0.25.1 (V1 model runner: GPUModelRunner._reshape_kv_cache_tensors -> "
    "v1/worker/gpu/attn_utils.py:_reshape_attention_kv_cache; the V2 runner's "
    "attn_utils._reshape_kv_cache calls the same helper) turns one attention layer's "
    "raw buffer into the tensor given to register_kv_caches: "
    "(1) raw = torch.zeros(KVCacheTensor.size, dtype=torch.int8) per KVCacheTensor; "
    "every layer in KVCacheTensor.shared_by (one layer of each KV-cache group) gets "
    "the SAME raw buffer. "
    "(2) num_blocks = raw.numel() // spec.page_size_bytes; kernel_num_blocks = "
    "num_blocks * (spec.block_size // kernel_block_size). "
    "(3) shape = backend.get_kv_cache_shape(kernel_num_blocks, kernel_block_size "
    "(spec.storage_block_size for compressed MLA), spec.num_kv_heads, spec.head_size, "
    "cache_dtype_str=<layer cache dtype string, 'auto' for unquantized layers>). "
    "(4) stride_order = backend.get_kv_cache_stride_order() (i.e. "
    "include_num_layers_dimension=False); identity if it raises AttributeError or "
    "NotImplementedError. "
    "(5) physical_shape = tuple(shape[i] for i in stride_order); inv_order = "
    "[stride_order.index(i) for i in range(len(stride_order))]; "
    "kv = raw.view(spec.dtype).view(physical_shape).permute(*inv_order). kv has the "
    "logical `shape` and the strides of the physical layout. "
    "To reproduce in a test: t = torch.zeros(physical_shape, dtype=dtype)"
    ".permute(*inv_order) (equivalently torch.empty(prod) .view(physical_shape)). "
    "Variants, same file: padded pages (spec.page_size_padded, mamba hybrids) use "
    "torch.as_strided with the num_blocks dim's stride = page_size_bytes/dtype_size "
    "(only num-blocks-first shapes allowed); packed layouts (KVCacheTensor.block_stride>0: "
    "DeepSeek-V4, or kv_connector_extra_config enable_cross_layers_blocks=true with >1 "
    "group) use raw.view(-1, block_stride)[:, offset:offset+page_bytes].view(dtype)"
    ".view(shape) (identity order asserted for dim 0). Hybrid attention+mamba models "
    "(or mixed block dims) then restride K/V-first (block_dim==1) attention views with "
    "as_strided_(stride=(hidden, 2*hidden, ...)) so blocks are outermost "
    "(GPUModelRunner._update_hybrid_attention_mamba_layout). Mamba layers get a LIST of "
    "state tensors, each torch.as_strided(raw.view(dtype), (num_blocks, *state_shape), "
    "(page_size_bytes/dtype_size, *contiguous_strides), offset), not one tensor. Layers "
    "that reuse another layer's KV (shared_kv_cache_layers) get the target's tensor "
    "object. If the connector's prefer_cross_layer_blocks is True and the model has one "
    "uniform group, allocate_uniform_kv_caches builds one (num_layers,)+shape tensor with "
    "get_kv_cache_stride_order(include_num_layers_dimension=True) and "
    "register_cross_layers_kv_cache is called INSTEAD of register_kv_caches."
)


# --------------------------------------------------------------------------- helpers


def _rel(path: str | None, root: Path) -> str | None:
    if path is None:
        return None
    try:
        return str(Path(path).resolve().relative_to(root.resolve()))
    except ValueError:
        return path


def _def_line(func: Any, name: str) -> tuple[str | None, int | None]:
    """File and line of `def name` for a real function (skips decorators)."""
    func = inspect.unwrap(getattr(func, "__func__", func))
    try:
        lines, start = inspect.getsourcelines(func)
        path = inspect.getsourcefile(func)
    except (OSError, TypeError):
        return None, None
    pat = re.compile(rf"^\s*(async\s+)?def\s+{re.escape(name)}\b")
    for off, text in enumerate(lines):
        if pat.match(text):
            return path, start + off
    return path, start


def _find_line(path: Path, pattern: str, start: int = 1) -> int | None:
    pat = re.compile(pattern)
    with open(path, encoding="utf-8") as f:
        for no, text in enumerate(f, 1):
            if no >= start and pat.search(text):
                return no
    return None


def _err(e: BaseException) -> str:
    msg = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {msg}"[:240]


class _Src:
    """One method's implementation, either the imported function or an AST rebuild."""

    def __init__(
        self,
        func: Callable | None,
        file: str | None,
        line: int | None,
        kind: str,
        owner: str | None,
        returns: list[str] | None = None,
        error: str | None = None,
        takes_cls: bool = False,
        source: str = "",
    ):
        self.func = func
        self.file = file
        self.line = line
        self.kind = kind  # "import" | "ast-exec" | "ast-only" | "missing"
        self.owner = owner  # class that defines it
        self.returns = returns
        self.error = error
        self.takes_cls = takes_cls
        self.source = source

    def call(self, *args, **kwargs):
        if self.func is None:
            raise RuntimeError(self.error or "no callable implementation")
        if self.takes_cls:
            return self.func(None, *args, **kwargs)
        return self.func(*args, **kwargs)

    def loc(self, root: Path) -> dict[str, Any]:
        return {"file": _rel(self.file, root), "line": self.line, "owner": self.owner}


# ------------------------------------------------------------------ AST fallback


class _AstModule:
    def __init__(self, module: str, root: Path):
        self.module = module
        # `root` is the vllm package directory; module names start with "vllm.".
        self.path = root.parent / (module.replace(".", "/") + ".py")
        self.source = self.path.read_text(encoding="utf-8")
        self.tree = ast.parse(self.source, filename=str(self.path))
        self.classes = {n.name: n for n in self.tree.body if isinstance(n, ast.ClassDef)}
        # name -> (module, attr or None) from top-level imports (TYPE_CHECKING blocks skipped)
        self.imports: dict[str, tuple[str, str | None]] = {}
        for node in self.tree.body:
            self._collect_import(node)

    def _collect_import(self, node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            for a in node.names:
                self.imports[a.asname or a.name.split(".")[0]] = (
                    a.name if a.asname else a.name.split(".")[0],
                    None,
                )
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                base = self.module.split(".")[: -node.level]
                mod = ".".join(base + ([mod] if mod else []))
            for a in node.names:
                self.imports[a.asname or a.name] = (mod, a.name)
        elif isinstance(node, ast.Try):
            for sub in node.body:
                self._collect_import(sub)

    def resolve(self, name: str) -> Any:
        if name not in self.imports:
            raise KeyError(name)
        mod, attr = self.imports[name]
        m = importlib.import_module(mod)
        if attr is None:
            return m
        try:
            return getattr(m, attr)
        except AttributeError:
            return importlib.import_module(f"{mod}.{attr}")

    def module_level_value(self, name: str) -> Any:
        """Simple literal module constants (e.g. NAME = 16)."""
        for node in self.tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return ast.literal_eval(node.value)
        raise KeyError(name)


def _ast_method(mod: _AstModule, cls_name: str, meth: str, root: Path, depth: int = 0) -> _Src:
    cls = mod.classes.get(cls_name)
    if cls is None:
        return _Src(
            None,
            str(mod.path),
            None,
            "missing",
            None,
            error=f"class {cls_name} not found in {mod.path}",
        )
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == meth:
            returns = [
                ast.unparse(r.value)
                for r in ast.walk(node)
                if isinstance(r, ast.Return) and r.value is not None
            ]
            decos = [ast.unparse(d) for d in node.decorator_list]
            takes_cls = "classmethod" in decos
            fn, err = _ast_exec(mod, node)
            return _Src(
                fn,
                str(mod.path),
                node.lineno,
                "ast-exec" if fn is not None else "ast-only",
                f"{mod.module}.{cls_name}",
                returns=returns,
                error=err,
                takes_cls=takes_cls,
                source=ast.get_source_segment(mod.source, node) or "",
            )
    # Not defined here: walk the bases.
    for base in cls.bases:
        bname = ast.unparse(base)
        if bname in mod.classes and depth < 8:
            return _ast_method(mod, bname, meth, root, depth + 1)
        try:
            base_obj = mod.resolve(bname.split(".")[0])
            for part in bname.split(".")[1:]:
                base_obj = getattr(base_obj, part)
        except Exception as e:  # base not importable either
            # Try the base's own source if it lives in the vllm tree.
            imp = mod.imports.get(bname)
            if imp and imp[0].startswith("vllm") and depth < 8:
                try:
                    bmod = _AstModule(imp[0], root)
                    return _ast_method(bmod, imp[1] or bname, meth, root, depth + 1)
                except Exception:
                    pass
            return _Src(
                None, None, None, "missing", None, error=f"base {bname} not importable: {_err(e)}"
            )
        if hasattr(base_obj, meth):
            return _real_method(base_obj, meth)
    return _Src(None, None, None, "missing", None, error=f"{meth} not found on {cls_name}")


def _ast_exec(mod: _AstModule, node: ast.FunctionDef) -> tuple[Callable | None, str | None]:
    """Re-create one method as a plain function; resolve its free names one by one."""
    fn_node = (
        ast.FunctionDef(
            name=node.name,
            args=node.args,
            body=node.body,
            decorator_list=[],
            returns=None,
            type_comment=None,
            type_params=[],
        )
        if sys.version_info >= (3, 12)
        else ast.FunctionDef(
            name=node.name,
            args=node.args,
            body=node.body,
            decorator_list=[],
            returns=None,
            type_comment=None,
        )
    )
    # Drop annotations: they may name types that are not importable.
    args = fn_node.args
    for a in args.posonlyargs + args.args + args.kwonlyargs:
        a.annotation = None
    if args.vararg:
        args.vararg.annotation = None
    if args.kwarg:
        args.kwarg.annotation = None
    module = ast.Module(body=[fn_node], type_ignores=[])
    ast.fix_missing_locations(module)
    ns: dict[str, Any] = {"__builtins__": __builtins__, "__name__": mod.module}
    missing: list[str] = []
    params = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    local_assigned = {
        n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }
    free = (
        {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        - params
        - local_assigned
    )
    for name in sorted(free):
        if hasattr(
            __builtins__
            if isinstance(__builtins__, types.ModuleType)
            else types.SimpleNamespace(**__builtins__),
            name,
        ):
            continue
        try:
            ns[name] = mod.resolve(name)
            continue
        except Exception:
            pass
        try:
            ns[name] = mod.module_level_value(name)
        except Exception:
            missing.append(name)
    try:
        exec(compile(module, str(mod.path), "exec"), ns)
    except Exception as e:
        return None, f"exec failed: {_err(e)}"
    fn = ns[node.name]
    if missing:
        # Still callable: the missing names may sit on branches we never take.
        fn.__kvtier_missing__ = missing  # type: ignore[attr-defined]
    return fn, (f"unresolved names: {missing}" if missing else None)


def _real_method(cls: type, meth: str) -> _Src:
    func = getattr(cls, meth)
    owner = None
    for klass in cls.__mro__:
        if meth in vars(klass):
            owner = f"{klass.__module__}.{klass.__qualname__}"
            break
    file, line = _def_line(func, meth)
    return _Src(func, file, line, "import", owner)


# ---------------------------------------------------------------- backend table


def _backend_list() -> list[tuple[str, str, str]]:
    from vllm.v1.attention.backends.registry import (
        AttentionBackendEnum,
        MambaAttentionBackendEnum,
    )

    out: list[tuple[str, str, str]] = []
    for family, enum in (("attention", AttentionBackendEnum), ("mamba", MambaAttentionBackendEnum)):
        for m in enum:
            if m.value:
                out.append((m.name, m.value, family))
    for name, path in EXTRA_BACKENDS.items():
        out.append((name, path, "extra"))
    return out


def _family(name: str, path: str, cls: Any, src_text: str, enum_family: str) -> str:
    if enum_family == "mamba":
        return "mamba"
    low = (name + " " + path).lower()
    if "indexer" in low:
        return "indexer"
    is_mla = False
    if cls is not None:
        with contextlib.suppress(Exception):
            is_mla = bool(cls.is_mla())
    if is_mla or "mla" in low or "compressor" in low or "sparse_swa" in low:
        return "mla"
    if "hidden_states" in low:
        return "hidden_states"
    return "standard"


def _param_grid(
    family: str, shape_src: str, default_dtype: str | None, full: bool = True
) -> list[dict]:
    dtypes = ["auto", "fp8"]
    if default_dtype and default_dtype not in dtypes:
        dtypes.append(default_dtype)
    if "per_token_head" in shape_src:
        dtypes += ["fp8_per_token_head", "int8_per_token_head"]
    if "nvfp4" in shape_src:
        dtypes.append("nvfp4")
    if "fp8_ds_mla" in shape_src:
        dtypes.append("fp8_ds_mla")
    if family == "mla":
        heads, sizes = [1], [576, 656]
        if "584" in shape_src:  # DeepSeek-V4 caches take the 512 semantic head dim
            sizes = [512, 576]
    elif family == "indexer":
        heads, sizes = [1], [132]  # DSV3.2 indexer: 128 fp8 + 128/128*4 scale bytes
        dtypes = ["auto", "fp8"]
    elif family == "hidden_states":
        heads, sizes = [2], [128]
    else:
        heads, sizes = [1, 2, 8], [128]
    if not full:
        heads, sizes = heads[len(heads) // 2 :][:1], sizes[:1]
    grid = []
    for bs in (16, 64) if full else (16,):
        # Full head sweep at block_size 16; the largest head count at 64 (the shape
        # formulas are linear in every argument, so this keeps the table small).
        bs_heads = heads if bs == 16 else heads[-1:]
        for h in bs_heads:
            for hs in sizes:
                for dt in dict.fromkeys(dtypes):
                    grid.append(
                        {
                            "num_blocks": NUM_BLOCKS,
                            "block_size": bs,
                            "num_kv_heads": h,
                            "head_size": hs,
                            "cache_dtype_str": dt,
                        }
                    )
    return grid


def _labels(shape_src: _Src, p: dict, family: str) -> list[str] | None:
    """Name each logical dim by probing with distinct sizes."""
    h = PROBE_NUM_KV_HEADS if family in ("standard", "hidden_states") else p["num_kv_heads"]
    try:
        probe = tuple(
            shape_src.call(
                PROBE_NUM_BLOCKS,
                p["block_size"],
                h,
                p["head_size"],
                cache_dtype_str=p["cache_dtype_str"],
            )
        )
    except Exception:
        return None
    labels = []
    for v in probe:
        if v == PROBE_NUM_BLOCKS:
            labels.append("blocks")
        elif v == p["block_size"]:
            labels.append("tokens")
        elif v == h and h != 1:
            labels.append("kv_heads")
        elif v == 2:
            labels.append("kv")
        elif v == p["head_size"]:
            labels.append("head")
        elif v == 2 * p["head_size"]:
            labels.append("k|v_head")
        elif v == 1:
            labels.append("one")
        else:
            labels.append(f"packed[{v}]")
    return labels


_SHORT = {
    "blocks": "B",
    "tokens": "N",
    "kv_heads": "H",
    "kv": "KV",
    "head": "D",
    "k|v_head": "2D",
    "one": "1",
    "layers": "L",
}


def _dims(labels: list[str] | None) -> str | None:
    """Logical dims as short codes, e.g. "B,KV,N,H,D" (see DIM_CODES in the JSON)."""
    if labels is None:
        return None
    return ",".join(_SHORT.get(x, x.replace("packed", "P")) for x in labels)


def _note(labels: list[str] | None, stride: list[int] | None, with_layers: bool) -> str:
    """Short physical-layout description (outermost dim first)."""
    if labels is None or stride is None:
        return "unknown (shape probe failed)"
    if with_layers:
        labels = ["layers", *labels]
    try:
        phys = [labels[i] for i in stride]
    except IndexError:
        return "stride order does not match shape rank"
    text = "phys[" + ",".join(_SHORT.get(x, x.replace("packed", "P")) for x in phys) + "]"
    core = [x for x in phys if x != "one"]
    parts: list[str] = []
    if core and core[0] == "blocks":
        inner = core[1:]
        if with_layers:
            parts.append("block-outer, all layers inside a block (cross-layer)")
        else:
            parts.append("block-outer: 1 segment/layer")
        if "kv" in inner:
            parts.append("K,V halves inside block")
        elif "k|v_head" in inner:
            parts.append("K|V concatenated in last dim")
    elif len(core) > 1 and core[0] == "kv" and core[1] == "blocks":
        inner = core[2:]
        parts.append("K/V-first: K region then V region, 2 segments/layer")
    elif core and core[0] == "layers":
        inner = core[1:]
        parts.append("layer-outer (identity => no cross-layer support)")
    else:
        inner = core
        parts.append("block dim not outermost")
    if "tokens" in inner and "kv_heads" in inner:
        parts.append("HND" if inner.index("kv_heads") < inner.index("tokens") else "NHD")
    return text + " " + "; ".join(parts)


# --------------------------------------------------------------------------- main


def generate(vllm_parent: Path, out_path: Path) -> dict:
    sys.path.insert(0, str(vllm_parent))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    warnings.filterwarnings("ignore")
    import torch
    import vllm

    root = Path(vllm.__file__).resolve().parent  # the vllm package dir
    version = getattr(vllm, "__version__", "?")
    if not str(version).startswith("0.25"):
        print(f"warning: vllm {version} at {root} is not 0.25.x", file=sys.stderr)
    from vllm.v1.attention.backends.utils import set_kv_cache_layout

    gmr = root / "v1/worker/gpu_model_runner.py"
    au = root / "v1/worker/gpu/attn_utils.py"
    reshape_fn = _find_line(gmr, r"def _reshape_kv_cache_tensors\(")
    alloc_site = {
        "file": _rel(str(gmr), root),
        "allocate_raw_line": _find_line(gmr, r"def _allocate_kv_cache_tensors\("),
        "reshape_function_line": reshape_fn,
        "get_kv_cache_shape_call_line": _find_line(
            gmr, r"attn_backend\.get_kv_cache_shape\(", reshape_fn or 1
        ),
        "get_kv_cache_stride_order_call_line": _find_line(
            gmr, r"attn_backend\.get_kv_cache_stride_order\(\)", reshape_fn or 1
        ),
        "reshape_attention_call_line": _find_line(
            gmr, r"= _reshape_attention_kv_cache\(", reshape_fn or 1
        ),
        "mamba_state_list_line": _find_line(gmr, r"kv_caches\[layer_name\] = state_tensors"),
        "hybrid_restride_line": _find_line(gmr, r"def _update_hybrid_attention_mamba_layout\("),
        "shared_layers_line": _find_line(
            gmr, r"kv_caches\[layer_name\] = kv_caches\[target_layer_name\]"
        ),
        "register_kv_caches_line": _find_line(gmr, r"\.register_kv_caches\(kv_caches\)"),
        "helper_file": _rel(str(au), root),
        "helper_function_line": _find_line(au, r"def _reshape_attention_kv_cache\("),
        "helper_physical_view_line": _find_line(au, r"\.view\(permuted_kv_cache_shape\)"),
        "helper_permute_line": _find_line(au, r"return kv_cache\.permute\(\*inv_order\)"),
        "cross_layer_file": "v1/worker/kv_connector_model_runner_mixin.py",
        "cross_layer_function_line": _find_line(
            root / "v1/worker/kv_connector_model_runner_mixin.py",
            r"def allocate_uniform_kv_caches\(",
        ),
    }

    backends_summary: list[dict] = []
    records: list[dict] = []

    for name, path, enum_family in _backend_list():
        module, cls_name = path.rsplit(".", 1)
        cls = None
        import_error = None
        try:
            cls = getattr(importlib.import_module(module), cls_name)
        except BaseException as e:
            import_error = _err(e)
        if cls is not None:
            shape_s = _real_method(cls, "get_kv_cache_shape")
            stride_s = _real_method(cls, "get_kv_cache_stride_order")
        else:
            try:
                amod = _AstModule(module, root)
                shape_s = _ast_method(amod, cls_name, "get_kv_cache_shape", root)
                stride_s = _ast_method(amod, cls_name, "get_kv_cache_stride_order", root)
            except Exception as e:
                shape_s = stride_s = _Src(None, None, None, "missing", None, error=_err(e))

        shape_text = shape_s.source
        if not shape_text and shape_s.func is not None:
            try:
                shape_text = textwrap.dedent(
                    inspect.getsource(
                        inspect.unwrap(getattr(shape_s.func, "__func__", shape_s.func))
                    )
                )
            except Exception:
                shape_text = ""
        try:
            default_dtype = (
                inspect.signature(shape_s.func).parameters["cache_dtype_str"].default
                if shape_s.func
                else None
            )
        except Exception:
            default_dtype = None
        family = _family(name, path, cls, shape_text, enum_family)

        stride_params: list[str] = []
        if stride_s.func is not None:
            with contextlib.suppress(Exception):
                stride_params = list(inspect.signature(stride_s.func).parameters)
        include_variants = (
            [False, True] if "include_num_layers_dimension" in stride_params else [None]
        )

        # Does the stride order depend on get_kv_cache_layout()?
        def stride_for(layout: str | None, include: bool | None, stride_s: _Src = stride_s):
            # A layout-independent order is evaluated under "NHD" so that a stray
            # get_kv_cache_layout() call does not need a vLLM config.
            set_kv_cache_layout(layout or "NHD")  # type: ignore[arg-type]
            try:
                if include is None:
                    return list(stride_s.call()), None
                return list(stride_s.call(include_num_layers_dimension=include)), None
            except Exception as e:
                return None, _err(e)
            finally:
                set_kv_cache_layout(None)

        layout_dep = False
        if stride_s.func is not None:
            for inc in include_variants:
                if stride_for("NHD", inc) != stride_for("HND", inc):
                    layout_dep = True
        layouts: list[str | None] = ["NHD", "HND"] if layout_dep else [None]

        required: dict[str, Any] = {}
        if cls is not None:
            try:
                value = cls.get_required_kv_cache_layout()
            except Exception as e:
                value = f"error: {_err(e)}"
            rfile, rline = _def_line(
                cls.get_required_kv_cache_layout, "get_required_kv_cache_layout"
            )
            required = {"value_on_this_host": value, "file": _rel(rfile, root), "line": rline}
        else:
            try:
                rs = _ast_method(
                    _AstModule(module, root), cls_name, "get_required_kv_cache_layout", root
                )
                required = {"file": _rel(rs.file, root), "line": rs.line}
                if rs.returns is not None:
                    required["ast_returns"] = rs.returns
                elif rs.func is not None:
                    required["value_on_this_host"] = rs.call()
            except Exception as e:
                required = {"error": _err(e)}
        indexes_by_block_stride = None
        if cls is not None and hasattr(cls, "indexes_kv_by_block_stride"):
            try:
                set_kv_cache_layout("NHD")
                indexes_by_block_stride = bool(cls.indexes_kv_by_block_stride())
            except Exception:
                pass
            finally:
                set_kv_cache_layout(None)

        summary = {
            "backend": name,
            "family": family,
            "grid": "full" if name in PRIMARY_BACKENDS else "reduced",
            "module": module,
            "class": cls_name,
            "import_ok": cls is not None,
            "import_error": import_error,
            "source_kind": shape_s.kind
            if shape_s.kind == stride_s.kind
            else f"{shape_s.kind}/{stride_s.kind}",
            "get_kv_cache_shape": shape_s.loc(root),
            "get_kv_cache_stride_order": stride_s.loc(root),
            "stride_order_depends_on_kv_cache_layout": layout_dep,
            "include_num_layers_dimension_supported": include_variants != [None],
            "get_required_kv_cache_layout": required,
            "indexes_kv_by_block_stride(NHD)": indexes_by_block_stride,
        }
        if shape_s.kind in ("ast-exec", "ast-only"):
            summary["get_kv_cache_shape"]["ast_returns"] = shape_s.returns
            if shape_s.error:
                summary["get_kv_cache_shape"]["ast_note"] = shape_s.error
        if stride_s.kind in ("ast-exec", "ast-only"):
            summary["get_kv_cache_stride_order"]["ast_returns"] = stride_s.returns
            if stride_s.error:
                summary["get_kv_cache_stride_order"]["ast_note"] = stride_s.error
        if shape_s.kind == "missing":
            summary["get_kv_cache_shape"]["error"] = shape_s.error
        if stride_s.kind == "missing":
            summary["get_kv_cache_stride_order"]["error"] = stride_s.error
        backends_summary.append(summary)

        base = {
            "backend": name,
            "module": module,
            "file": _rel(shape_s.file, root),
            "shape_line": shape_s.line,
            "stride_line": stride_s.line,
        }
        if stride_s.file != shape_s.file:
            # Inherited from / overridden in a different file.
            base["stride_file"] = _rel(stride_s.file, root)
        if import_error:
            base["import_error"] = import_error

        if shape_s.func is None:
            records.append(
                {
                    **base,
                    "params": None,
                    "shape": None,
                    "stride_order": None,
                    "note": "no evaluable get_kv_cache_shape: "
                    + (shape_s.error or "")
                    + (f"; ast returns: {shape_s.returns}" if shape_s.returns else ""),
                }
            )
            continue

        grid = _param_grid(family, shape_text, default_dtype, full=name in PRIMARY_BACKENDS)
        first_ok_params: dict | None = None
        first_labels: list[str] | None = None
        first_shape: list[int] | None = None
        for p in grid:
            try:
                shape = [
                    int(x)
                    for x in shape_s.call(
                        p["num_blocks"],
                        p["block_size"],
                        p["num_kv_heads"],
                        p["head_size"],
                        cache_dtype_str=p["cache_dtype_str"],
                    )
                ]
            except NotImplementedError as e:
                # Inherited AttentionBackend.get_kv_cache_shape (e.g. mamba backends):
                # one record is enough.
                records.append(
                    {
                        **base,
                        "params": None,
                        "shape": None,
                        "stride_order": None,
                        "error": _err(e) or "NotImplementedError",
                        "note": "get_kv_cache_shape not implemented; for mamba "
                        "layers vLLM builds a list of state tensors from "
                        "MambaSpec.shapes/dtypes instead (see procedure)",
                    }
                )
                break
            except Exception as e:
                records.append(
                    {**base, "params": p, "shape": None, "stride_order": None, "error": _err(e)}
                )
                continue
            labels = _labels(shape_s, p, family)
            if first_ok_params is None:
                first_ok_params, first_labels, first_shape = p, labels, shape
            for layout in layouts:
                inc = False if include_variants != [None] else None
                stride, serr = stride_for(layout, inc)
                if stride is None:
                    # vLLM falls back to identity on AttributeError/NotImplementedError.
                    stride_eff = list(range(len(shape)))
                else:
                    stride_eff = stride
                rec = {
                    **base,
                    "params": {**p, "kv_cache_layout": layout, "include_num_layers_dimension": inc},
                    "shape": shape,
                    "stride_order": stride,
                    "dims": _dims(labels),
                    "note": _note(labels, stride_eff, False),
                }
                if serr:
                    rec["stride_error"] = serr + " (vLLM uses the identity order)"
                if stride is not None and len(stride) != len(shape):
                    rec["note"] += "; WARNING: rank mismatch, vLLM would assert"
                records.append(rec)

        # Cross-layer variant (only used with prefer_cross_layer_blocks): one per layout.
        if True in include_variants and first_ok_params is not None:
            for layout in layouts:
                stride, serr = stride_for(layout, True)
                shape = [NUM_LAYERS, *list(first_shape or [])]
                rec = {
                    **base,
                    "params": {
                        **first_ok_params,
                        "num_layers": NUM_LAYERS,
                        "kv_cache_layout": layout,
                        "include_num_layers_dimension": True,
                    },
                    "shape": shape,
                    "stride_order": stride,
                    "dims": _dims(["layers", *first_labels]) if first_labels else None,
                    "note": _note(first_labels, stride, True)
                    if stride
                    else f"stride order error: {serr}",
                }
                records.append(rec)

    set_kv_cache_layout(None)
    result = {
        "description": (
            "KV-cache layouts registered by vLLM 0.25.1 per attention backend: "
            "get_kv_cache_shape() and get_kv_cache_stride_order() results for small "
            "parameter sets. Generated by tools/gen_vllm025_layouts.py; do not edit."
        ),
        "vllm_version": version,
        "vllm_package_dir": str(root),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "line_convention": (
            "shape_line/stride_line are the line of the `def` statement (decorators are "
            "above it); files are relative to the vllm package directory. For imported "
            "classes the defining class is found through the MRO (inherited methods "
            "point at the base class file)."
        ),
        "source_kind_legend": {
            "import": "class imported; results come from calling the real methods",
            "ast-exec": (
                "module not importable on CPU; the method was rebuilt from its "
                "ast node (decorators/annotations dropped, free names imported "
                "one by one) and called"
            ),
            "ast-only": "only the ast return expressions are available",
            "missing": "method not found / not resolvable",
        },
        "default_kv_cache_layout": (
            "get_kv_cache_layout() = _KV_CACHE_LAYOUT_OVERRIDE (set by the selector from "
            "backend.get_required_kv_cache_layout(), e.g. FlashInfer on SM10x -> HND, "
            "CPU -> HND) else $VLLM_KV_CACHE_LAYOUT else the connector class's "
            "get_required_kvcache_layout(vllm_config) else 'NHD' "
            "(v1/attention/backends/utils.py get_kv_cache_layout; "
            "distributed/kv_transfer/kv_connector/utils.py get_kv_connector_cache_layout)"
        ),
        "allocation_site": alloc_site,
        "procedure": PROCEDURE,
        "num_blocks": NUM_BLOCKS,
        "record_fields": (
            "backend, module, file (of get_kv_cache_shape), shape_line, stride_line, "
            "stride_file (only when get_kv_cache_stride_order lives in another file), "
            "params (the get_kv_cache_shape arguments plus kv_cache_layout -- the value "
            "get_kv_cache_layout() returned, null when the stride order does not depend "
            "on it -- and include_num_layers_dimension, null when the method has no such "
            "parameter; num_layers is set on the cross-layer records), shape, "
            "stride_order (null if the method raised; vLLM then uses the identity), "
            "dims (logical dim codes), note (physical order, outermost first, and what "
            "it means for segmenting), error/stride_error when a call raised"
        ),
        "dim_codes": {
            "B": "blocks (num_blocks)",
            "N": "tokens in block (block_size)",
            "H": "kv heads",
            "KV": "K/V selector (size 2)",
            "D": "head_size",
            "2D": "K and V concatenated (2*head_size)",
            "L": "layers (cross-layer allocation)",
            "1": "size-1 dim",
            "P[n]": "backend-specific packed width n (e.g. 656 fp8_ds_mla "
            "bytes, nvfp4 data+scales, per-token-head scale padding)",
        },
        "backends": backends_summary,
        "records": records,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as f:
        # Compact: one record per line keeps the file small and diffable.
        head = {k: v for k, v in result.items() if k not in ("backends", "records")}
        f.write("{\n")
        for k, v in head.items():
            f.write(f"{json.dumps(k)}: {json.dumps(v)},\n")
        f.write('"backends": [\n')
        f.write(",\n".join(json.dumps(b, separators=(",", ":")) for b in backends_summary))
        f.write('\n],\n"records": [\n')
        f.write(",\n".join(json.dumps(r, separators=(",", ":")) for r in records))
        f.write("\n]\n}\n")
    # Validate that what we wrote parses.
    json.loads(out_path.read_text(encoding="utf-8"))
    return result


def _default_vllm_parent() -> str:
    if os.environ.get("VLLM025_PATH"):
        return os.environ["VLLM025_PATH"]
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry and (Path(entry) / "vllm" / "__init__.py").is_file():
            return entry
    return ".cache/vllm-0.25.1"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "vllm_parent",
        nargs="?",
        default=_default_vllm_parent(),
        help="directory containing the vllm 0.25.1 package",
    )
    repo = Path(__file__).resolve().parent.parent
    ap.add_argument(
        "-o", "--output", type=Path, default=repo / "tests" / "data" / "vllm025_kv_layouts.json"
    )
    args = ap.parse_args(argv)
    try:
        res = generate(Path(args.vllm_parent), args.output)
    except Exception:
        traceback.print_exc()
        return 1
    n_ok = sum(1 for r in res["records"] if r.get("shape") is not None)
    kinds: dict[str, int] = {}
    for b in res["backends"]:
        kinds[b["source_kind"]] = kinds.get(b["source_kind"], 0) + 1
    size = args.output.stat().st_size
    print(
        f"vllm {res['vllm_version']}: {len(res['backends'])} backends {kinds}, "
        f"{len(res['records'])} records ({n_ok} with a shape), "
        f"{size / 1024:.1f} KiB -> {args.output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
