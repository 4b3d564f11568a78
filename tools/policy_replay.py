"""Replay the agent-session workload's chunk keys through kvtier's index and an eviction
policy, on CPU, round after round on one pool (as `kvtier bench serving --rounds N` does on
one server: each round a new seed, so a new set of sessions), and print the share of each
round's reusable tokens that a restore would cover.

Why: on the H200 (2026-12-03, `bench/gpu_agent.sh`, 32 GiB DRAM) kvtier restored 100% of the
reusable prefix tokens in round 1 and 82.9% in every later round, 16% below native's
throughput there; this replay gives 98.7% and 81.7% under the old SLRU and 98.7% in every
round under LRU, which located the cause in the policy (protected stayed full of round 1's
sessions, and every new session's first reuse missed).

The index is kvtier's own (:class:`kvtier.index.memory.MemoryIndex`: chained chunks, only
leaves evicted); requests run one at a time (the engine runs several at once: the order of
saves differs, the reuse distances hardly do); a request saves every full chunk of its
prompt past its hit, as the connector's save planner does; output tokens are the workload's
stand-ins. Defaults: the H200 run's shape at 256-token chunks of the Llama-8B shape (32 MiB
each; 1,024 chunks = 32 GiB).

    .venv/bin/python tools/policy_replay.py --policies lru,slru,s3fifo

It then replays the seed-scale loop of shared prefixes (issue 15) on a pool smaller than the
loop (`--loop-capacity`), where recency alone keeps nothing.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from kvtier.bench.workloads import AgentSessions
from kvtier.index.memory import GroupIndexSpec, MemoryIndex
from kvtier.keys import chunk_key
from kvtier.policy import make_policy
from kvtier.protocol import SaveDrop
from kvtier.slab import SlotAllocator


def replay(policy: str, capacity: int, *, rounds: int = 5, requests: int = 96,
           sessions: int = 16, turns: int = 6, first_len: int = 8192, tool_len: int = 1024,
           message_len: int = 256, output_len: int = 64, chunk_tokens: int = 256
           ) -> list[float]:
    """Per round: tokens a restore covers / tokens an earlier turn computed (reusable)."""
    index = MemoryIndex([GroupIndexSpec(0, make_policy(policy, capacity))],
                        SlotAllocator([capacity]))
    shares = []
    for seed in range(rounds):
        work = AgentSessions(sessions=sessions, turns=turns, first_len=first_len,
                             tool_len=tool_len, message_len=message_len,
                             output_len=output_len, seed=seed)
        covered = reusable = 0
        for _ in range(requests):
            spec = work.next_request()
            assert spec is not None  # one at a time: a session is always free
            keys: list[bytes] = []
            for i in range(len(spec.prompt) // chunk_tokens):
                keys.append(chunk_key(keys[-1] if keys else b"",
                                      spec.prompt[i * chunk_tokens:(i + 1) * chunk_tokens]))
            hit = index.match(0, keys)
            index.touch(0, keys[:hit])
            covered += min(hit * chunk_tokens, spec.reuse_tokens)
            reusable += spec.reuse_tokens
            for i in range(hit, len(keys)):
                entry = index.reserve(0, keys[i], keys[i - 1] if i else None)
                if isinstance(entry, SaveDrop):
                    break
                index.commit(entry)
            work.complete(spec, None, output_len)
        shares.append(covered / reusable if reusable else 1.0)
    return shares


def replay_prefix_loop(policy: str, capacity: int, *, prefixes: int = 16,
                       prefix_chunks: int = 108, per_prefix: int = 4,
                       suffix_chunks: int = 18, chunk_tokens: int = 256) -> float:
    """The seed-scale shape (issue 15: 16 prefixes of 27,648 tokens in round-robin order, 4
    requests each, 4,608-token suffixes that never return) one request at a time: the share
    of the prefix tokens of every request after a prefix's first that a restore covers."""
    index = MemoryIndex([GroupIndexSpec(0, make_policy(policy, capacity))],
                        SlotAllocator([capacity]))
    covered = reusable = 0
    for rep in range(per_prefix):
        for pre in range(prefixes):
            chunks = [[pre, i] for i in range(prefix_chunks)]
            chunks += [[1_000_000 + pre, rep, i] for i in range(suffix_chunks)]
            keys: list[bytes] = []
            for c in chunks:
                keys.append(chunk_key(keys[-1] if keys else b"", c * (chunk_tokens // len(c))))
            hit = index.match(0, keys)
            index.touch(0, keys[:hit])
            if rep:
                covered += min(hit, prefix_chunks)
                reusable += prefix_chunks
            for i in range(hit, len(keys)):
                entry = index.reserve(0, keys[i], keys[i - 1] if i else None)
                if isinstance(entry, SaveDrop):
                    break
                index.commit(entry)
    return covered / reusable


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policies", default="lru,slru,s3fifo")
    p.add_argument("--capacity", type=int, default=1024, help="chunks the pool holds")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--loop-capacity", type=int, default=1800,
                   help="chunks the pool holds in the prefix loop (it needs 2,016)")
    args = p.parse_args(argv)
    print(f"{'policy':<8} " + " ".join(f"round {r + 1:>2}" for r in range(args.rounds)))
    for name in args.policies.split(","):
        shares = replay(name, args.capacity, rounds=args.rounds)
        print(f"{name:<8} " + " ".join(f"{100 * s:7.1f}%" for s in shares))
    print(f"\nprefix loop (16 x 108 chunks, 18 one-off chunks per request, 4 passes), "
          f"{args.loop_capacity} slots:")
    for name in args.policies.split(","):
        print(f"{name:<8} {100 * replay_prefix_loop(name, args.loop_capacity):7.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
