"""Serving workloads (docs/design.md §4) as seeded streams of token-id requests.

A workload hands out :class:`RequestSpec` objects in issue order and is told when each one
completed. Contracts:

- Deterministic: the same shape and seed give the same prompts in the same order (for the
  multi-turn workload, given the same outputs fed back through :meth:`Workload.complete`).
- Unbounded, except a trace: a workload never runs dry; the driver stops it after a count or
  a duration. :meth:`Workload.next_request` returns ``None`` when every next request depends
  on a request still in flight (a session's next turn needs its previous turn's output), or
  for good once :attr:`Workload.exhausted` (a replayed trace has no more records).
- ``reuse_tokens`` of a spec is the number of leading prompt tokens whose KV an earlier
  request has already computed (issued *and* completed earlier, in issue order). It is what a
  prefix cache could serve at best; :meth:`RequestSpec.restorable` rounds it down to whole
  chunks, which is what kvtier can restore at best.
- Token ids are drawn from ``[FIRST_TOKEN, vocab)``: ids 0-2 are left out because models
  commonly use them as pad/bos/eos.
"""

from __future__ import annotations

import json
import random
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar

FIRST_TOKEN = 3


@dataclass(frozen=True)
class RequestSpec:
    """One request to send. ``group`` names what it shares with others (a prefix, a session)."""

    index: int
    prompt: list[int] = field(repr=False)
    max_tokens: int
    group: str
    reuse_tokens: int = 0
    turn: int = 0
    at: float | None = None  # seconds after the run's start, for a replayed trace's timing

    @property
    def repeat(self) -> bool:
        """True when part of the prompt was computed by an earlier request."""
        return self.reuse_tokens > 0

    def restorable(self, chunk_tokens: int) -> int:
        """The reused tokens that lie in whole chunks of ``chunk_tokens``."""
        return self.reuse_tokens // chunk_tokens * chunk_tokens


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN, vocab) for _ in range(n)]


class Workload(ABC):
    """A seeded, unbounded stream of requests (see the module contract)."""

    name: ClassVar[str]
    needs_output_ids: ClassVar[bool] = False
    exhausted: bool = False  # no request will ever come again

    def __init__(self, seed: int, vocab: int) -> None:
        if vocab <= FIRST_TOKEN + 1:
            raise ValueError(f"vocab must be larger than {FIRST_TOKEN + 1}, got {vocab}")
        self.seed = seed
        self.vocab = vocab
        self.rng = random.Random(seed)
        self._issued = 0

    def _next_index(self) -> int:
        i = self._issued
        self._issued += 1
        return i

    @abstractmethod
    def next_request(self) -> RequestSpec | None:
        """The next request in issue order, or None while it waits on one in flight."""

    def complete(self, spec: RequestSpec, output_ids: list[int] | None, n_output: int,
                 ok: bool = True) -> None:
        """``spec`` finished with these output token ids (None: the server sent no ids) and
        this many output tokens; ``ok`` is False when it failed. The default does nothing."""
        return None

    @abstractmethod
    def shape(self) -> dict[str, Any]:
        """The workload's shape, for reports."""


class SharedPrefix(Workload):
    """P prefixes of PL tokens; each request = one prefix + a unique SL-token suffix, OL output
    tokens. ``round-robin`` order makes every prefix come back after all the others were
    used, which is what pushes it out of a small HBM prefix cache before it returns."""

    name = "shared-prefix"

    def __init__(self, prefixes: int = 8, prefix_len: int = 2048, suffix_len: int = 256,
                 output_len: int = 16, order: str = "round-robin", seed: int = 0,
                 vocab: int = 1000) -> None:
        super().__init__(seed, vocab)
        if prefixes < 1 or prefix_len < 1 or suffix_len < 0 or output_len < 1:
            raise ValueError("shared-prefix needs prefixes, prefix_len, output_len >= 1 and "
                             "suffix_len >= 0")
        if order not in ("round-robin", "random"):
            raise ValueError(f"order must be 'round-robin' or 'random', got {order!r}")
        self.prefix_len, self.suffix_len, self.output_len = prefix_len, suffix_len, output_len
        self.order = order
        self.prefixes = [_tokens(self.rng, prefix_len, vocab) for _ in range(prefixes)]
        self._computed: set[str] = set()  # prefixes a completed request has computed

    def next_request(self) -> RequestSpec:
        i = self._next_index()
        if self.order == "round-robin":
            p = i % len(self.prefixes)
        else:
            p = self.rng.randrange(len(self.prefixes))
        group = f"prefix-{p}"
        reuse = self.prefix_len if group in self._computed else 0
        prompt = self.prefixes[p] + _tokens(self.rng, self.suffix_len, self.vocab)
        return RequestSpec(i, prompt, self.output_len, group, reuse)

    def complete(self, spec: RequestSpec, output_ids: list[int] | None, n_output: int,
                 ok: bool = True) -> None:
        if ok:
            self._computed.add(spec.group)

    def shape(self) -> dict[str, Any]:
        return {"workload": self.name, "prefixes": len(self.prefixes),
                "prefix_len": self.prefix_len, "suffix_len": self.suffix_len,
                "output_len": self.output_len, "order": self.order, "seed": self.seed}


