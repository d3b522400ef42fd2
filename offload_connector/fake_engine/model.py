"""The fake model: owns the "GPU" KV cache tensors, writes K/V for computed tokens and verifies reads.

KV cache layout: one tensor per layer, named like vLLM's attention layers, shaped
(2, num_gpu_blocks, block_size, num_kv_heads, head_dim) (K and V first, vLLM's flash-attention layout).

Per scheduled request and step, `forward` launches one piece of work on its compute queue that
1. verifies every token the request reads: all tokens before its `num_computed_tokens` (computed in
   earlier steps, GPU prefix-cache hits and blocks loaded from the CPU tier alike) must hold exactly the
   K/V `kv_pattern` expects; a mismatch increments `num_integrity_errors` and raises `IntegrityError`;
2. writes the K/V of the tokens it computes this step;
and, on the host, samples the next token (a function of the prefix, not of the KV) when the request's
known tokens are all computed. The compute queue (`ImmediateCompute` by default) runs the work at once;
`worker_side.cuda_sim.SimCompute` runs it on a simulated GPU's compute stream when the simulator decides,
so a transfer not fenced against the forward reads or writes KV at the wrong moment and the check fails.
The work captures everything it needs at launch (block ids, slots, expected values), never the request.
Per request it keeps the expected K/V of all known tokens (`ModelRequestState`, on the request), grown as
tokens are appended and dropped by `release` when the request is done. Verification is one gather and one
comparison per layer and request (whole blocks gathered): O(tokens read), no Python loop over tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

from offload_connector.config import ConfigError, EngineConfig
from offload_connector.fake_engine import kv_pattern
from offload_connector.fake_engine.request import EngineRequest
from worker_side.host_pool import mem_available_bytes

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory viewed as integers (int32 where the last dim allows), for bitwise comparison."""
    if (t.shape[-1] * t.element_size()) % 4 == 0:
        return t.view(torch.int32)
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


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
class ModelRequestState:
    seeds: torch.Tensor  # int64 (capacity,): prefix seed of each known token
    expected: torch.Tensor  # (num_layers, 2, capacity, num_kv_heads, head_dim)
    num_known: int = 0  # tokens whose seed and expected K/V are filled


