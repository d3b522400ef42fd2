"""The fake model's expected K/V: slots of token runs, the paged arena, and errors in a batched check."""

from __future__ import annotations

import random

import pytest
import torch

from offload_connector.fake_engine import FakeEngine, IntegrityError, kv_pattern
from offload_connector.fake_engine.expected_kv import INITIAL_PAGES, ExpectedKV, TokenRuns
from offload_connector.fake_engine.request import EngineRequest
from offload_connector.fake_engine.workload import small_config


def test_token_runs_give_the_slots_of_every_token_in_order() -> None:
    rng = random.Random(0)
    runs, want_slots, want_positions = TokenRuns(4, 2), [[], []], []
    for _ in range(50):
        tables = [rng.sample(range(100), 10), rng.sample(range(100), 10)]
        start = rng.randrange(38)
        end = rng.randrange(start, 41)
        runs.add(start, end, *tables)
        for p in range(start, end):
            for out, table in zip(want_slots, tables, strict=True):
                out.append(table[p // 4] * 4 + p % 4)
            want_positions.append(p)
    assert [s.tolist() for s in runs.slots()] == want_slots
    assert runs.positions().tolist() == want_positions and runs.num_tokens == len(want_positions)


def test_the_arena_keeps_every_known_token_exact_through_growth_and_reuse() -> None:
    shape, block_size = (2, 2, 2, 4), 4
    arena = ExpectedKV(shape, block_size, torch.float16, rank=1)
    rng = random.Random(1)
    prompts = [[rng.randrange(1000) for _ in range(rng.randrange(1, 60))] for _ in range(80)]
    requests = [EngineRequest(f"r{i}", prompt, 8, block_size)  # about 640 pages: the arena doubles twice
                for i, prompt in enumerate(prompts)]
    arena.sync(requests)
    live = requests[::2]
    for kept, done in zip(live, requests[1::2], strict=True):
        kept.append_output_token(rng.randrange(1000))
        arena.release(done)  # its pages are given back, reused by the next sync
    arena.sync(live)
    assert arena.num_pages > INITIAL_PAGES
    arena.check_integrity(live)
    for req in live:
        n = req.num_tokens
        want = kv_pattern.kv_values(kv_pattern.prefix_seeds(req.all_token_ids), torch.arange(n), shape,
                                    torch.float16, salt=1)
        runs = TokenRuns(block_size, 1)
        runs.add(0, n, req.model_state[1].pages)
        got = arena.gather_tokens(runs.slots()[0])  # (layers * 2, tokens, heads * dim)
        assert torch.equal(got.view(2, 2, n, 2, 4), want), req.request_id
        full = n // block_size  # whole pages hold the same values, a page a row
        pages = arena.gather_pages(torch.tensor(req.model_state[1].pages[:full], dtype=torch.int64))
        assert torch.equal(pages.view(2, 2, full * block_size, 2, 4), want[:, :, :full * block_size])


def test_a_released_request_leaves_no_page_behind() -> None:
    arena = ExpectedKV((1, 2, 1, 2), 4, torch.float32, rank=0)
    req = EngineRequest("a", list(range(30)), 4, 4)
    arena.sync([req])
    assert arena.num_used_pages == 8
    arena.release(req)
    assert arena.num_used_pages == 0 and req.model_state is None
    arena.check_integrity([])


@pytest.mark.parametrize("position", [9, 12])  # in a whole block read, in the partial block read last
def test_a_batched_check_names_the_request_that_read_wrong_kv(position: int) -> None:
    """Two requests verified in one piece of work: the error names the one whose token is corrupt."""
    with FakeEngine(small_config(), connector=False) as engine:
        engine.add_request("a", list(range(13)), 5)
        engine.add_request("b", list(range(100, 113)), 5)
        engine.step()  # both prefilled: 13 tokens each, in 3 whole blocks and 1 token of a fourth
        engine.step()  # both read their 13 tokens and compute one more
        b = engine.scheduler.requests["b"]
        block = b.gpu_block_ids[position // 4]
        layer = list(engine.model.kv_caches.values())[1]
        layer[1, block, position % 4, 1, 3] += 1  # one value of one token of b (layer 1, V)
        with pytest.raises(IntegrityError, match=rf"request b: layer 1 .* at 1 of 14 token positions read "
                                                 rf"\(first position {position}\), GPU blocks \[{block}\]"):
            engine.step()
        assert engine.stats.integrity_errors == 1
