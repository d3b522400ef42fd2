"""The fake model: owns the "GPU" KV cache tensors, writes K/V for computed tokens and verifies reads.

KV cache layout: one tensor per layer, named like vLLM's attention layers, shaped
(2, num_gpu_blocks, block_size, num_kv_heads, head_dim) (K and V first, vLLM's flash-attention layout).

Per step, `forward` launches work on its compute queue (one piece for all scheduled requests when the
queue runs it at once, one piece per request, in scheduling order, when it runs it later) that
1. writes the K/V of the tokens each request computes this step;
2. then verifies every token each request reads: all tokens before its `num_computed_tokens` (computed in
   earlier steps, GPU prefix-cache hits, blocks loaded from the CPU tier and blocks an earlier request of
   the same step computes alike) must hold exactly the K/V `kv_pattern` expects; a mismatch increments
   `num_integrity_errors` and raises `IntegrityError` naming the first request (in step order) that read
   wrong K/V, its positions and GPU blocks.
Writes before reads is a real forward's order: each layer stores the batch's new K/V, then attends.
On the host it samples the next token (a function of the prefix, not of the KV) of each request whose
known tokens are all computed. The compute queue (`ImmediateCompute` by default) runs the work at once;
`worker_side.testing.sim_compute.SimCompute` runs it on a simulated GPU's compute stream when the simulator decides,
so a transfer not fenced against the forward reads or writes KV at the wrong moment and the check fails.
The work captures everything it needs at launch (slots, copies of the expected values), never a request.
Hybrid mode (`engine.sliding_window`): even layers are full attention (KV-cache group 0), odd layers attend
only to the last `sliding_window` tokens (group 1); each group's layers write and read through that group's
block table (`EngineRequest.group_block_ids`), and group 1 reads only the blocks inside its window (vLLM's
rule, `scheduler_side.groups.KVGroup.first_needed_block`): one piece of work per group.
Expected K/V are computed once per token, for all of a step's new tokens at once, and kept per live
request (`expected_kv.ExpectedKV`, released by `release` when the request is done). Per layer, a piece of
work gathers and compares bitwise the whole blocks its requests read (a block a row, against the expected
pages laid out alike) and the tokens of their last, partial blocks, then scatters the tokens computed: no
Python loop over tokens or blocks, a few list operations per request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import numpy as np
import torch

from offload_connector.config import ConfigError, EngineConfig
from offload_connector.fake_engine import kv_pattern
from offload_connector.fake_engine.expected_kv import ExpectedKV, TokenRuns
from offload_connector.fake_engine.request import EngineRequest
from offload_connector.sizing import mem_available_bytes
from scheduler_side.groups import KVGroup

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_INTS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory viewed as the widest integers the last dim allows, for bitwise comparison."""
    row_bytes = t.shape[-1] * t.element_size()
    return t.view(next(dtype for size, dtype in _INTS.items()
                       if row_bytes % size == 0 and size >= t.element_size()))


def _index(ids: list[int]) -> torch.Tensor:
    """An int64 index tensor (through numpy: three times faster than torch.tensor on a list)."""
    return torch.from_numpy(np.asarray(ids, dtype=np.int64))


def _bytes_differ(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """(2, rows, ...) K and V rows: per row and byte of a row, whether K or V differs there."""
    return (got.view(torch.uint8) != want.view(torch.uint8)).any(0)


def _check_fits(engine: EngineConfig, num_gpu_blocks: int) -> None:
    """Refuse a "GPU" KV cache larger than the host's available memory before allocating it."""
    need = (engine.num_layers * 2 * num_gpu_blocks * engine.block_size * engine.num_kv_heads * engine.head_dim
            * torch.empty(0, dtype=_DTYPES[engine.dtype]).element_size())
    available = mem_available_bytes()
    if available is not None and need > available:
        raise ConfigError("engine.num_gpu_blocks", num_gpu_blocks,
                          f"at most {available * num_gpu_blocks // need} here",
                          f"the fake GPU KV cache would take {need / 2**30:.1f} GiB, "
                          f"{available / 2**30:.1f} GiB is available")


class IntegrityError(RuntimeError):
    """A block a request reads does not hold the K/V its tokens must have: data was lost or misplaced."""


class ComputeQueue(Protocol):
    """Where the fake model's KV tensors live and its forward runs (the engine's compute stream)."""

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...
    def launch(self, fn: Callable[[], None]) -> None: ...
    def synchronize(self) -> None: ...


class ImmediateCompute:
    """Host tensors; the forward's work runs at once on the calling thread (CPU engines)."""

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype)

    def launch(self, fn: Callable[[], None]) -> None:
        fn()

    def synchronize(self) -> None:
        return


