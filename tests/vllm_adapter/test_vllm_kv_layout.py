"""The KV-cache layout the connector asks vLLM for (offload_connector/vllm/kv_layout.py), and the start-up line.

A block-outermost layout makes every block one range across layers (the copy engines move it at the link's
speed); it is asked for only where the configuration and the model allow it, and the start-up line says
which layout vLLM resolved and why. vLLM itself keeps its own layout where a backend refuses the request
(`resolve_kv_cache_layout`), which the real-vLLM test at the end checks against vLLM's code.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from offload_connector import load_config
from offload_connector.vllm.kv_layout import LayoutRequest, describe_layout, required_layout


class Backend:
    """An attention backend enum member as vLLM's registry has them: a name and `get_class()`."""

    def __init__(self, name: str, layouts: tuple[str, ...] | None) -> None:
        self.name = name
        members = None if layouts is None else tuple(SimpleNamespace(name=x) for x in layouts)
        self._cls = SimpleNamespace(supported_kv_cache_layouts=lambda: members)

    def get_class(self):
        return self._cls


def vllm_config(device: str = "cuda", backend: Backend | None = None, per_kind: dict | None = None,
                hybrid: bool = False, layer_types: list[str] | None = None) -> SimpleNamespace:
    text = SimpleNamespace(sliding_window=4096 if layer_types else None, layer_types=layer_types)
    return SimpleNamespace(
        device_config=SimpleNamespace(device_type=device),
        attention_config=SimpleNamespace(backend=backend, backend_per_kind=per_kind or {}),
        model_config=SimpleNamespace(is_hybrid=hybrid, hf_text_config=text, disable_sliding_window=False),
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}))


@pytest.fixture(autouse=True)
def no_layout_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)


AUTO = load_config(None)


def test_auto_asks_for_blhnc_where_nothing_restricts_it() -> None:
    """No backend named: vLLM picks per platform and model; BLHNC is what FlashAttention (any layout),
    FlashInfer and the MLA backends all accept."""
    assert required_layout(vllm_config(), AUTO) == LayoutRequest("BLHNC", "each block one range across layers")


@pytest.mark.parametrize(("layouts", "expected"), [
    (("LBHNC", "BLHNC"), "BLHNC"),  # FlashInfer: its block-outermost layout
    (("BLNHC", "BLHNC"), "BLNHC"),  # a backend preferring tokens outside heads: its order
    (None, "BLHNC"),  # declares nothing: any layout
    (("LBNHC",), None),  # only a layer-compact layout: ask for nothing
])
def test_auto_follows_the_named_backends_declared_layouts(layouts, expected) -> None:
    request = required_layout(vllm_config(backend=Backend("SOME_BACKEND", layouts)), AUTO)
    assert request.layout == expected
    if expected is None:
        assert "support no block-outermost layout" in request.reason and "SOME_BACKEND" in request.reason


def test_every_named_backend_must_accept_the_layout() -> None:
    config = vllm_config(backend=Backend("A", ("BLNHC", "BLHNC")), per_kind={"sliding": Backend("B", ("BLHNC",))})
    assert required_layout(config, AUTO).layout == "BLHNC"  # A's first choice is not B's: the one both list


@pytest.mark.parametrize(("config", "reason"), [
    (vllm_config(device="cpu"), "vLLM's CPU attention takes LBHNC only"),
    (vllm_config(hybrid=True), "Mamba hybrid"),
    (vllm_config(layer_types=["sliding_attention", "full_attention"]), "sliding-window hybrid"),
])
def test_nothing_is_asked_where_the_platform_or_the_model_rules_it_out(config, reason: str) -> None:
    request = required_layout(config, AUTO)
    assert request.layout is None and reason in request.reason


def test_the_environment_and_the_config_switch_keep_vllms_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    keep = load_config({"transfer": {"kv_layout": "vllm"}})
    assert required_layout(vllm_config(), keep) == LayoutRequest(None, "transfer.kv_layout is vllm")
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "LBNHC")
    assert required_layout(vllm_config(), AUTO) == LayoutRequest(None, "VLLM_KV_CACHE_LAYOUT is set")


def test_an_explicit_layout_is_asked_unless_a_named_backend_refuses_it() -> None:
    blnhc = load_config({"transfer": {"kv_layout": "BLNHC"}})
    assert required_layout(vllm_config(), blnhc) == LayoutRequest("BLNHC", "transfer.kv_layout")
    refused = required_layout(vllm_config(backend=Backend("FLASHINFER", ("LBHNC", "BLHNC"))), blnhc)
    assert refused.layout is None and "not supported by FLASHINFER" in refused.reason


def test_a_bad_layout_value_names_the_key_and_the_choices() -> None:
    from offload_connector.config import ConfigError

    with pytest.raises(ConfigError, match="transfer.kv_layout"):
        load_config({"transfer": {"kv_layout": "LBHNC"}})


def test_the_startup_line_says_what_vllm_resolved_and_why() -> None:
    asked = LayoutRequest("BLHNC", "each block one range across layers")
    assert describe_layout(asked, "BLHNC") == "KV layout BLHNC (asked: each block one range across layers)"
    assert describe_layout(asked, "LBHNC").startswith("KV layout LBHNC (vLLM's: it kept its own over the BLHNC")
    assert describe_layout(LayoutRequest(None, "transfer.kv_layout is vllm"), "LBNHC") == \
        "KV layout LBNHC (vLLM's; transfer.kv_layout is vllm)"


@pytest.mark.vllm
def test_vllm_keeps_its_own_layout_where_a_backend_refuses_the_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's own resolution (0.32): the connector's request wins where every backend supports it, and is
    dropped for the first candidate where one does not: the fallback the start-up line describes."""
    pytest.importorskip("vllm")
    from vllm.v1.attention.backends import utils as attn_utils

    from offload_connector.vllm.connector import OffloadConnector

    config = SimpleNamespace(cache_config=SimpleNamespace(kv_cache_layout=None),
                             kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}),
                             device_config=SimpleNamespace(device_type="cuda"),
                             attention_config=SimpleNamespace(backend=None, backend_per_kind={}),
                             model_config=SimpleNamespace(is_hybrid=False, hf_text_config=None))
    monkeypatch.setattr(attn_utils, "get_kv_connector_cache_layout",
                        lambda cfg=None: OffloadConnector.get_required_kvcache_layout(config))
    flashinfer_like = [["LBHNC", "BLHNC"]]
    assert attn_utils.resolve_kv_cache_layout(config, flashinfer_like).name == "BLHNC"
    config.cache_config.kv_cache_layout = None
    cpu_attention = [["LBHNC"]]
    assert attn_utils.resolve_kv_cache_layout(config, cpu_attention).name == "LBHNC"
