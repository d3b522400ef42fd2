"""The Mooncake trace reader and token synthesis."""

from __future__ import annotations

from pathlib import Path

import pytest

from offload_connector.cli.trace import (
    TraceError,
    TraceRequest,
    bundled_trace_path,
    output_length,
    prompt_tokens,
    read_trace,
)
from offload_connector.hashing import hash_request_tokens


def test_bundled_trace_reads_completely() -> None:
    reqs = read_trace(bundled_trace_path())
    assert len(reqs) == 3993
    assert sum(len(r.hash_ids) for r in reqs) == 121_877
    assert len({h for r in reqs for h in r.hash_ids}) == 43_924
    assert read_trace(bundled_trace_path(), limit=5) == reqs[:5]


@pytest.mark.parametrize("line, key", [
    ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "hash_ids"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}', "hash_ids"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length"),
    ('{"timestamp": 0, "input_length": 5, "output_length": "x", "hash_ids": [1]}', "output_length"),
    ('not json', "JSON"),
])
def test_malformed_line_fails_with_its_line_number(tmp_path: Path, line: str, key: str) -> None:
    good = '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [7]}'
    path = tmp_path / "t.jsonl"
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(TraceError, match=rf"t\.jsonl:3: .*{key}"):
        read_trace(path)


def test_missing_trace_file_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot open"):
        read_trace(tmp_path / "nope.jsonl")


def test_equal_hash_ids_give_equal_blocks_so_chains_stay_chains() -> None:
    a = TraceRequest(timestamp=0, input_length=1500, output_length=3, hash_ids=[1, 2, 3])
    b = TraceRequest(timestamp=0, input_length=1100, output_length=3, hash_ids=[1, 2, 9])
    ta, tb = prompt_tokens(a, 16, False), prompt_tokens(b, 16, False)
    assert len(ta) == 1500 and len(tb) == 1100
    assert ta[:1024] == tb[:1024] and ta[1024:1100] != tb[1024:1100]
    ha, hb = hash_request_tokens(ta, 16), hash_request_tokens(tb, 16)
    assert ha[:64] == hb[:64] and ha[64] != hb[64]


def test_scaled_mode_is_one_engine_block_per_hash_id() -> None:
    a = TraceRequest(timestamp=0, input_length=1500, output_length=100, hash_ids=[1, 2, 3])
    b = TraceRequest(timestamp=0, input_length=700, output_length=1, hash_ids=[1, 5])
    ta, tb = prompt_tokens(a, 16, True), prompt_tokens(b, 16, True)
    # 1500 = 2 x 512 + 476: two full blocks, then 476 * 16 // 512 = 14 tokens; 700 = 512 + 188: 16 + 5
    assert len(ta) == 46 and len(tb) == 21 and ta[:16] == tb[:16] and ta[16:21] != tb[16:21]
    assert output_length(a, 16, True) == 4 and output_length(b, 16, True) == 1
    assert output_length(a, 16, False) == 100


@pytest.mark.parametrize(("input_length", "scaled_length"), [
    (512, 16), (1024, 32), (513, 17), (1023, 31), (1000, 31), (1, 1), (31, 1), (100, 3)])
def test_scaled_partial_last_block_stays_partial(input_length: int, scaled_length: int) -> None:
    """The engine hashes (caches) a block scaled iff it would at full size: the same number of full blocks."""
    req = TraceRequest(timestamp=0, input_length=input_length, output_length=1,
                       hash_ids=list(range(-(-input_length // 512))))
    tokens = prompt_tokens(req, 16, True)
    assert len(tokens) == scaled_length
    assert len(hash_request_tokens(tokens, 16)) == input_length // 512
    assert len(hash_request_tokens(prompt_tokens(req, 512, True), 512)) == input_length // 512
