"""The vLLM plugin keeps vLLM's hybrid KV cache manager (HMA) off for our configs that support one KV-cache
group (`store_policy: lazy` set explicitly, a remote tier) when the user left
`disable_hybrid_kv_cache_manager` unset: a hybrid model then runs with one group instead of being refused
at start-up. An unset `store_policy` (lazy for one group, eager for several) leaves HMA on. The end-to-end
cases are in `tests/vllm_adapter/test_vllm_hybrid_e2e.py`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from vllm.config import KVTransferConfig  # noqa: E402

from offload_connector.vllm.plugin import keep_hma_off_for_one_group_configs  # noqa: E402


def engine_args(extra: dict | None, hma_off: bool | None = None, connector: str = "OffloadConnector"):
    ktc = None if extra is None else KVTransferConfig(kv_connector=connector, kv_role="kv_both",
                                                      kv_connector_extra_config=extra)
    return SimpleNamespace(kv_transfer_config=ktc, disable_hybrid_kv_cache_manager=hma_off)


@pytest.mark.parametrize(("extra", "expected"), [
    ({"store_policy": "lazy"}, True),
    ({"remote": {"url": "redis://127.0.0.1:6379"}}, True),
    ({"store_policy": "eager"}, None),
    ({}, None),  # unset: eager for a hybrid model, so HMA stays vLLM's choice (on: we declare SupportsHMA)
    ({"cpu_bytes": "1GiB"}, None),
    ({"store_policy": "sideways"}, None),  # a bad config is left for the config check to refuse
])
def test_one_group_configs_turn_hma_off_when_unset(extra: dict, expected: bool | None) -> None:
    args = engine_args(extra)
    keep_hma_off_for_one_group_configs(args)
    assert args.disable_hybrid_kv_cache_manager is expected


def test_an_explicit_choice_or_another_connector_is_left_alone() -> None:
    args = engine_args({"store_policy": "lazy"}, hma_off=False)
    keep_hma_off_for_one_group_configs(args)
    assert args.disable_hybrid_kv_cache_manager is False  # the connector then refuses, naming the keys
    args = engine_args({"store_policy": "lazy"}, connector="ExampleConnector")
    keep_hma_off_for_one_group_configs(args)
    assert args.disable_hybrid_kv_cache_manager is None
    args = engine_args(None)
    keep_hma_off_for_one_group_configs(args)
    assert args.disable_hybrid_kv_cache_manager is None
