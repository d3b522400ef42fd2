"""Which path a copy job takes, per direction: the staged path, the direct block-copy kernel, or DMA.

- Staged (staging.py): a device gather into a staging ring, then DMA of whole host blocks (loads the
  reverse). A direction in `staged` takes it for jobs of at least `staged[kind]` blocks (while the argument
  ring has room; else DMA).
- The direct kernel (segment_copy.cu `oc_block_copy`: the SMs read or write host memory): a job of direction
  `kind` when the policy has a rule for `kind`, the job has at least `min_segments` segments and they
  average at most `max_segment_bytes`. Off by default: it reaches the link on scattered segments but takes
  SMs from the forward for the whole copy (measured on an H200: a bf16 matmul slowed 4-41%).
- Otherwise one batched DMA call over the job's segments (copy_plan: one per run of blocks and plane).
The calibration (calibration.py) measures the paths on the device at this model's job shapes and keeps a
direction's staged or kernel setting only where it measured faster than the alternative; it never adds a
direction the configuration left out. Immutable: the backend swaps whole policies.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from worker_side.backends.base import JobKind

KERNEL_MAX_SEGMENT_BYTES = 28 << 10  # vLLM's THRESHOLD_BYTES (H100, PCIe Gen5)
KERNEL_MIN_SEGMENTS = 16  # vLLM's MIN_N
KERNEL_DIRECTIONS: tuple[JobKind, ...] = ()  # the direct kernel is opt-in: it slows the forward
KERNEL_MAX_SMS = 12  # vLLM's NUM_SMS: the smallest SM slice within 5% of peak bandwidth at 8-32 KiB


@dataclass(frozen=True, slots=True)
class KernelRule:
    max_segment_bytes: int  # the job's segments average at most this many bytes
    min_segments: int  # and number at least this many


@dataclass(frozen=True, slots=True)
class KernelPolicy:
    rules: Mapping[JobKind, KernelRule] = field(default_factory=dict)  # a direction without a rule: DMA only
    staged: Mapping[JobKind, int] = field(default_factory=dict)  # direction -> staged from this many blocks on

    @staticmethod
    def make(directions: Iterable[JobKind], max_segment_bytes: int, min_segments: int,
             staged: Iterable[JobKind] = ()) -> KernelPolicy:
        """The same kernel rule for every direction named (none where `max_segment_bytes` is 0); the staged
        path for every job of the `staged` directions."""
        stage = dict.fromkeys(staged, 1)
        if max_segment_bytes <= 0:
            return KernelPolicy({}, stage)
        rule = KernelRule(max_segment_bytes, max(1, min_segments))
        return KernelPolicy({kind: rule for kind in directions}, stage)

    def use_staged(self, kind: JobKind, num_blocks: int) -> bool:
        min_blocks = self.staged.get(kind)
        return min_blocks is not None and num_blocks >= min_blocks

    def with_staged(self, kind: JobKind, min_blocks: int | None) -> KernelPolicy:
        """This policy with `kind` staged from `min_blocks` blocks on (None: never)."""
        staged = {k: n for k, n in self.staged.items() if k != kind}
        if min_blocks is not None:
            staged[kind] = max(1, min_blocks)
        return KernelPolicy(self.rules, staged)

    def without_staged(self) -> KernelPolicy:
        return KernelPolicy(self.rules, {})

    def use_kernel(self, kind: JobKind, num_segments: int, total_bytes: int) -> bool:
        rule = self.rules.get(kind)
        return (rule is not None and num_segments >= rule.min_segments
                and total_bytes <= rule.max_segment_bytes * num_segments)

    def with_rule(self, kind: JobKind, rule: KernelRule | None) -> KernelPolicy:
        rules = {k: r for k, r in self.rules.items() if k != kind}
        if rule is not None:
            rules[kind] = rule
        return KernelPolicy(rules, self.staged)

    def describe(self) -> str:
        """One line: `load: staged; store: kernel for segments averaging <= 28 KiB, >= 16 of them (else DMA)`."""
        parts = []
        for kind in ("load", "store"):
            rule, staged = self.rules.get(kind), self.staged.get(kind)
            text = ("DMA" if rule is None else f"kernel for segments averaging <= {_size(rule.max_segment_bytes)}, "
                                               f">= {rule.min_segments} of them (else DMA)")
            if staged is not None:
                text = "staged" + (f" from {staged} blocks on (else {text})" if staged > 1 else "")
            parts.append(f"{kind}: {text}")
        return "; ".join(parts)


def _size(nbytes: int) -> str:
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"
