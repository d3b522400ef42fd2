"""`SavedHead`: the lazy policy's knowledge of the head of the GPU free queue, so that a step reads only the
blocks that entered its budget since the last one.

The saved head is the free blocks from the queue's head up to the cursor (the last block scanned and not
picked) that the scan found saved, unhashed or dead, with the stored blocks put back among them. Invariant,
as far as the policy is told: every block of the saved head is free, lies between the queue's head and the
cursor, and has its content on the CPU tier (or none worth saving). Blocks leave it when the engine takes
them (`take`: its allocations and GPU hits) and when the tier drops their CPU copies (`on_copy_dropped`:
they are picked again at the next step, `save_again`). When the engine took the cursor's block, or the tier
dropped its copy, it is forgotten and the next scan starts from the queue's head (`check_cursor`, `reset`);
blocks the engine takes without the policy being told (a request the connector never looked up) stay
counted until then.

A stored block goes back where the scan picked it, behind the block before it then, while that block is
still in the saved head (`places`); at the queue's head otherwise (a hold, a block saved again, a
neighbour taken). The engine so evicts the older saved blocks first, as the GPU's LRU order says.
Cost: O(blocks read past the cursor) per scan, O(1) per block taken or copy dropped, O(blocks stored) per
store event. Changes no pool: it reads through the policy's view and returns what the scheduler applies.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from math import ceil

from scheduler_side.policies.frontier_scan import scan_frontier
from scheduler_side.policies.store_policy import StorePicks, StorePolicyView

_UNSCANNED = -1  # the anchor of a stored block the scan did not pick (a hold, a block saved again)


class SavedHead:
    def __init__(self, view: StorePolicyView) -> None:
        self.view = view
        self.blocks: set[int] = set()  # the saved head's GPU block ids
        self.cursor: int | None = None  # its last scanned block; None: the next scan starts from the head
        self.unsaved: list[tuple[int, bytes]] = []  # blocks that left it when the tier dropped their copy
        self._cached_block = view.gpu_cached_block  # (per CPU copy dropped: bound once)
        self._anchor_of: dict[int, int | None] = {}  # this step's scanned picks -> the block before each
        self._stored_of: dict[int, list[tuple[int, int | None]]] = {}  # store event -> (GPU block, anchor)
        self._placed: tuple[int | None, list[tuple[int | None, list[int]]]] = (None, [])  # the last `places`

    def __len__(self) -> int:
        return len(self.blocks)

    def reset(self) -> None:
        """Forget it: the next scan starts from the head of the GPU free queue."""
        self.blocks.clear()
        self.unsaved.clear()
        self.cursor = None

    def take(self, gpu_block_ids: Sequence[int]) -> None:
        """The engine took these blocks (allocated them, or a request hit them)."""
        if self.blocks:
            self.blocks.difference_update(gpu_block_ids)

    def on_copy_dropped(self, key: bytes) -> None:
        """The CPU tier dropped `key`'s copy: a block of the saved head holding it is unsaved now."""
        self.on_copies_dropped((key,))

    def on_copies_dropped(self, keys: Sequence[bytes]) -> None:
        """`on_copy_dropped` for each key, in order (an allocation's evictions at once)."""
        blocks, cached_block = self.blocks, self._cached_block
        for key in keys:
            if not blocks:
                return
            gpu_id = cached_block(key)
            if gpu_id is None or gpu_id not in blocks:
                continue
            if gpu_id == self.cursor:
                self.reset()  # (clears `blocks` in place)
            else:
                blocks.discard(gpu_id)
                self.unsaved.append((gpu_id, key))

    def check_cursor(self) -> None:
        """Before a scan: if the engine took the cursor's block, start from the head."""
        cursor = self.cursor
        if cursor is not None and (cursor not in self.blocks or not self.view.gpu_is_free(cursor)):
            self.reset()

    def save_again(self, picks: StorePicks, picked: set[bytes], room: int, pick_cost: float,
                   cached: Mapping[bytes, object], reserved: Mapping[bytes, object],
                   dead: Callable[[bytes], bool] | None) -> tuple[int, float]:
        """The blocks that left when the tier dropped their copies: picked again where they still hold that
        content, free, while the tier has room (else the engine may evict them unsaved). Returns the room
        left and their cost to the budget (`pick_cost` a pick, 1 any other still in the queue, as the scan
        charges them). O(such blocks)."""
        unsaved, self.unsaved = self.unsaved, []
        view, cost = self.view, 0.0
        for gpu_id, key in unsaved:
            if view.gpu_cached_block(key) != gpu_id or not view.gpu_is_free(gpu_id):
                continue  # taken by the engine, or its content changed
            if room > 0 and key not in picked and key not in cached and key not in reserved and not (
                    dead and dead(key)):
                picked.add(key)
                picks.gpu_ids.append(gpu_id)
                picks.keys.append(key)
                room -= 1
                cost += pick_cost
            else:
                cost += 1
        return room, cost

    def scan(self, picks: StorePicks, picked: set[bytes], budget: float, pick_cost: float, room: int,
             cached: Mapping[bytes, object], reserved: Mapping[bytes, object],
             dead: Callable[[bytes], bool] | None) -> None:
        """Scan on from the cursor with `budget` (frontier_scan.py's rule), picking unsaved blocks; the
        scanned blocks not picked join the saved head up to the first unsaved one left for want of room: the
        next scan starts there. O(blocks read)."""
        view = self.view
        num = max(0, ceil(budget)) + 64  # a prefix long enough unless picks cost little: then read more
        while True:
            ids, keys = view.gpu_frontier(num, self.cursor)
            # (most keys read are cached: that check first; `None` is in neither map)
            if dead is None:  # (the common case: no admission filter, one check less per block read)
                candidates = [i for i, key in enumerate(keys)
                              if key not in cached and key not in reserved and key is not None]
            else:
                candidates = [i for i, key in enumerate(keys) if key not in cached and key not in reserved
                              and key is not None and not dead(key)]
            taken = set(picked)
            num_scanned, positions, short = scan_frontier(keys, candidates, budget, pick_cost, room, taken)
            if not short or len(keys) < num:
                break
            num *= 2
        chosen = set(positions)
        end = num_scanned
        for i in candidates:  # an unsaved block left for want of room ends the saved head before it
            if i >= end:
                break
            if i not in chosen and keys[i] not in taken:
                end = i
                break
        anchor_of, anchor = self._anchor_of, self.cursor  # a pick's anchor: the scanned block before it
        for i in positions:
            if i > 0 and i - 1 not in chosen:
                anchor = ids[i - 1]
            anchor_of[ids[i]] = anchor
            picks.gpu_ids.append(ids[i])
            picks.keys.append(keys[i])  # type: ignore[arg-type]  # (a candidate is hashed)
        last = end - 1
        while last >= 0 and last in chosen:
            last -= 1
        if last >= 0:
            self.blocks.update([ids[i] for i in range(last + 1) if i not in chosen] if chosen else ids[:last + 1])
            self.cursor = ids[last]

    def remember(self, event_id: int | None, stored_gpu_ids: list[int]) -> None:
        """The store event made of this step's picks (None: nothing stored): where each block was picked."""
        anchor_of, self._anchor_of = self._anchor_of, {}
        if event_id is not None:
            self._stored_of[event_id] = [(gpu_id, anchor_of.get(gpu_id, _UNSCANNED)) for gpu_id in stored_gpu_ids]

    def places(self, event_id: int) -> list[tuple[int | None, list[int]]] | None:
        """Where the event's blocks go back (`StorePolicy.stored_blocks_places`); None while the next scan
        starts from the head (then at the head: the scan finds them there)."""
        stored = self._stored_of.get(event_id)
        if not stored or self.cursor is None:
            return None
        blocks, is_free = self.blocks, self.view.gpu_is_free
        places: list[tuple[int | None, list[int]]] = []
        for gpu_id, anchor in stored:
            if anchor is not None and not (anchor in blocks and is_free(anchor)):
                anchor = None  # (`_UNSCANNED` is never in the saved head)
            if places and places[-1][0] == anchor:
                places[-1][1].append(gpu_id)
            else:
                places.append((anchor, [gpu_id]))
        self._placed = (event_id, places)
        return places

    def on_store_complete(self, event_id: int) -> None:
        """The event's blocks nobody else holds are back in the free queue, saved, where `places` put them:
        they join the saved head, and those put behind the cursor move it to the last of them. Blocks not
        placed by `places` (a failed store: at vLLM's place, unsaved) do not join."""
        self._stored_of.pop(event_id, None)
        (placed_id, places), self._placed = self._placed, (None, [])
        if placed_id != event_id or self.cursor is None:
            return
        is_free, blocks, cursor = self.view.gpu_is_free, self.blocks, self.cursor
        for anchor, gpu_ids in places:
            released = [gpu_id for gpu_id in gpu_ids if is_free(gpu_id)]
            blocks.update(released)
            if anchor == cursor and released:
                self.cursor = released[-1]
