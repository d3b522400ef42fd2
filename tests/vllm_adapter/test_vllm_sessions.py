"""End to end: per-request hints through `vllm.LLM` (kv_transfer_params in SamplingParams.extra_args).

On the tiny config-only LLaMA of test_vllm_e2e.py (dummy weights, 10 GPU blocks of 32 tokens, eager
stores): a request with `store: false` stores nothing; closing a session (from Python with
`close_session`, or with `close_session: true` on its last request) moves the CPU copies only that
session used to the eviction end of the CPU tier (read here in the tier's free-queue order); greedy
outputs equal those of the same engine without the connector.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from test_vllm_e2e import close, make_llm, tokens  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

from offload_connector.vllm.compat import in_process_connector  # noqa: E402
from offload_connector.vllm.sessions import SessionCloseError, close_session, session_params  # noqa: E402

SHARED = tokens(21, 64)  # two blocks both sessions use
A1, A2, B1 = SHARED + tokens(22, 96), SHARED + tokens(23, 96), SHARED + tokens(24, 96)
NOSTORE = tokens(25, 128)
C1, C2 = tokens(26, 128), tokens(27, 128)


def params(kv: dict | None) -> SamplingParams:
    extra = {"kv_transfer_params": kv} if kv is not None else None
    return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False, extra_args=extra)


def gen(llm, prompt: list[int], kv: dict | None = None) -> list[int]:
    out = llm.generate([{"prompt_token_ids": prompt}], params(kv), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def cpu_head(offload, n: int) -> list[bytes | None]:
    """The first `n` cached blocks of the CPU tier's free queue (the eviction end of its content, behind
    its empty blocks): their content keys."""
    out = []
    for block in offload.cpu_pool.free_queue:
        if len(out) == n:
            break
        if block.block_hash is not None:
            out.append(block.block_hash)
    return out


def cached_keys(offload, keys: list[bytes]) -> list[bytes]:
    return [k for k in keys if offload.cpu_pool.lookup(k) is not None]


@pytest.fixture(scope="module")
def runs() -> dict:
    r: dict = {}
    kv = KVTransferConfig(kv_connector="OffloadConnector", kv_connector_module_path="offload_connector.vllm_connector",
                          kv_role="kv_both", kv_connector_extra_config={"cpu_bytes": "64MiB", "store_policy": "eager"})
    llm = make_llm(kv)  # eager: each prompt's blocks are on the CPU once it finishes, so a close has copies to move
    offload = in_process_connector(llm).offload
    try:
        # 1. store: false stores nothing
        r["nostore"] = gen(llm, NOSTORE, {"store": False})
        r["stored_after_nostore"] = offload.stats.num_stored_blocks
        # 2. sessions a and b share two blocks; closing a from Python demotes a's own blocks only
        r["a"] = [gen(llm, A1, session_params("a")), gen(llm, A2, session_params("a"))]
        r["b"] = gen(llm, B1, session_params("b"))
        own_a = cached_keys(offload, offload.admission.session_keys("a"))
        r["own_a"], r["shared_live"] = own_a, [k for k in offload.cpu_pool.cached if k not in own_a]
        r["demoted_a"] = close_session(llm, "a")
        r["head_a"] = cpu_head(offload, len(own_a))
        # 3. session c closes with a hint on its last request
        r["c"] = [gen(llm, C1, session_params("c")), gen(llm, C2, session_params("c", close=True))]
        r["closed"] = offload.stats.num_closed_sessions
        r["demoted_total"] = offload.stats.num_demoted_blocks
        r["bad"] = gen(llm, C1, {"store": "nope"})
        r["bad_hints"] = offload.stats.num_bad_hints
    finally:
        close(llm)
    plain = make_llm(None)
    try:
        r["plain"] = {"nostore": gen(plain, NOSTORE), "a": [gen(plain, A1), gen(plain, A2)], "b": gen(plain, B1),
                      "c": [gen(plain, C1), gen(plain, C2)], "bad": gen(plain, C1)}
    finally:
        close(plain)
    return r


def test_store_false_stores_nothing(runs: dict) -> None:
    assert runs["stored_after_nostore"] == 0


def test_closing_a_session_demotes_its_own_blocks_to_the_eviction_end(runs: dict) -> None:
    assert runs["own_a"], "session a stored no block of its own"
    assert runs["demoted_a"] == len(runs["own_a"])
    assert runs["head_a"] == runs["own_a"]  # oldest use nearest the head
    assert not set(runs["head_a"]) & set(runs["shared_live"])


def test_a_close_hint_on_the_last_request_closes_the_session(runs: dict) -> None:
    assert runs["closed"] == 2 and runs["demoted_total"] > runs["demoted_a"]


def test_a_bad_hint_is_counted_and_ignored(runs: dict) -> None:
    assert runs["bad_hints"] == 1


def test_outputs_unchanged(runs: dict) -> None:
    plain = runs["plain"]
    assert runs["nostore"] == plain["nostore"] and runs["a"] == plain["a"] and runs["b"] == plain["b"]
    assert runs["c"] == plain["c"] and runs["bad"] == plain["bad"]


def test_close_session_needs_the_connector() -> None:
    with pytest.raises(SessionCloseError, match="in this process"):
        close_session(object(), "a")
    with pytest.raises(SessionCloseError, match="non-empty"):
        close_session(object(), "")
