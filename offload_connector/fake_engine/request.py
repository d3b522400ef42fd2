"""One request of the fake engine: its tokens, block hashes, GPU blocks and lifecycle status.

Lifecycle (vLLM v1's): WAITING -> (WAITING_FOR_REMOTE_KVS while a CPU load is in flight -> WAITING) ->
RUNNING -> FINISHED, with RUNNING -> PREEMPTED (back to the front of the waiting queue, KV recomputed)
and ABORTED reachable from any unfinished status.

Invariants:
- `block_hashes` covers every *full* block of `all_token_ids` (prompt and output), chained, and grows
  as output tokens are appended; partial blocks have no hash.
- `gpu_block_ids` are the request's GPU blocks in token order; the engine holds one reference on each.
- `num_computed_tokens <= num_tokens`; the K/V of tokens before it are in `gpu_block_ids`.
- `num_cached_blocks` blocks at the front are registered in the GPU prefix cache (or were hits).
- `load_gpu_block_ids` is non-empty only while status is WAITING_FOR_REMOTE_KVS.
Only the engine's scheduler changes this state; the fake model reads it and keeps `model_state`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from offload_connector.hashing import BlockHash, hash_request_tokens


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"

    @property
    def is_done(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.ABORTED)


@dataclass(slots=True, eq=False)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    block_size: int
    hash_algo: str = "xxh3_128"
    kv_transfer_params: dict[str, Any] | None = None  # per-request connector hints, as vLLM's Request has
    all_token_ids: list[int] = field(init=False)
    output_token_ids: list[int] = field(default_factory=list, init=False)
    block_hashes: list[BlockHash] = field(init=False)
    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    num_computed_tokens: int = field(default=0, init=False)
    gpu_block_ids: list[int] = field(default_factory=list, init=False)
    # Hybrid mode (gpu_cache.py): one block list per KV-cache group, [0] being `gpu_block_ids` itself.
    group_block_ids: list[list[int]] = field(default_factory=list, init=False)
    num_cached_blocks: int = field(default=0, init=False)
    load_gpu_block_ids: list[int] = field(default_factory=list, init=False)  # CPU load in flight
    load_done: bool = field(default=False, init=False)  # the worker reported the load finished
    load_num_tokens: int = field(default=0, init=False)  # tokens the load in flight brings back
    load_issue_step: int = field(default=0, init=False)
    failed_load_gpu_blocks: set[int] = field(default_factory=set, init=False)
    is_first_admission: bool = field(default=True, init=False)  # hit counters count the first one only
    num_gpu_hit_tokens: int = field(default=0, init=False)  # at the first admission
    num_cpu_hit_tokens: int = field(default=0, init=False)  # at the first admission, failed blocks excluded
    num_ever_computed: int = field(default=0, init=False)  # high-water mark of num_computed_tokens
    model_state: Any = field(default=None, init=False)  # owned by the fake models: rank -> expected K/V

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: empty prompt")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_tokens must be >= 1, got {self.max_tokens}")
        self.all_token_ids = list(self.prompt_token_ids)
        self.block_hashes = hash_request_tokens(self.all_token_ids, self.block_size, algo=self.hash_algo)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_num_tokens(self) -> int:
        """Tokens whose K/V the request may ever need (the last output token is never computed)."""
        return self.num_prompt_tokens + self.max_tokens - 1

    @property
    def is_finished(self) -> bool:
        return len(self.output_token_ids) >= self.max_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        num_full = self.num_tokens // self.block_size
        if num_full > len(self.block_hashes):
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.extend(hash_request_tokens(
                self.all_token_ids, self.block_size, algo=self.hash_algo,
                start=len(self.block_hashes), parent=parent))