@dataclass
class _Session:
    sid: int
    turn: int = 0
    context: list[int] = field(default_factory=list)  # last prompt + its output
    computed: int = 0  # tokens of ``context`` whose KV the last turn computed
    busy: bool = False


class AgentSessions(Workload):
    """Interleaved multi-turn agent sessions. Turn 0 is a unique FIRST-token prompt; turn k is
    the previous prompt + the previous output + a tool result + a new message. After TURNS
    turns a session ends and a new one takes its place, so SESSIONS are always active.

    The previous output enters the next prompt as the token ids the server returned; a server
    that returns no ids gets the same number of stand-in tokens, drawn from the seed (then the
    output part of the prompt is not what the model generated, and cannot be a cache hit)."""

    name = "agent-sessions"
    needs_output_ids = True

    def __init__(self, sessions: int = 8, turns: int = 6, first_len: int = 2048,
                 tool_len: int = 256, message_len: int = 64, output_len: int = 64,
                 seed: int = 0, vocab: int = 1000) -> None:
        super().__init__(seed, vocab)
        if sessions < 1 or turns < 1 or first_len < 1 or output_len < 1:
            raise ValueError("agent-sessions needs sessions, turns, first_len, output_len >= 1")
        if tool_len < 0 or message_len < 0:
            raise ValueError("tool_len and message_len must be >= 0")
        self.turns, self.first_len = turns, first_len
        self.tool_len, self.message_len, self.output_len = tool_len, message_len, output_len
        self._next_sid = 0
        self.sessions: deque[_Session] = deque(self._new_session() for _ in range(sessions))

    def _new_session(self) -> _Session:
        s = _Session(self._next_sid)
        self._next_sid += 1
        return s

    def next_request(self) -> RequestSpec | None:
        for _ in range(len(self.sessions)):
            s = self.sessions[0]
            self.sessions.rotate(-1)  # round-robin over the sessions
            if s.busy:
                continue
            if s.turn == 0:
                prompt = _tokens(self.rng, self.first_len, self.vocab)
                reuse = 0
            else:
                prompt = (s.context + _tokens(self.rng, self.tool_len, self.vocab)
                          + _tokens(self.rng, self.message_len, self.vocab))
                reuse = s.computed
            s.busy = True
            s.context = prompt
            return RequestSpec(self._next_index(), prompt, self.output_len,
                               f"session-{s.sid}", reuse, turn=s.turn)
        return None

    def complete(self, spec: RequestSpec, output_ids: list[int] | None, n_output: int,
                 ok: bool = True) -> None:
        i = next((k for k, s in enumerate(self.sessions)
                  if f"session-{s.sid}" == spec.group and s.busy), None)
        if i is None:
            raise KeyError(f"no busy session for {spec.group}")
        s = self.sessions[i]
        if not ok:  # a failed turn ends its session: its context was never computed
            self.sessions[i] = self._new_session()
            return
        if output_ids is None or len(output_ids) != n_output:
            output_ids = _tokens(random.Random(f"{self.seed}-{spec.index}"), n_output,
                                 self.vocab)
        # the last output token is sampled but never fed back, so its KV does not exist
        s.computed = len(s.context) + max(0, len(output_ids) - 1)
        s.context = s.context + list(output_ids)
        s.turn += 1
        s.busy = False
        if s.turn >= self.turns:
            self.sessions[i] = self._new_session()

    def shape(self) -> dict[str, Any]:
        return {"workload": self.name, "sessions": len(self.sessions), "turns": self.turns,
                "first_len": self.first_len, "tool_len": self.tool_len,
                "message_len": self.message_len, "output_len": self.output_len,
                "seed": self.seed}


