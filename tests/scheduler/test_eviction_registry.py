"""The CPU tier's eviction policies by name: the registry, the interface a new policy implements, and the
per-block state each policy keeps on its own block type."""

from __future__ import annotations

import typing
from collections.abc import Iterator

import pytest

from offload_connector.config import ConfigError, OffloadConfig, load_config
from scheduler_side import BlockPool
from scheduler_side.pool.block import Block
from scheduler_side.pool.eviction import registry
from scheduler_side.pool.eviction.arc import ArcBlock, ArcEviction
from scheduler_side.pool.eviction.base import EvictionPolicy
from scheduler_side.pool.eviction.lru import LruEviction
from scheduler_side.pool.free_queue import FreeBlockQueue


def test_the_config_offers_exactly_the_registered_policies() -> None:
    allowed = typing.get_args(typing.get_type_hints(OffloadConfig)["eviction"])
    assert tuple(registry.EVICTION_POLICIES) == allowed, (
        "a policy in scheduler_side/pool/eviction/registry.py and the config's `eviction` choices "
        "(offload_connector/config.py) must name the same policies")
    for name in allowed:
        assert registry.eviction_policy(name).empty_first  # the CPU tier never evicts before it is full
    with pytest.raises(ConfigError, match="eviction.*'lfu'.*'lru' \\| 'arc'"):
        load_config({"eviction": "lfu"})


def test_an_unknown_name_is_refused_naming_the_key_and_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown eviction 'fifo'; allowed: lru, arc"):
        registry.eviction_policy("fifo")
    with pytest.raises(ValueError, match="allowed: lru, arc"):
        BlockPool(4, eviction="fifo")


def test_each_policy_keeps_its_block_state_on_its_own_block_type() -> None:
    assert not hasattr(Block(1), "reused") and not hasattr(Block(1), "seg")
    assert all(type(b) is ArcBlock for b in BlockPool(4, eviction="arc").blocks)
    assert all(not hasattr(b, "reused") for b in BlockPool(4, eviction="lru").blocks)
    assert all(type(b) is Block for b in BlockPool(4).blocks)  # an engine's GPU pool: one LRU order
    assert isinstance(BlockPool(4, eviction="lru").free_queue, LruEviction)
    assert isinstance(BlockPool(4, eviction="arc").free_queue, ArcEviction)
    assert isinstance(BlockPool(4).free_queue, FreeBlockQueue)
    assert ArcEviction.wants_hints and not LruEviction.wants_hints


class MruEviction(EvictionPolicy):
    """A policy written against the interface alone: free empty blocks first, then the most recently freed
    cached block (a stack), as a new module would be."""

    def __init__(self, blocks: list[Block], history: int | None = None) -> None:
        self.empty = FreeBlockQueue(blocks)
        self.stack: list[Block] = []

    @property
    def num_free_blocks(self) -> int:
        return self.empty.num_free_blocks + len(self.stack)

    def __iter__(self) -> Iterator[Block]:
        yield from self.empty
        yield from reversed(self.stack)

    def popleft_n(self, n: int) -> list[Block]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"popleft_n({n}) with {self.num_free_blocks} free")
        out = self.empty.popleft_n(min(n, self.empty.num_free_blocks))
        while len(out) < n:
            out.append(self.stack.pop())
        return out

    def append_n(self, blocks: list[Block]) -> None:
        for block in blocks:
            self.empty.append(block) if block.block_hash is None else self.stack.append(block)

    def prepend_n(self, blocks: list[Block]) -> None:
        for block in reversed(blocks):
            self.appendleft(block)

    def appendleft(self, block: Block) -> None:
        self.empty.appendleft(block) if block.block_hash is None else self.stack.append(block)

    def remove(self, block: Block) -> None:
        if block in self.stack:  # O(n): fine for a test, not for a real policy
            self.stack.remove(block)
        else:
            self.empty.remove(block)

    def on_cached(self, block: Block, key: bytes) -> None:
        if block.ref_cnt == 0:  # cached while free: refile it
            self.remove(block)
            self.append(block)

    def on_uncached(self, block: Block) -> None:
        if block.ref_cnt == 0 and block in self.stack:
            self.stack.remove(block)
            self.empty.appendleft(block)


def test_a_new_policy_is_one_class_and_one_registry_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.EVICTION_POLICIES, "mru", MruEviction)
    pool = BlockPool(6, eviction="mru")  # 5 usable blocks
    blocks = pool.allocate(3)
    for i, block in enumerate(blocks):
        pool.cache(block, b"k%d" % i)
    pool.free(blocks)  # k2 freed last: the most recently used
    assert [b.block_id for b in pool.allocate(2)] == [4, 5]  # empty blocks first
    (victim,) = pool.allocate(1)
    assert victim is blocks[2] and pool.lookup(b"k2") is None and pool.num_evictions == 1
    assert pool.allocate(3) is None and pool.num_free_blocks == 2  # short: refused, nothing changed
    pool.check_integrity()