@dataclass(slots=True)
class _Reader:
    """One request's reads in a piece of work, for naming it in an IntegrityError."""

    request_id: str
    num_tokens: int  # tokens read, its first: whole blocks, then a tail of num_tokens % block_size
    gpu_block_ids: list[int]  # the blocks holding them, in token order


@dataclass(slots=True)
class _Work:
    """What one piece of work needs, captured at launch. Reads are whole blocks (compared as rows) then each
    reader's tail tokens; expected values are copies, laid out (num_layers * 2, ...) like `ExpectedKV`."""

    layers: list[int]  # the layers this work writes and checks (one KV-cache group's)
    readers: list[_Reader]
    read_blocks: torch.Tensor  # GPU block ids of the readers' whole blocks, reader by reader
    want_blocks: torch.Tensor  # (len(layers) * 2, len(read_blocks), block_size * heads * dim)
    tail_slots: torch.Tensor  # GPU slots of the readers' tail tokens, reader by reader
    want_tail: torch.Tensor  # (layers * 2, len(tail_slots), heads * dim)
    write_slots: torch.Tensor  # GPU slots of the tokens computed
    new_kv: torch.Tensor  # (layers * 2, len(write_slots), heads * dim)


class FakeModel:
    def __init__(self, engine: EngineConfig, num_gpu_blocks: int | None = None,
                 compute: ComputeQueue | None = None, rank: int = 0, heads: tuple[int, int] | None = None) -> None:
        """`heads` = (first, count): this rank holds KV heads first..first+count-1 of the model's
        `engine.num_kv_heads` (a head-sharded model: values by head, the same at any TP); None: it holds
        `engine.num_kv_heads` heads of its own (values salted by the rank)."""
        self.rank = rank  # tensor-parallel rank: salts the K/V pattern (each rank holds a different shard)
        self.compute = compute if compute is not None else ImmediateCompute()
        _check_fits(engine, num_gpu_blocks or engine.num_gpu_blocks)
        self.block_size = engine.block_size
        self.num_gpu_blocks = num_gpu_blocks or engine.num_gpu_blocks
        self.dtype = _DTYPES[engine.dtype]
        num_heads = engine.num_kv_heads if heads is None else heads[1]
        self.shape = (engine.num_layers, 2, num_heads, engine.head_dim)
        self.kv_caches: dict[str, torch.Tensor] = {
            f"model.layers.{i}.self_attn.attn": self.compute.alloc(
                (2, self.num_gpu_blocks, self.block_size, num_heads, engine.head_dim), self.dtype)
            for i in range(engine.num_layers)
        }
        token_values = num_heads * engine.head_dim
        self._blocks = [t.view(2, self.num_gpu_blocks, -1) for t in self.kv_caches.values()]  # a block a row
        self._flat = [t.view(2, -1, token_values) for t in self.kv_caches.values()]  # a token a row
        self.expected = ExpectedKV(self.shape, self.block_size, self.dtype, rank,
                                   None if heads is None else (heads[0], engine.num_kv_heads))
        window = engine.sliding_window
        self.groups = (KVGroup(0),) if window is None else (KVGroup(0), KVGroup(1, window=window))
        layers = range(engine.num_layers)
        self.group_layers = [list(layers)] if window is None else [list(layers[0::2]), list(layers[1::2])]
        self._group_rows = [None if window is None else _index([r for layer in g for r in (2 * layer, 2 * layer + 1)])
                            for g in self.group_layers]  # rows of the expected values, per group
        # Work run at once gains nothing from being cut: one piece per step. A queue that runs it later (a
        # simulated GPU stream) gets one piece per request, like a real forward's many kernels, so the
        # simulator can interleave copies between them.
        self.one_launch_per_step = isinstance(self.compute, ImmediateCompute)
        self.num_integrity_errors = 0
        self.num_verified_tokens = 0

    @property
    def bytes_per_block(self) -> int:
        return sum(t[:, 0].numel() * t.element_size() for t in self.kv_caches.values())

    def release(self, req: EngineRequest) -> None:
        """The request is done: drop the expected K/V kept for it."""
        self.expected.release(req)

    def check_integrity(self, live: Iterable[EngineRequest]) -> None:
        self.expected.check_integrity(live)

    # ------------------------------------------------------------------ one step
    def forward(self, chunks: list[tuple[EngineRequest, int]]) -> dict[str, int]:
        """Launch one step: for each (request, num_new_tokens) write its new K/V and verify its reads.

        Returns the sampled token of each request whose known tokens are all computed after this step.
        Requests' `num_computed_tokens` are the counts before this step (the engine advances them).
        """
        sampled: dict[str, int] = {}
        if not chunks:
            return sampled
        self.expected.sync(req for req, _ in chunks)
        pieces = [chunks] if self.one_launch_per_step else [[chunk] for chunk in chunks]
        for piece in pieces:
            for g in range(len(self.groups)):
                self._launch(piece, sampled, g)
        return sampled

    def _launch(self, chunks: list[tuple[EngineRequest, int]], sampled: dict[str, int], g: int = 0) -> None:
        """One piece of work for these requests and KV-cache group `g`: slots and expected values captured
        now, run by the queue."""
        bs, group, hybrid = self.block_size, self.groups[g], len(self.groups) > 1
        read_blocks: list[int] = []
        read_pages: list[int] = []
        tails, writes = TokenRuns(bs, 2), TokenRuns(bs, 2)
        readers: list[_Reader] = []
        for req, num_new in chunks:
            st = self.expected.state(req)
            start = req.num_computed_tokens
            end = start + num_new
            gpu_block_ids = req.group_block_ids[g] if hybrid else req.gpu_block_ids
            if -(-end // bs) > len(gpu_block_ids):
                raise RuntimeError(f"fake model: request {req.request_id} computes up to token {end} but holds "
                                   f"{len(gpu_block_ids)} blocks of {bs} tokens (engine bug)")
            if start:
                num_full = start // bs
                first = min(group.first_needed_block(start, bs), num_full)  # 0 but in a window group
                read_blocks.extend(gpu_block_ids[first:num_full])
                read_pages.extend(st.pages[first:num_full])
                tails.add(num_full * bs, start, gpu_block_ids, st.pages)
                readers.append(_Reader(req.request_id, start - first * bs, gpu_block_ids[first:-(-start // bs)]))
            writes.add(start, end, gpu_block_ids, st.pages)
            if end == req.num_tokens and g == 0:
                sampled[req.request_id] = kv_pattern.next_token(st.last_seed, end - 1)
        tail_slots, tail_pages = tails.slots()
        write_slots, write_pages = writes.slots()
        gather, rows = self.expected, self._group_rows[g]

        def want(values: torch.Tensor) -> torch.Tensor:
            return values if rows is None else values.index_select(0, rows)

        work = _Work(self.group_layers[g], readers, _index(read_blocks), want(gather.gather_pages(_index(read_pages))),
                     tail_slots, want(gather.gather_tokens(tail_pages)),
                     write_slots, want(gather.gather_tokens(write_pages)))
        self.compute.launch(partial(self._run, work))

    def _run(self, work: _Work) -> None:
        """A piece of work on the compute queue: write what its requests compute, then check their reads."""
        for k, layer in enumerate(work.layers):
            self._flat[layer].index_copy_(1, work.write_slots, work.new_kv[2 * k:2 * k + 2])
        if not work.readers:
            return
        self.num_verified_tokens += sum(r.num_tokens for r in work.readers)
        for k, layer in enumerate(work.layers):
            blocks, flat = self._blocks[layer], self._flat[layer]
            got_blocks = blocks.index_select(1, work.read_blocks)
            got_tail = flat.index_select(1, work.tail_slots)
            want_blocks = work.want_blocks[2 * k:2 * k + 2]
            want_tail = work.want_tail[2 * k:2 * k + 2]
            # bitwise: exact, and far faster than a float compare
            if (torch.equal(_bits(got_blocks), _bits(want_blocks))
                    and torch.equal(_bits(got_tail), _bits(want_tail))):
                continue
            self.num_integrity_errors += 1
            token_bytes = flat.shape[2] * flat.element_size()
            raise self._integrity_error(work.readers, layer,
                                        _bytes_differ(got_blocks, want_blocks).view(-1, token_bytes).any(1),
                                        _bytes_differ(got_tail, want_tail).any(1))

    def _integrity_error(self, readers: list[_Reader], layer: int, bad_block_tokens: torch.Tensor,
                         bad_tail: torch.Tensor) -> IntegrityError:
        """Name the first reader (in step order) that read wrong K/V: its positions and GPU blocks.

        `bad_block_tokens` flags the tokens of the whole blocks read, `bad_tail` the tail tokens (reader by
        reader, both).
        """
        in_blocks = in_tail = 0
        for reader in readers:
            num_full = reader.num_tokens // self.block_size * self.block_size
            num_tail = reader.num_tokens - num_full
            bad = torch.cat([bad_block_tokens[in_blocks:in_blocks + num_full],
                             bad_tail[in_tail:in_tail + num_tail]])
            in_blocks, in_tail = in_blocks + num_full, in_tail + num_tail
            if not bad.any():
                continue
            positions = bad.nonzero().flatten().tolist()
            blocks = sorted({reader.gpu_block_ids[p // self.block_size] for p in positions})
            return IntegrityError(
                f"request {reader.request_id}: layer {layer} holds wrong K/V at {len(positions)} of "
                f"{reader.num_tokens} token positions read (first position {positions[0]}), GPU blocks "
                f"{blocks[:16]}{' ...' if len(blocks) > 16 else ''}")
        raise RuntimeError(f"fake model: layer {layer} differs but no reader's tokens do (our bug)")