class NoReuse(Workload):
    """Every prompt unique (PROMPT_LEN random tokens): measures the cost of having kvtier on."""

    name = "no-reuse"

    def __init__(self, prompt_len: int = 2048, output_len: int = 16, seed: int = 0,
                 vocab: int = 1000) -> None:
        super().__init__(seed, vocab)
        if prompt_len < 1 or output_len < 1:
            raise ValueError("no-reuse needs prompt_len and output_len >= 1")
        self.prompt_len, self.output_len = prompt_len, output_len

    def next_request(self) -> RequestSpec:
        i = self._next_index()
        return RequestSpec(i, _tokens(self.rng, self.prompt_len, self.vocab), self.output_len,
                           f"unique-{i}")

    def shape(self) -> dict[str, Any]:
        return {"workload": self.name, "prompt_len": self.prompt_len,
                "output_len": self.output_len, "seed": self.seed}


@dataclass(frozen=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: str) -> list[TraceRecord]:
    """An aiperf/Mooncake-style JSONL trace: one object per line with ``input_length``,
    ``output_length``, ``hash_ids`` and optionally ``timestamp`` (ms). Raises ValueError
    naming the line of a bad record."""
    records = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                rec = TraceRecord(float(d.get("timestamp", 0)), int(d["input_length"]),
                                  int(d["output_length"]), tuple(int(h) for h in d["hash_ids"]))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a trace record ({e})") from None
            if rec.input_length < 1 or rec.output_length < 1:
                raise ValueError(f"{path}:{n}: input_length and output_length must be >= 1")
            records.append(rec)
    if not records:
        raise ValueError(f"{path}: the trace has no records")
    return records


class TraceReplay(Workload):
    """Replays a trace (:func:`read_trace`) in file order, once. Hash id ``h`` stands for a
    fixed block of BLOCK_SIZE tokens (Mooncake's traces: 512), the same wherever it appears
    (drawn from the seed and ``h``), so requests sharing leading hash ids share those prompt
    tokens. A prompt is its blocks cut to ``input_length``; tokens past its last block are
    unique. ``at`` is the record's timestamp relative to the first record's."""

    name = "trace"

    def __init__(self, path: str, block_size: int = 512, seed: int = 0, vocab: int = 1000
                 ) -> None:
        super().__init__(seed, vocab)
        if block_size < 1:
            raise ValueError(f"trace block size must be >= 1, got {block_size}")
        self.path, self.block_size = path, block_size
        self.records = read_trace(path)
        self._t0 = self.records[0].timestamp_ms
        self._blocks: dict[int, list[int]] = {}
        self._computed: dict[int, int] = {}  # hash id -> its tokens that a completed request had
        self._prompt_ids: dict[int, tuple[int, ...]] = {}  # spec index -> its hash ids

    def _block(self, h: int) -> list[int]:
        if h not in self._blocks:
            self._blocks[h] = _tokens(random.Random(f"{self.seed}-block-{h}"), self.block_size,
                                      self.vocab)
        return self._blocks[h]

    def _reuse(self, rec: TraceRecord) -> int:
        reuse = 0
        for i, h in enumerate(rec.hash_ids):
            need = min(self.block_size, rec.input_length - i * self.block_size)
            if need <= 0:
                break
            have = self._computed.get(h, 0)
            reuse += min(have, need)
            if have < need:
                break
        return min(reuse, rec.input_length)

    def next_request(self) -> RequestSpec | None:
        if self._issued >= len(self.records):
            self.exhausted = True
            return None
        i = self._next_index()
        rec = self.records[i]
        prompt = [t for h in rec.hash_ids for t in self._block(h)][: rec.input_length]
        prompt += _tokens(self.rng, rec.input_length - len(prompt), self.vocab)
        self._prompt_ids[i] = rec.hash_ids
        group = f"trace-{rec.hash_ids[0]}" if rec.hash_ids else f"unique-{i}"
        return RequestSpec(i, prompt, rec.output_length, group, self._reuse(rec),
                           at=(rec.timestamp_ms - self._t0) / 1000.0)

    def complete(self, spec: RequestSpec, output_ids: list[int] | None, n_output: int,
                 ok: bool = True) -> None:
        hash_ids = self._prompt_ids.pop(spec.index, ())
        if not ok:
            return
        for i, h in enumerate(hash_ids):
            n = min(self.block_size, len(spec.prompt) - i * self.block_size)
            if n > 0:
                self._computed[h] = max(self._computed.get(h, 0), n)

    def shape(self) -> dict[str, Any]:
        return {"workload": self.name, "trace": self.path, "records": len(self.records),
                "block_size": self.block_size, "seed": self.seed}


WORKLOADS: dict[str, type[Workload]] = {
    w.name: w for w in (SharedPrefix, AgentSessions, NoReuse, TraceReplay)
}


def warmup_prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    """Prompts for warm-up requests, from a stream independent of every workload's."""
    rng = random.Random(f"warmup-{seed}")
    return [_tokens(rng, length, vocab) for _ in range(n)]
