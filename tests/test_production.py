"""Which chunks running requests are putting into HBM (kvtier.production), and the scheduler
half's answer to cache-aware admission built on it (OffloadScheduler.produced_until):
a prefilling request produces its prompt's chunks from where its computation reached until
its prompt is computed; a load produces the loaded chunks and the rest of the prompt; a
preempted or finished request produces nothing; a request never waits for itself."""

from __future__ import annotations

from kvtier.production import ChunkProducers
from kvtier.scheduler import NewRequest, OffloadScheduler, ScheduledTokens, StepInput
from test_scheduler import C, make_scheduler, stored, table, tokens


def test_producers_register_once_and_stop_idempotently() -> None:
    p = ChunkProducers()
    p.produce("a", [b"k1", b"k2"])
    p.produce("a", [b"k3"])  # already registered: keeps its keys
    assert p.producer(b"k1") == "a" and p.producer(b"k3") is None and len(p) == 1
    p.produce("b", [b"k2"])
    assert p.producer(b"k2") in {"a", "b"}
    p.stop("a")
    p.stop("a")
    assert p.producer(b"k1") is None and p.producer(b"k2") == "b" and not p.producing("a")
    p.stop("b")
    assert len(p) == 0 and p.producer(b"k2") is None
    p.produce("c", [])
    assert not p.producing("c")


def waits(sched: OffloadScheduler, req_id: str, tokens: list[int], hbm_tokens: int) -> bool:
    """Whether ``req_id`` waits for a producer: another request produces its next chunk."""
    return sched.produced_until(req_id, tokens, hbm_tokens) > 0


def make(admission: bool = True) -> OffloadScheduler:
    return make_scheduler(cache_aware_admission=admission)


def test_a_waiting_request_waits_while_another_computes_its_next_chunk() -> None:
    sched = make()
    prompt = tokens(5 * C + 3)
    other = tokens(5 * C + 3, seed=7)
    sched.add_request("a")
    sched.add_request("b")
    sched.add_request("x")
    # a computes its first two chunks this step (chunked prefill): chunks 2..4 are to come
    sched.schedule_step(StepInput(new=[NewRequest("a", table(1, 11))],
                                  scheduled=[ScheduledTokens("a", prompt, 2 * C, len(prompt))]))
    # b's HBM hit reaches what a computed: its next chunk (2) is a's to compute
    assert waits(sched, "b", prompt, 2 * C)
    assert waits(sched, "b", prompt, 2 * C + 16)  # inside chunk 2
    assert not waits(sched, "b", prompt, 5 * C)  # past a's whole chunks
    assert not waits(sched, "x", other, 0)  # another prefix
    assert not waits(sched, "a", prompt, 2 * C)  # never itself
    # a's prompt is computed: it produces nothing more (b's hit covers it next step)
    sched.schedule_step(StepInput(scheduled=[ScheduledTokens("a", prompt, len(prompt),
                                                             len(prompt), 2 * C)]))
    assert not waits(sched, "b", prompt, 2 * C)


def test_a_load_produces_its_chunks_until_preemption_or_finish() -> None:
    sched = make()
    prompt = tokens(4 * C + 3)
    sched.add_request("w")
    stored(sched, "w", prompt, table(1, 9))
    sched.add_request("a")
    sched.add_request("b")
    assert sched.lookup("a", prompt, 0) == 4 * C
    sched.start_load("a", 4 * C, table(20, 9))
    assert waits(sched, "b", prompt, 0)  # a is loading chunk 0
    sched.schedule_step(StepInput(preempted=["a"]))
    assert not waits(sched, "b", prompt, 0)
    sched.add_request("a")  # the id comes back as a new lifecycle
    assert sched.lookup("a", prompt, 0) == 4 * C
    sched.start_load("a", 4 * C, table(40, 9))
    assert waits(sched, "b", prompt, C)
    sched.request_finished("a")
    assert not waits(sched, "b", prompt, C)


def test_without_admission_nothing_is_tracked() -> None:
    sched = make(admission=False)
    prompt = tokens(5 * C)
    sched.add_request("a")
    sched.add_request("b")
    sched.schedule_step(StepInput(new=[NewRequest("a", table(1, 10))],
                                  scheduled=[ScheduledTokens("a", prompt, C, len(prompt))]))
    assert sched.producers is None and not waits(sched, "b", prompt, C)


def test_produced_until_is_the_end_of_the_chunks_other_requests_put_into_hbm() -> None:
    """A sibling shares a's first three chunks and then differs: its hit will reach the end of
    the third once a's prefill is done, wherever it stands now; a request with no producer for
    its next chunk gets 0."""
    sched = make()
    prompt = tokens(5 * C + 3)
    sibling = prompt[:3 * C] + tokens(2 * C, seed=9)
    sched.add_request("a")
    sched.add_request("s")
    sched.schedule_step(StepInput(new=[NewRequest("a", table(1, 11))],
                                  scheduled=[ScheduledTokens("a", prompt, C, len(prompt))]))
    # a computed chunk 0 this step (in HBM: the sibling's hit covers it) and produces 1..4
    assert sched.produced_until("s", sibling, C) == 3 * C
    assert sched.produced_until("s", sibling, 2 * C + 5) == 3 * C
    assert sched.produced_until("s", sibling, 3 * C) == 0  # its next chunk is its own
    assert sched.produced_until("a", prompt, 0) == 0  # never itself