class FakeModel:
    def __init__(self, engine: EngineConfig, num_gpu_blocks: int | None = None,
                 compute: ComputeQueue | None = None, rank: int = 0) -> None:
        self.rank = rank  # tensor-parallel rank: salts the K/V pattern (each rank holds a different shard)
        self.compute = compute if compute is not None else ImmediateCompute()
        _check_fits(engine, num_gpu_blocks or engine.num_gpu_blocks)
        self.block_size = engine.block_size
        self.num_gpu_blocks = num_gpu_blocks or engine.num_gpu_blocks
        self.dtype = _DTYPES[engine.dtype]
        self.shape = (engine.num_layers, 2, engine.num_kv_heads, engine.head_dim)
        self.kv_caches: dict[str, torch.Tensor] = {
            f"model.layers.{i}.self_attn.attn": self.compute.alloc(
                (2, self.num_gpu_blocks, self.block_size, engine.num_kv_heads, engine.head_dim), self.dtype)
            for i in range(engine.num_layers)
        }
        self._flat = [t.view(2, self.num_gpu_blocks * self.block_size, *t.shape[3:])
                      for t in self.kv_caches.values()]
        self._offsets = torch.arange(self.block_size, dtype=torch.int64)
        self.num_integrity_errors = 0
        self.num_verified_tokens = 0

    @property
    def bytes_per_block(self) -> int:
        return sum(t[:, 0].numel() * t.element_size() for t in self.kv_caches.values())

    # ------------------------------------------------------------------ expected contents
    def _sync(self, req: EngineRequest) -> ModelRequestState:
        if req.model_state is None:
            req.model_state = {}
        st = req.model_state.get(self.rank)
        if st is None:
            cap = req.num_prompt_tokens + req.max_tokens
            st = req.model_state[self.rank] = ModelRequestState(
                torch.zeros(cap, dtype=torch.int64),
                torch.empty(self.shape[0], 2, cap, *self.shape[2:], dtype=self.dtype))
        n, end = st.num_known, req.num_tokens
        if n == end:
            return st
        if n == 0:
            st.seeds[:end] = kv_pattern.prefix_seeds(req.all_token_ids)
        else:
            seed = int(st.seeds[n - 1])
            for p in range(n, end):
                seed = kv_pattern.extend_seed(seed, req.all_token_ids[p], p)
                st.seeds[p] = seed
        positions = torch.arange(n, end, dtype=torch.int64)
        st.expected[:, :, n:end] = kv_pattern.kv_values(st.seeds[n:end], positions, self.shape, self.dtype, self.rank)
        st.num_known = end
        return st

    def release(self, req: EngineRequest) -> None:
        req.model_state = None

    def _block_ids(self, gpu_block_ids: list[int], first_token: int, end_token: int) -> torch.Tensor:
        """The request's GPU block ids holding tokens [first_token, end_token), as a tensor."""
        first, last = first_token // self.block_size, -(-end_token // self.block_size)
        if last > len(gpu_block_ids):
            raise RuntimeError(f"fake model: {end_token} tokens need {last} blocks, the request has "
                               f"{len(gpu_block_ids)} (engine bug)")
        return torch.tensor(gpu_block_ids[first:last], dtype=torch.int64)

    def _slots(self, gpu_block_ids: list[int], start: int, end: int) -> torch.Tensor:
        """Flat token slots (block id * block_size + offset) of tokens [start, end)."""
        ids = self._block_ids(gpu_block_ids, start, end)
        first = (start // self.block_size) * self.block_size
        slots = (ids.unsqueeze(1) * self.block_size + self._offsets).flatten()
        return slots[start - first:end - first]

    # ------------------------------------------------------------------ one step
    def forward(self, chunks: list[tuple[EngineRequest, int]]) -> dict[str, int]:
        """Launch one step: for each (request, num_new_tokens) verify its reads and write its new K/V.

        Returns the sampled token of each request whose known tokens are all computed after this step.
        Requests' `num_computed_tokens` are the counts before this step (the engine advances them).
        """
        sampled: dict[str, int] = {}
        for req, num_new in chunks:
            st = self._sync(req)
            start = req.num_computed_tokens
            end = start + num_new
            gpu_block_ids = list(req.gpu_block_ids)
            read_ids = self._block_ids(gpu_block_ids, 0, start) if start else None
            self.compute.launch(partial(self._run, req.request_id, gpu_block_ids, read_ids, st.expected, start,
                                        self._slots(gpu_block_ids, start, end), st.expected[:, :, start:end]))
            if end == req.num_tokens:
                sampled[req.request_id] = kv_pattern.next_token(int(st.seeds[end - 1]), end - 1)
        return sampled

    def _run(self, request_id: str, gpu_block_ids: list[int], read_ids: torch.Tensor | None,
             expected: torch.Tensor, num_read: int, new_slots: torch.Tensor, new_kv: torch.Tensor) -> None:
        """The work of one request's step on the compute queue: check what it reads, write what it computes."""
        if read_ids is not None:
            self._verify(request_id, gpu_block_ids, read_ids, expected, num_read)
        for layer, flat in enumerate(self._flat):
            flat.index_copy_(1, new_slots, new_kv[layer])

    def _verify(self, request_id: str, gpu_block_ids: list[int], ids: torch.Tensor, expected: torch.Tensor,
                num: int) -> None:
        """Check the K/V of the request's first `num` tokens, gathered block by block."""
        self.num_verified_tokens += num
        for layer, cache in enumerate(self.kv_caches.values()):
            got = cache.index_select(1, ids).flatten(1, 2)[:, :num]
            want = expected[layer, :, :num]
            if torch.equal(_bits(got), _bits(want)):  # bitwise: exact, and far faster than float compare
                continue
            bad = (got != want).flatten(2).any(2).any(0).nonzero().flatten().tolist()
            bad_blocks = sorted({gpu_block_ids[p // self.block_size] for p in bad})
            self.num_integrity_errors += 1
            raise IntegrityError(
                f"request {request_id}: layer {layer} holds wrong K/V at {len(bad)} of {num} token "
                f"positions read (first position {bad[0]}), GPU blocks {bad_blocks[:16]}"
                f"{' ...' if len(bad_blocks) > 16 else ''}")
