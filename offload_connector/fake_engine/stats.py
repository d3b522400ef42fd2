"""Running counters of the fake engine, and the report a replay prints.

Prompt-token accounting: each request's prompt is counted once, at its first admission, split into
`gpu_hit_tokens` (GPU prefix cache), `cpu_hit_tokens` (loaded from the CPU tier; a failed load's tokens
move to computed) and the rest, `computed_prompt_tokens` (derived). Re-admissions after a preemption are
counted apart (`num_preemptions`, `recomputed_tokens`). Counters only grow; O(1) updates where events happen.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class HitSample:
    """One request's first admission, for hit-ratio-over-time plots."""

    step: int
    prompt_tokens: int
    gpu_hit_tokens: int
    cpu_hit_tokens: int


@dataclass(slots=True)
class EngineStats:
    requests: int = 0  # added
    finished_requests: int = 0
    aborted_requests: int = 0
    rejected_requests: int = 0  # longer than the GPU pool can ever hold
    prompt_tokens: int = 0
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    output_tokens: int = 0
    computed_tokens: int = 0  # every token the model computed (prompt and output, recomputes included)
    recomputed_tokens: int = 0  # computed again after a preemption or a failed load
    num_preemptions: int = 0
    num_loads: int = 0
    load_wait_steps: int = 0  # summed over loads: steps from issue to completion (issuing step included)
    max_load_wait_steps: int = 0
    failed_load_blocks: int = 0
    gpu_evictions: int = 0  # cached GPU blocks evicted by allocation
    gpu_evictions_unsaved: int = 0  # ... whose content was neither on the CPU tier nor being stored (lost)
    bytes_stored: int = 0
    bytes_loaded: int = 0
    steps: int = 0
    idle_steps: int = 0  # steps that computed nothing (waiting for transfers)
    integrity_errors: int = 0
    verified_tokens: int = 0
    leaked_blocks: int = 0  # GPU + CPU blocks still referenced after the engine drained
    leaked_gpu_blocks: int = 0
    leaked_cpu_blocks: int = 0
    samples: list[HitSample] = field(default_factory=list)
    # Hybrid mode, per KV-cache group (0: full attention, 1: sliding window): blocks taken from the GPU
    # prefix cache at first admissions, and blocks loaded from the CPU tier. Empty with one group.
    group_gpu_hit_blocks: list[int] = field(default_factory=list)
    group_loaded_blocks: list[int] = field(default_factory=list)

    @property
    def computed_prompt_tokens(self) -> int:
        return self.prompt_tokens - self.gpu_hit_tokens - self.cpu_hit_tokens

    def ratio(self, tokens: int) -> float:
        return tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict[str, float | int]:
        out = asdict(self)
        del out["samples"]
        if not self.group_loaded_blocks:
            del out["group_gpu_hit_blocks"], out["group_loaded_blocks"]
        out["computed_prompt_tokens"] = self.computed_prompt_tokens
        out["gpu_hit_ratio"] = round(self.ratio(self.gpu_hit_tokens), 6)
        out["cpu_hit_ratio"] = round(self.ratio(self.cpu_hit_tokens), 6)
        out["hit_ratio"] = round(self.ratio(self.gpu_hit_tokens + self.cpu_hit_tokens), 6)
        return out
