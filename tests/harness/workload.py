"""Seeded scenarios: the engine's shape, the requests and the faults of one harness run.

Everything is drawn from ``random.Random(seed)``, so a scenario is reproduced from its seed and
the few switches it was generated with (:func:`make_scenario`).

Workload features: prefixes shared by several requests, multi-turn sessions (a turn's prompt
is the previous prompt, its output and a new message), long and short prompts, aborts (also of
requests parked for a load), priorities, preemption under block pressure (few blocks, chunked
prefill), ``reset_prefix_cache`` (with and without the connector), and recycled request ids.
Faults: see :class:`FaultPlan`.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field

from .content import FIRST_TOKEN, VOCAB, generate

BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024

GROUP_SETS: dict[str, tuple[str, ...]] = {
    "full": ("full",),
    "full+swa": ("full", "swa"),  # sliding window + full attention (Gemma-like)
    "full+mamba": ("full", "mamba"),  # recurrent state + attention (Qwen3-Next-like)
    "full+mamba+mamba": ("full", "mamba", "mamba"),  # several state groups
}
"""The KV-cache group sets a scenario can have: group 0 is always full attention (two layers,
:data:`~.compat.LAYERS`); every further group has one layer of its kind. ``mamba`` groups run
vLLM's ``align`` state addressing (the state after ``n`` tokens in block ``(n - 1) // 16``)."""

MULTI_GROUP_SETS = ("full+swa", "full+mamba", "full+mamba+mamba")


@dataclass
class FaultPlan:
    """Transport faults (probabilities per transfer) and engine-level fault switches."""

    exec_delay_p: float = 0.0  # a copy runs up to exec_delay_max steps after it was submitted
    exec_delay_max: int = 0
    notify_delay_p: float = 0.0  # its completion notice arrives up to notify_delay_max later
    notify_delay_max: int = 0
    reorder: bool = False  # due copies and notices run in random order
    duplicate_p: float = 0.0  # a notice delivered twice
    drop_p: float = 0.0  # a notice never delivered (ground truth stays queryable)
    load_fail_p: float = 0.0  # a load copies nothing and fails
    load_partial_p: float = 0.0  # a load copies some of its chunks, then fails
    save_fail_p: float = 0.0  # a save copies part of its chunk, then fails
    late_rank: int | None = None  # this rank's copies and notices run late_steps later
    late_steps: int = 0
    lone_fail_rank: int | None = None  # load failures happen on this rank only
    # layer-by-layer loads: a step's forward skips every layer wait (a replayed CUDA graph)
    skip_layer_wait_p: float = 0.0
    # a batch of one-token queries replays a FULL CUDA graph (no layer hook runs): vLLM's
    # default where a graph of the batch's size was captured (not a fault: always on)
    full_graph_replay_p: float = 0.5

    def kinds(self) -> list[str]:
        out = []
        for name in ("exec_delay_p", "notify_delay_p", "duplicate_p", "drop_p", "load_fail_p",
                     "load_partial_p", "save_fail_p"):
            if getattr(self, name) > 0:
                out.append(name[:-2])
        if self.reorder:
            out.append("reorder")
        if self.late_rank is not None:
            out.append("late_rank")
        if self.lone_fail_rank is not None:
            out.append("lone_fail_rank")
        if self.skip_layer_wait_p > 0:
            out.append("skip_layer_wait")
        return out

    def max_lateness(self) -> int:
        """Steps a completion can take to reach the worker, at most."""
        late = self.late_steps if self.late_rank is not None else 0
        return (self.exec_delay_max + self.notify_delay_max + 2) + 2 * late


@dataclass
class ReqSpec:
    key: str  # unique within the scenario
    req_id: str  # vLLM's request id (recycled ids repeat an earlier spec's)
    prompt: list[int]
    max_tokens: int
    arrival: int  # earliest step
    priority: int = 0
    after: str | None = None  # a spec that must have finished first (next turn of a session)
    gap: int = 0  # steps after ``after`` finished
    abort_after: int | None = None  # abort this many steps after it was added
    abort_when_parked: bool = False  # abort as soon as it waits for a load
    recycles: str | None = None  # the spec whose id this one reuses
    cache_salt: str | None = None  # tenant: never shares KV with another salt
    skip_prefix_cache: bool = False  # e.g. prompt logprobs: every token must be computed


