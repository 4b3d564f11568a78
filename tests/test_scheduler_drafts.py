"""EAGLE/MTP drafts (issue 14): a draft layer's KV at a chunk's last position is computed from
the token after the chunk, so with drafts on kvtier keys every chunk with that token too and
saves a chunk of generated tokens only once the next chunk is computed. Driven through the
scheduler's step-shaped entry points, one MLA-like group (DeepSeek MTP puts its draft layer in
the target's group), as test_scheduler.py does."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.config import KvtierConfig
from kvtier.keys import RequestKeys
from kvtier.layout import GroupKind
from kvtier.planner import Geometry, GroupGeometry, chunks_to_save, make_slab_layout
from kvtier.protocol import Job, StepPlan, WorkerReport
from kvtier.scheduler import CachedRequest, NewRequest, OffloadScheduler, ScheduledTokens, StepInput

C = 32
BLOCK = 16
GEOMETRY = Geometry(C, (GroupGeometry(GroupKind.FULL, BLOCK, 4096),))
NAMESPACE = b"n" * 16


def make_scheduler(draft_lookahead: int) -> OffloadScheduler:
    config = KvtierConfig(dram_size="4MiB", cost_model=False)
    return OffloadScheduler(config, GEOMETRY, NAMESPACE, make_slab_layout(config, GEOMETRY, 1),
                            draft_lookahead=draft_lookahead)


def tokens(n: int, seed: int = 0) -> list[int]:
    return [(seed * 1000 + i) % 50_000 + 1 for i in range(n)]


def ok(jobs: Sequence[Job]) -> dict[int, list[int]]:
    return {j.job_id: [1, 0] for j in jobs}


def prefill(sched: OffloadScheduler, req_id: str, prompt: list[int], first_block: int
            ) -> StepPlan:
    """One step that computes the whole prompt; its saves reported written."""
    sched.add_request(req_id)
    blocks = [list(range(first_block, first_block + len(prompt) // BLOCK + 1))]
    plan = sched.schedule_step(StepInput(
        new=[NewRequest(req_id, blocks)],
        scheduled=[ScheduledTokens(req_id, prompt, len(prompt), len(prompt))]))
    sched.on_report(WorkerReport(saves=ok(plan.saves)))
    return plan


def shared_chunk_then_different_next_token() -> tuple[list[int], list[int]]:
    """Two prompts that share chunk 0 and differ at its next token (position C)."""
    shared = tokens(C, seed=1)
    return shared + tokens(5, seed=2), shared + tokens(5, seed=3)


def test_with_drafts_a_chunk_is_not_a_hit_for_another_next_token() -> None:
    a, b = shared_chunk_then_different_next_token()
    sched = make_scheduler(draft_lookahead=1)
    assert [j.chunk for j in prefill(sched, "a", a, 1).saves] == [0]
    sched.add_request("b")
    # chunk 0 of b holds the same tokens, but its last position's draft KV was computed with
    # a's token 32: not b's
    assert sched.lookup("b", b, 0) == 0
    assert sched.stats.declined["not_stored"] == 1
    # the same prompt again is a hit on the whole chunk, not one block less
    sched.add_request("a2")
    assert sched.lookup("a2", a, 0) == C
    # and a prompt that shares chunk 0 and token 32, differing right after it, too
    sched.add_request("c")
    assert sched.lookup("c", a[:C + 1] + tokens(4, seed=4), 0) == C


def test_without_drafts_the_shared_chunk_is_a_hit() -> None:
    # the control: the same two prompts on an engine without drafts
    a, b = shared_chunk_then_different_next_token()
    sched = make_scheduler(draft_lookahead=0)
    prefill(sched, "a", a, 1)
    sched.add_request("b")
    assert sched.lookup("b", b, 0) == C


def test_with_drafts_b_stores_its_own_chunk_and_each_prompt_finds_its_own() -> None:
    a, b = shared_chunk_then_different_next_token()
    sched = make_scheduler(draft_lookahead=1)
    pa = prefill(sched, "a", a, 1)
    pb = prefill(sched, "b", b, 20)
    assert [op.block_ids for op in pa.saves[0].ops] == [[1, 2]]
    assert [op.block_ids for op in pb.saves[0].ops] == [[20, 21]]  # b's blocks, its own key
    for name, p, blocks in (("a2", a, [40, 41]), ("b2", b, [50, 51])):
        sched.add_request(name)
        assert sched.lookup(name, p, 0) == C
        job = sched.start_load(name, C, [[*blocks, blocks[-1] + 1]])
        slot = job.ops[0].slot
        assert slot == (pa if name == "a2" else pb).saves[0].ops[0].slot


def test_a_chunk_is_keyed_once_its_next_token_is_known() -> None:
    keys = RequestKeys(NAMESPACE, C, lookahead=1)
    assert keys.update(tokens(C)) == 0  # token C not known yet
    assert keys.update(tokens(C + 1)) == 1
    plain = RequestKeys(NAMESPACE, C)
    assert plain.update(tokens(C)) == 1
    assert keys.keys[0] != plain.keys[0]  # another byte format: never each other's chunk


def test_a_prompt_of_whole_chunks_saves_its_last_chunk_after_the_first_sampled_token() -> None:
    # The last prompt position's draft KV is computed with the first sampled token, which is
    # final (the target's own sample): the chunk is saved in the next step, from its blocks.
    sched = make_scheduler(draft_lookahead=1)
    p = tokens(2 * C, seed=5)
    plan = prefill(sched, "a", p, 1)
    assert [j.chunk for j in plan.saves] == [0]  # chunk 1 waits for token 64
    sampled = [*p, 7]
    plan = sched.schedule_step(StepInput(
        cached=[CachedRequest("a", [[6]])],
        scheduled=[ScheduledTokens("a", sampled, 2 * C + 1, 2 * C)]))
    assert [(j.chunk, j.ops[0].block_ids) for j in plan.saves] == [(1, [3, 4])]


def test_generated_chunks_wait_for_the_next_chunk_while_drafts_run() -> None:
    # prompt 40 tokens; generation reaches 96 computed tokens in steps of 4 (3 drafts + 1)
    c, prompt = C, 40
    seen = []
    for computed in range(prompt, 100, 4):
        got = chunks_to_save(c, computed // c, 0, computed, prompt, True, volatile_tail=True)
        seen.append((computed, got.stop))
    # chunk 0 (next token 32 is a prompt token): saved when computed; chunk 1 (tokens
    # 32..63, generated from 40 on) only once chunk 2 is computed too (computed >= 96)
    assert dict(seen)[40] == 1 and dict(seen)[92] == 1 and dict(seen)[96] == 2
    # without drafts, chunk 1 is saved as soon as it is computed
    assert chunks_to_save(c, 2, 0, 64, prompt, True).stop == 2
