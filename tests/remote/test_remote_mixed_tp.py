"""A fleet of mixed tensor-parallel sizes sharing one real redis-server: records per KV head, keyed without
the rank (remote/format.py, worker_side/tiers/head_rows.py).

The fake engines here run a head-sharded model (`shard_heads`): 4 KV heads, all on the one rank of a TP 1
engine, heads 0-1 and 2-3 on the ranks of a TP 2 engine, each head's K/V the same function of the tokens
whatever the TP. Engine A computes some prefixes (its stores are written to the server); engine B, of the
other TP and with an empty CPU tier, then sees each prefix once: its CPU hits come from the server, each
rank's heads reassembled from the parts A's ranks wrote. The fake model verifies every K/V byte each
request reads against what the model computes, so a wrong, swapped or partial head is an integrity error;
outputs must equal an engine's without any connector.
"""

from __future__ import annotations

import pytest
from redis_servers import redis_server  # noqa: F401 - fixture
from remote_helpers import clean, one_per_prefix, prefixes, reference_outputs, remote_config, worker_counter

from offload_connector.fake_engine import FakeEngine
from offload_connector.fake_engine.workload import Workload, run_workload

HEADS = 4
PREFIX_BLOCKS = 6  # a prefix of `prefixes()` is 24 tokens: 6 blocks of 4


def fleet_config(url: str, heads: int = HEADS):
    cfg = remote_config(url)
    cfg.engine.num_kv_heads = heads
    return cfg


def write_prefixes(url: str, tp: int, wl: Workload, heads: int = HEADS) -> int:
    """Engine A at `tp` computes `wl`; returns the blocks its ranks wrote (each rank's share counted)."""
    with FakeEngine(fleet_config(url, heads), tp_size=tp, shard_heads=True) as a:
        run_workload(a, wl)
        clean(a)
        return worker_counter(a, "written_blocks")


def read_prefixes(url: str, tp: int, wl: Workload, heads: int = HEADS) -> FakeEngine:
    """Engine B at `tp`, empty CPU tier, runs `wl` to the end; the caller checks and closes it."""
    b = FakeEngine(fleet_config(url, heads), tp_size=tp, shard_heads=True)
    run_workload(b, wl)
    clean(b)
    return b


@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(1, 2), (2, 1)])
def test_blocks_written_at_one_tp_are_hits_at_the_other(redis_server, writer_tp, reader_tp) -> None:  # noqa: F811
    shared = prefixes(21, 6)
    wl_b = one_per_prefix("b", shared, 3)
    # 1. engine A writes every block of the prefixes: one record per KV head, whatever A's TP
    assert write_prefixes(redis_server.url, writer_tp, one_per_prefix("a", shared, 2)) > 0
    keys = redis_server.cli("KEYS", "*").split()
    assert keys and all(":tp" not in k for k in keys)  # keyed without the rank
    assert {k.split(":")[4] for k in keys} == {f"h{h}of{HEADS}" for h in range(HEADS)}
    # 2. engine B at the other TP: its only hits come from the server, every byte verified by its model
    b = read_prefixes(redis_server.url, reader_tp, wl_b)
    try:
        hit_blocks = b.connector.tiers["remote"].counters.lookup_hit_blocks
        assert hit_blocks > 0 and worker_counter(b, "fetched_blocks") == reader_tp * hit_blocks
        assert b.stats.gpu_hit_tokens + b.stats.cpu_hit_tokens == 4 * PREFIX_BLOCKS * 6
        assert b.stats.cpu_hit_tokens >= 4 * PREFIX_BLOCKS * 5
        assert worker_counter(b, "corrupt_blocks") == 0 and worker_counter(b, "errors") == 0
        assert b.outputs == reference_outputs(wl_b)
    finally:
        b.close()


@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(1, 2), (2, 1)])
def test_a_head_every_rank_holds_is_one_record_read_by_every_rank(redis_server, writer_tp, reader_tp) -> None:  # noqa: F811
    # one KV head (MLA's latent): every rank of a TP 2 engine holds it whole; it is one record
    shared = prefixes(22, 4)
    assert write_prefixes(redis_server.url, writer_tp, one_per_prefix("a", shared, 2), heads=1) > 0
    assert {k.split(":")[4] for k in redis_server.cli("KEYS", "*").split()} == {"h0of1"}
    wl_b = one_per_prefix("b", shared, 3)
    b = read_prefixes(redis_server.url, reader_tp, wl_b, heads=1)
    try:
        hit_blocks = b.connector.tiers["remote"].counters.lookup_hit_blocks
        assert hit_blocks > 0 and worker_counter(b, "fetched_blocks") == reader_tp * hit_blocks
        assert b.outputs == reference_outputs(wl_b)
    finally:
        b.close()


def test_a_block_with_only_one_ranks_heads_written_is_a_miss(redis_server) -> None:  # noqa: F811
    shared = prefixes(23, 4)
    assert write_prefixes(redis_server.url, 2, one_per_prefix("a", shared, 2)) > 0
    # rank 1's slice never arrived (its writes dropped, or evicted): only heads 0-1 of each block are there
    upper = [k for k in redis_server.cli("KEYS", "*").split() if k.split(":")[4] in ("h2of4", "h3of4")]
    assert upper and int(redis_server.cli("DEL", *upper)) == len(upper)
    wl_b = one_per_prefix("b", shared, 3)
    b = read_prefixes(redis_server.url, 2, wl_b)
    try:
        remote = b.connector.tiers["remote"].counters
        assert remote.lookup_blocks > 0 and remote.lookup_hit_blocks == 0  # half a block is no block
        assert worker_counter(b, "fetched_blocks") == 0 and b.stats.cpu_hit_tokens == 0
        assert b.outputs == reference_outputs(wl_b)
    finally:
        b.close()


def test_a_corrupted_head_is_a_miss_for_its_block_only(redis_server) -> None:  # noqa: F811
    shared = prefixes(24, 1)
    assert write_prefixes(redis_server.url, 1, one_per_prefix("a", shared, 2)) > 0
    # one byte of one head's record of one block changed (the header intact): rank 1 of B reads it
    victim = sorted(k for k in redis_server.cli("KEYS", "*").split() if k.split(":")[4] == "h3of4")[0]
    redis_server.cli("SETRANGE", victim, "30", "X")
    wl_b = one_per_prefix("b", shared, 3)
    b = read_prefixes(redis_server.url, 2, wl_b)
    try:
        ranks = [w.tier_ios["remote"].counters for w in b.workers]
        assert (ranks[0].corrupt_blocks, ranks[1].corrupt_blocks) == (0, 1)  # refused by checksum: a miss
        # the block was recomputed, so the fetched run ends before it; every byte B read is verified right
        hit_blocks = b.connector.tiers["remote"].counters.lookup_hit_blocks
        assert hit_blocks == PREFIX_BLOCKS and ranks[0].fetched_blocks == PREFIX_BLOCKS
        assert ranks[1].fetched_blocks == PREFIX_BLOCKS - 1
        assert b.outputs == reference_outputs(wl_b)
    finally:
        b.close()