@dataclass
class Scenario:
    seed: int
    async_scheduling: bool
    world_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    chunk_tokens: int
    dram_size: str
    max_pending_saves: int
    policy: str
    admission: str
    sched_policy: str  # "fcfs" | "priority"
    requests: list[ReqSpec]
    resets: list[tuple[int, bool, bool]]  # (step, reset_running_requests, reset_connector)
    faults: FaultPlan
    max_pending_loads: int = 1024
    v2_runner: bool = False  # the scheduler talks to Model Runner V2 (resumed = new requests)
    min_steps: int = 50
    max_steps: int = 600
    tags: list[str] = field(default_factory=list)  # engine-level fault kinds switched on
    groups: tuple[str, ...] = ("full",)  # a value of GROUP_SETS
    sliding_window: int = 0  # tokens, for "swa" groups
    state_size: str | None = None  # kvtier's state_size (None: its default)
    admission_defers: bool = False  # kvtier's cache_aware_admission
    layerwise: bool = False  # kvtier's layerwise_loads (one full-attention group only)

    @property
    def group_set(self) -> str:
        return "+".join(self.groups)

    def describe(self) -> str:
        groups = "" if self.groups == ("full",) else (
            f"groups={self.group_set}"
            + (f"(w={self.sliding_window})" if self.sliding_window else "") + " ")
        return (f"{groups}seed={self.seed} async={self.async_scheduling} ws={self.world_size} "
                f"blocks={self.num_blocks} seqs={self.max_num_seqs} "
                f"batched={self.max_num_batched_tokens} chunk={self.chunk_tokens} "
                f"dram={self.dram_size} save_q={self.max_pending_saves} "
                f"load_q={self.max_pending_loads} "
                f"{'v2 ' if self.v2_runner else ''}{self.policy}/"
                f"{self.admission}/{self.sched_policy} reqs={len(self.requests)} "
                f"resets={self.resets} faults={self.faults.kinds()} tags={self.tags}"
                + (" admission" if self.admission_defers else "")
                + (" layerwise" if self.layerwise else ""))


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(n)]


ALL_FAULTS = ("exec_delay", "notify_delay", "reorder", "duplicate", "drop", "load_fail",
              "load_partial", "save_fail", "late_rank", "lone_fail_rank", "save_queue_full",
              "slab_full")


def make_faults(rng: random.Random, world_size: int, kinds: set[str]) -> FaultPlan:
    f = FaultPlan()
    if "exec_delay" in kinds:
        f.exec_delay_p, f.exec_delay_max = rng.uniform(0.2, 0.8), rng.randint(1, 4)
    if "notify_delay" in kinds:
        f.notify_delay_p, f.notify_delay_max = rng.uniform(0.2, 0.8), rng.randint(1, 4)
    f.reorder = "reorder" in kinds
    if "duplicate" in kinds:
        f.duplicate_p = rng.uniform(0.1, 0.5)
    if "drop" in kinds:
        f.drop_p = rng.uniform(0.05, 0.3)
    if "load_fail" in kinds:
        f.load_fail_p = rng.uniform(0.1, 0.5)
    if "load_partial" in kinds:
        f.load_partial_p = rng.uniform(0.1, 0.5)
    if "save_fail" in kinds:
        f.save_fail_p = rng.uniform(0.05, 0.3)
    if world_size > 1 and "late_rank" in kinds:
        f.late_rank, f.late_steps = rng.randrange(world_size), rng.randint(1, 4)
    if world_size > 1 and "lone_fail_rank" in kinds:
        f.lone_fail_rank = rng.randrange(world_size)
        f.load_fail_p = max(f.load_fail_p, rng.uniform(0.2, 0.6))
    return f


