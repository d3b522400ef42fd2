"""When a copy job goes to the block-copy kernel and when to the copy engines (DMA), per direction.

A job's DMA form is its segments (copy_plan: one per run of blocks and plane). The kernel takes a job of
direction `kind` when the policy has a rule for `kind`, the job has at least `min_segments` segments and
they average at most `max_segment_bytes`; otherwise one batched DMA call. Defaults are vLLM's H100
measurements (vLLM #42212, its kv_offload/cpu/swap_blocks_triton.py) until our own GPU figures replace
them: the kernel only host -> device (loads), below 28 KiB per segment, from 16 segments on; device -> host
(stores) always by DMA, where the copy engines reach full bandwidth without taking SMs from the forward.
The calibration (calibration.py) replaces a direction's rule with what it measured on the device, or drops
it; it never adds a direction the configuration left out. Immutable: the backend swaps whole policies.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from worker_side.backends.base import JobKind

KERNEL_MAX_SEGMENT_BYTES = 28 << 10  # vLLM's THRESHOLD_BYTES (H100, PCIe Gen5)
KERNEL_MIN_SEGMENTS = 16  # vLLM's MIN_N
KERNEL_DIRECTIONS: tuple[JobKind, ...] = ("load",)  # vLLM: host -> device only
KERNEL_MAX_SMS = 12  # vLLM's NUM_SMS: the smallest SM slice within 5% of peak bandwidth at 8-32 KiB


@dataclass(frozen=True, slots=True)
class KernelRule:
    max_segment_bytes: int  # the job's segments average at most this many bytes
    min_segments: int  # and number at least this many


@dataclass(frozen=True, slots=True)
class KernelPolicy:
    rules: Mapping[JobKind, KernelRule] = field(default_factory=dict)  # a direction without a rule: DMA only

    @staticmethod
    def make(directions: Iterable[JobKind], max_segment_bytes: int, min_segments: int) -> KernelPolicy:
        """The same rule for every direction named; none where `max_segment_bytes` is 0."""
        if max_segment_bytes <= 0:
            return KernelPolicy({})
        rule = KernelRule(max_segment_bytes, max(1, min_segments))
        return KernelPolicy({kind: rule for kind in directions})

    def use_kernel(self, kind: JobKind, num_segments: int, total_bytes: int) -> bool:
        rule = self.rules.get(kind)
        return (rule is not None and num_segments >= rule.min_segments
                and total_bytes <= rule.max_segment_bytes * num_segments)

    def with_rule(self, kind: JobKind, rule: KernelRule | None) -> KernelPolicy:
        rules = {k: r for k, r in self.rules.items() if k != kind}
        if rule is not None:
            rules[kind] = rule
        return KernelPolicy(rules)

    def describe(self) -> str:
        """One line: `load: kernel for segments averaging <= 28 KiB, >= 16 of them; store: DMA`."""
        parts = []
        for kind in ("load", "store"):
            rule = self.rules.get(kind)
            parts.append(f"{kind}: DMA" if rule is None else
                         f"{kind}: kernel for segments averaging <= {_size(rule.max_segment_bytes)}, "
                         f">= {rule.min_segments} of them (else DMA)")
        return "; ".join(parts)


def _size(nbytes: int) -> str:
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"
