"""kvtier.testing.vllm_fixes, the MiniMax-M3 top-k layout fix: why it exists (0.25.1's Triton
impls address the NVIDIA model's token-major top-k buffer as head-major, so the top-k lists of
different (head, token) pairs share memory and a query can read a block list that starts after
it) and that the view it hands them addresses every (head, token) pair on its own, at the
element the token-major buffer holds for it. The Triton kernels index the top-k tensor only
through its strides (``t_ptr + h * stride_th + n * stride_tn + k * stride_tk``), so the
addresses computed here from the views' strides are the addresses the kernels use; the
kernels themselves cannot run here (their interpreter lacks block pointers)."""

from __future__ import annotations

import ast
import pathlib

import pytest

from kvtier.testing.vllm_fixes import apply_vllm_fixes, head_major_topk

torch = pytest.importorskip("torch")

ROOT = pathlib.Path(__file__).resolve().parents[1]
M3 = ROOT / ".cache" / "vllm-0.25.1" / "vllm" / "models" / "minimax_m3"
needs_m3 = pytest.mark.skipif(not M3.is_dir(), reason="vLLM 0.25.1 sources not in .cache")

H, TOPK, BLOCK = 4, 16, 128  # M3's index heads (= KV heads), sparse_topk_blocks, block size
BATCH = (647, 771)  # the H200 run's shared-batch prompts (2 chunks of 256 + 135 / + 259)


def token_major_buffer(tokens: int) -> torch.Tensor:
    """As 0.25.1's ``nvidia/model.py`` allocates it: [tokens padded to 4, heads, top-k]."""
    return torch.zeros((tokens + 3) // 4 * 4, H, TOPK, dtype=torch.int32)


def kernel_addresses(view: torch.Tensor, tokens: int) -> dict[tuple[int, int], set[int]]:
    """Per (head, token) of a prefill, the elements the top-k and attend kernels touch: the
    index top-k writes ``out[:, :total_q, :]`` of the view it is given and the attend reads
    its view by the same strides."""
    s0, s1, s2 = view.stride()
    base = view.storage_offset()
    return {(h, n): {base + h * s0 + n * s1 + k * s2 for k in range(TOPK)}
            for h in range(H) for n in range(tokens)}


def prefill_views(buf: torch.Tensor, nd: int) -> torch.Tensor:
    """0.25.1's ``MiniMaxM3IndexerTritonImpl.forward`` passes ``out=buf[:, nd:, :]``, and
    ``minimax_m3_index_topk`` writes into ``out[:, :total_q, :]``."""
    return buf[:, nd:, :]


def sharers(addr: dict[tuple[int, int], set[int]]) -> dict[tuple[int, int], set[tuple[int, int]]]:
    """Per (head, token): the other (head, token) pairs whose top-k shares its memory."""
    owners: dict[int, set[tuple[int, int]]] = {}
    for key, elems in addr.items():
        for e in elems:
            owners.setdefault(e, set()).add(key)
    return {key: set().union(*(owners[e] for e in elems)) - {key}
            for key, elems in addr.items()}


@pytest.mark.parametrize("nd", [0, 2])  # a prefill-only step, and one with two decode tokens
def test_vllm025_views_alias_heads_and_tokens(nd: int) -> None:
    tokens = sum(BATCH)
    buf = token_major_buffer(nd + tokens)
    shared = sharers(kernel_addresses(prefill_views(buf, nd), tokens))
    # (h, n) and (h - 1, n + 4) are one list: H * TOPK elements per token cannot hold H lists
    assert (1, 0) in shared[(0, 4)] and (0, 8) in shared[(1, 4)]
    # the second prompt's first token (block 0 its only visible block) shares its list with
    # the first prompt's last tokens (635, 639, 643), whose lists start at their own block (4
    # or 5; the local block is forced first): a block after the query, every key of it
    # masked, so the attend's online softmax computes exp2(-inf - -inf) = NaN
    other = {n for h, n in shared[(0, BATCH[0])]}
    assert other == {BATCH[0] - 4, BATCH[0] - 8, BATCH[0] - 12}
    assert all(n // BLOCK > 0 for n in other)


@pytest.mark.parametrize("nd", [0, 2])
def test_the_head_major_view_gives_every_pair_its_own_list_where_the_model_keeps_it(
        nd: int) -> None:
    tokens = sum(BATCH)
    buf = token_major_buffer(nd + tokens)
    addr = kernel_addresses(prefill_views(head_major_topk(buf), nd), tokens)
    assert not any(sharers(addr).values())
    for (h, n), elems in addr.items():  # where the MSA path and the model read (token, head)
        assert elems == {buf[nd + n, h, k].data_ptr() // 4 - buf.data_ptr() // 4
                         for k in range(TOPK)}
    assert head_major_topk(None) is None


def test_no_fix_on_other_vllm_versions() -> None:
    pytest.importorskip("vllm")
    assert apply_vllm_fixes() == []  # 0.32 here: its Triton impls transpose the buffer


def _method(path: pathlib.Path, cls: str, name: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text())
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _buffer_reads(fn: ast.FunctionDef) -> list[str]:
    return [ast.unparse(n) for n in ast.walk(fn)
            if isinstance(n, ast.Attribute) and n.attr == "topk_indices_buffer"]


@needs_m3
def test_vllm025_allocates_token_major_and_the_triton_impls_slice_head_major() -> None:
    """The 0.25.1 code the fix is for, and that the attribute it swaps is the only way the two
    impls reach the buffer (the indexer its own, the attend its layer's)."""
    model = (M3 / "nvidia" / "model.py").read_text()
    assert "self.topk_indices_buffer = torch.empty(\n                padded_num_tokens,\n" \
           "                num_index_heads," in model
    indexer = _method(M3 / "common" / "indexer.py", "MiniMaxM3IndexerTritonImpl", "forward")
    attend = _method(M3 / "common" / "sparse_attention.py", "MiniMaxM3SparseTritonImpl",
                     "forward")
    assert "buf[:, nd:, :]" in ast.unparse(indexer)
    assert "topk[:, nd:num_tokens, :]" in ast.unparse(attend)
    assert "topk[:, :nd, :]" in ast.unparse(attend)
    assert _buffer_reads(indexer) == ["self.topk_indices_buffer"]
    assert _buffer_reads(attend) == ["layer.topk_indices_buffer"]
    assert [a.arg for a in attend.args.args[:2]] == ["self", "layer"]
    ops = (M3 / "common" / "ops" / "index_topk.py").read_text()
    assert ops.count("topk_idx = out[:, :total_q, :]") == 2  # prefill and decode top-k
