"""`FinishHolds`: the GPU blocks the lazy policy holds for a finishing request until the next store event.

A finishing request's blocks enter vLLM's free queue now, but the lazy scan sees them only at the next
step's metadata, after that step's allocations; where the free queue is short those allocations could
evict them unsaved. `hold` takes the request's computed, hashed blocks that are not saved (nor dead) in
block order, as many as the caller allows; the scheduler takes one GPU reference on each. `release`, at the
next `pick_stores`, ends every hold: the held blocks still unsaved become that step's first picks, and all
of them are listed for release (a picked one's reference passes to the store event). O(blocks of the
request) per hold, O(held blocks) per release.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from offload_connector.hashing import group_suffix
from scheduler_side.policies.store_policy import StorePicks, StorePolicyView
from scheduler_side.request_state import RequestState


class FinishHolds:
    def __init__(self, view: StorePolicyView) -> None:
        self.view = view
        self._suffix = group_suffix(view.group_id)  # a block hash + this = its key (`with_group_id`)
        self._held: dict[bytes, int] = {}  # key -> GPU block held for the next store event

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, state: RequestState, room: int) -> list[int]:
        """Hold up to `room` of the finishing request's computed blocks that are not saved: their ids."""
        view, held, suffix = self.view, self._held, self._suffix
        n = state.num_computed_tokens // view.block_size
        cached, reserved = view.saved_key_maps()
        # (comprehensions: most of a finishing request's blocks are saved already)
        unsaved = [(key, gpu_id) for key, gpu_id in zip([h + suffix for h in state.request.block_hashes[:n]],
                                                        state.gpu_block_ids[:n], strict=False)  # (shorter)
                   if gpu_id and key not in cached and key not in reserved and key not in held]
        if view.may_have_dead():
            unsaved = [(key, gpu_id) for key, gpu_id in unsaved if not view.is_dead(key)]
        del unsaved[room:]
        held.update(unsaved)
        return [gpu_id for _, gpu_id in unsaved]

    def release(self, cached: Mapping[bytes, object], reserved: Mapping[bytes, object],
                dead: Callable[[bytes], bool] | None) -> StorePicks:
        """End every hold: picks of the held blocks still unsaved (one may have reached the CPU since: a lower
        tier's fetch), with every held block listed for release."""
        held, self._held = self._held, {}
        picks = StorePicks(release_gpu_ids=list(held.values()))
        for key, gpu_id in held.items():
            if key not in cached and key not in reserved and not (dead and dead(key)):
                picks.gpu_ids.append(gpu_id)
                picks.keys.append(key)
        return picks