def make_scenario(
    seed: int,
    async_scheduling: bool,
    world_size: int,
    fault_kinds: set[str] | None = None,
    groups: tuple[str, ...] = ("full",),
) -> Scenario:
    """A random scenario; ``fault_kinds`` (subset of :data:`ALL_FAULTS`) forces those on;
    ``groups`` (a value of :data:`GROUP_SETS`) its KV-cache groups. One full group draws the
    scenarios it always drew (the seeds of earlier findings still replay)."""
    mix = 0 if groups == ("full",) else zlib.crc32("+".join(groups).encode())
    rng = random.Random(seed * 1_000_003 + 7919 * world_size + int(async_scheduling) + mix)
    if fault_kinds is None:
        pool = [k for k in ALL_FAULTS if world_size > 1 or k not in ("late_rank",
                                                                      "lone_fail_rank")]
        n = rng.choice((1, 2, 2, 3, 3, 4, 5))
        fault_kinds = set(rng.sample(pool, n))
    faults = make_faults(rng, world_size, fault_kinds)
    chunk_tokens = BLOCK_SIZE * rng.choice((1, 2, 2, 3, 4))
    num_blocks = rng.randint(24, 72)
    max_num_seqs = rng.randint(2, 8)
    batched = rng.choice((32, 48, 64, 128, 256))
    batched = max(batched, max_num_seqs)
    # slab: small enough that it fills under this workload when asked for
    chunk_bytes = chunk_tokens * 2 * 8  # 2 layers x 8 bytes per position, one shard
    slot_stride = -(-chunk_bytes // 4096) * 4096  # kvtier aligns slots to 4 KiB
    shards = world_size
    if "slab_full" in fault_kinds:
        slots = rng.randint(2, 8)
    else:
        slots = rng.choice((24, 64, 256))
    dram = slots * slot_stride * shards
    kv_extra = sum(1 for g in groups if g != "mamba") - 1  # one layer each: half a chunk
    dram += kv_extra * slots * (-(-(chunk_bytes // 2) // 4096) * 4096) * shards
    n_state = groups.count("mamba")
    state_size = None
    if n_state:  # a 4 KiB slot per state object; the slab's state class gets its own share
        state_bytes = max(2, n_state * slots * 2 // 3) * 4096 * shards + 4096 * shards
        dram += state_bytes
        state_size = f"{state_bytes}B"
    dram_size = f"{dram}B"
    max_pending_saves = rng.randint(1, 3) if "save_queue_full" in fault_kinds else 256
    tags = sorted(k for k in fault_kinds if k in ("save_queue_full", "slab_full"))
    max_len_tokens = min(MAX_MODEL_LEN - 32, (num_blocks // 2) * BLOCK_SIZE)
    # every group draws from vLLM's one block pool: a full or sliding-window group needs a
    # table as long as group 0's, a state group (align) two blocks per running request
    num_blocks = (num_blocks * sum(1 for g in groups if g != "mamba")
                  + n_state * 2 * (max_num_seqs + 1))

    requests: list[ReqSpec] = []
    prefixes = [_tokens(rng, rng.choice((chunk_tokens, 2 * chunk_tokens, 3 * chunk_tokens,
                                         rng.randint(20, 240))))
                for _ in range(rng.randint(1, 3))]
    n_req = rng.randint(8, 14)
    arrivals = sorted(rng.randint(0, 44) for _ in range(n_req))
    arrivals[-1] = max(arrivals[-1], 40)
    sessions: list[str] = []
    for i, arrival in enumerate(arrivals):
        key = f"s{seed}-{i}"
        max_tokens = rng.choice((1, 2, 4, 8, 12, 20))
        kind = rng.random()
        after = None
        gap = 0
        if kind < 0.5:  # shared prefix + unique suffix
            prompt = list(rng.choice(prefixes)) + _tokens(rng, rng.randint(1, 60))
        elif kind < 0.75 and sessions:  # the next turn of an earlier request
            prev_key = rng.choice(sessions)
            prev = next(r for r in requests if r.key == prev_key)
            prompt = (prev.prompt + generate(prev.prompt, prev.max_tokens)
                      + _tokens(rng, rng.randint(1, 24)))
            after, gap = prev_key, rng.randint(0, 3)
        elif kind < 0.85:  # short
            prompt = _tokens(rng, rng.randint(3, 40))
        else:  # long and unique: pushes the others out of the HBM prefix cache
            prompt = _tokens(rng, rng.randint(120, 400))
        limit = max_len_tokens - max_tokens
        if len(prompt) > limit:
            prompt = prompt[:limit]
            after = None
        spec = ReqSpec(key, f"req-{i}", prompt, max_tokens, arrival,
                       priority=rng.randint(0, 3), after=after, gap=gap)
        t = rng.random()
        if t < 0.2:
            spec.cache_salt = rng.choice(("tenant-a", "tenant-b"))
        elif t < 0.26:
            spec.skip_prefix_cache = True
        r = rng.random()
        if r < 0.12:
            spec.abort_after = rng.randint(0, 12)
        elif r < 0.22:
            spec.abort_when_parked = True
        requests.append(spec)
        sessions.append(key)
    # recycled request ids: a later request reuses the id of an earlier one
    n_recycle = rng.randint(1, 3)
    recycled = 0
    while recycled < n_recycle:
        i = rng.randrange(1, len(requests))
        j = rng.randrange(0, i)
        if requests[i].recycles is None and requests[j].key != requests[i].after:
            requests[i].req_id = requests[j].req_id
            requests[i].recycles = requests[j].key
            recycled += 1
    resets = []  # mostly HBM only: what kvtier holds must come back through loads
    for _ in range(rng.choice((0, 1, 2, 3, 4, 5, 6))):
        resets.append((rng.randint(4, 60), rng.random() < 0.6, rng.random() < 0.15))
    v2_runner = rng.random() < 0.25
    max_pending_loads = rng.choice((1, 2)) if rng.random() < 0.15 else 1024
    window = 0
    if "swa" in groups:  # shorter and longer than a chunk, not always a multiple of it
        window = rng.choice((16, 32, 48, 64, 96))
    # drawn last, so every earlier draw (and the seeds of earlier findings) stays as it was
    layerwise = groups == ("full",) and rng.random() < 0.3
    if layerwise and rng.random() < 0.3:
        faults.skip_layer_wait_p = 0.2
    return Scenario(
        layerwise=layerwise,
        seed=seed, async_scheduling=async_scheduling, world_size=world_size, v2_runner=v2_runner,
        num_blocks=num_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=batched,
        chunk_tokens=chunk_tokens, dram_size=dram_size, max_pending_saves=max_pending_saves,
        policy=rng.choice(("lru", "slru", "s3fifo")),
        admission=rng.choice(("always", "always", "always", "second_sight")),
        sched_policy=rng.choice(("fcfs", "fcfs", "priority")),
        requests=requests, resets=sorted(resets), faults=faults, tags=tags,
        max_pending_loads=max_pending_loads, groups=tuple(groups), sliding_window=window,
        state_size=state_size,
    )
