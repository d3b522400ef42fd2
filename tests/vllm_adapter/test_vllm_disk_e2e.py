"""The disk tier under vLLM: a restarted engine serves a returning prefix from disk.

Engine A (its own process) generates prompts with two 128-token prefixes (4 blocks of 32), storing them to
its CPU tier and writing them to the disk tier; it exits. Engine B, a fresh process on the same directory
with an empty CPU tier, generates other prompts on the same prefixes: its requests must report
`num_cached_tokens` 128 (blocks read from disk into its CPU tier and loaded), its Prometheus series must
say so, and greedy outputs must equal an engine's without any connector. PYTHONHASHSEED=0 in both
(vLLM's block hashes are otherwise random per process for its non-cryptographic hash algorithms).
"""

from __future__ import annotations

import pytest
from vllm_tier_engines import FIRST, SECOND, engine

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


def test_a_restarted_engine_serves_the_prefixes_from_disk(tmp_path) -> None:
    a = engine({"disk": str(tmp_path / "kv"), "prompts": FIRST, "flush": True})
    assert a["worker"]["written_blocks"] >= 8 and a["worker"]["errors"] == 0
    b = engine({"disk": str(tmp_path / "kv"), "prompts": SECOND})
    assert b["lookup"]["scanned_blocks"] == a["worker"]["written_blocks"]
    assert b["cached"] == [128, 128]  # every prefix block, read from disk (B computed none of them)
    assert b["lookup"]["lookup_hit_blocks"] == 8 and b["worker"]["read_blocks"] == 8
    assert b["worker"]["corrupt_blocks"] == b["worker"]["foreign_blocks"] == 0
    assert b["stats"]["num_failed_load_blocks"] == 0
    prom = b["prom"]
    assert prom["vllm:offload_connector_disk_lookup_hit_blocks"] == 8
    assert prom["vllm:offload_connector_disk_read_blocks"] == 8
    plain = engine({"prompts": SECOND})
    assert plain["cached"] == [0, 0] and plain["outputs"] == b["outputs"]
