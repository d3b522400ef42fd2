"""docs/grafana/offload-connector.json queries only series the connector exports, and every one of them
exists from start-up; every tier has panels; the names follow Prometheus' conventions.

The exported series come from vLLM's real Prometheus logger (`PrometheusStatLogger`, the one vLLM's
servers and `LLM` build) for a config that selects our connector, before any request: every sample name in
its registry's exposition text. Each PromQL expression of the dashboard (panel targets and the template
variable's query) is lexed: string literals, label matchers `{...}`, range selectors `[...]` and the label
lists of `by`/`without` are dropped; an identifier followed by `(` must be a PromQL function, any other
identifier a series of ours in that exposition.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "offload-connector.json"
MODEL_DIR = str(Path(__file__).resolve().parents[1] / "tiny_llama")
FUNCTIONS = {"sum", "max", "min", "avg", "count", "rate", "irate", "increase", "clamp_min", "clamp_max",
             "label_values", "abs", "topk", "bottomk", "histogram_quantile", "sum_over_time", "max_over_time"}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset"}
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def expressions(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def series_and_functions(expr: str) -> tuple[set[str], set[str]]:
    """(series names, function names) in a PromQL expression; raises on an identifier that is neither."""
    text = re.sub(r'"(?:\\.|[^"\\])*"', "", expr)  # string literals
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors ([$__rate_interval], [5m])
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)  # label lists
    if text.startswith("label_values("):  # Grafana's template function: label_values(series, label)
        text = re.sub(r",\s*[A-Za-z_][A-Za-z0-9_]*\s*\)$", ")", text)
    series, functions = set(), set()
    for match in _IDENT.finditer(text):
        name, rest = match.group(), text[match.end():].lstrip()
        if name in KEYWORDS or re.fullmatch(r"\d", name[0]):
            continue
        (functions if rest.startswith("(") else series).add(name)
    return series, functions


def test_the_lexer_finds_series_and_functions() -> None:
    series, functions = series_and_functions(
        'sum by (model_name) (rate(vllm:a_total{model_name=~"$m", x="{}"}[$__rate_interval])) / max(vllm:b) * 2')
    assert series == {"vllm:a_total", "vllm:b"} and functions == {"sum", "rate", "max"}
    assert series_and_functions("label_values(vllm:c, model_name)") == ({"vllm:c"}, {"label_values"})


@pytest.fixture(scope="module")
def exported() -> dict[str, float]:
    """Sample name -> value in vLLM's Prometheus registry with our connector, before any request."""
    pytest.importorskip("vllm")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    from offload_connector.vllm.plugin import register

    register()
    vllm_config = EngineArgs(
        model=MODEL_DIR, load_format="dummy", skip_tokenizer_init=True, block_size=32, enforce_eager=True,
        max_model_len=256, dtype="float32",
        kv_transfer_config=KVTransferConfig(kv_connector="OffloadConnector", kv_role="kv_both",
                                            kv_connector_extra_config={"cpu_bytes": "64MiB"}),
    ).create_engine_config()
    PrometheusStatLogger(vllm_config)  # what vLLM's servers and LLM build: registers every series
    text = generate_latest(REGISTRY).decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.vllm
def test_every_dashboard_query_uses_only_series_we_export(exported: dict[str, float]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    used: set[str] = set()
    for expr in expressions(dashboard):
        series, functions = series_and_functions(expr)
        assert functions <= FUNCTIONS, (expr, functions - FUNCTIONS)
        assert series, expr
        missing = series - set(exported)
        assert not missing, f"{expr}: not exported: {sorted(missing)}"
        used |= series
    assert all(name.startswith("vllm:offload_connector_") for name in used)  # ours only, no vLLM series
    assert len(used) >= 25


@pytest.mark.vllm
def test_every_series_exists_at_zero_before_any_request(exported: dict[str, float]) -> None:
    from offload_connector.vllm.stats import COUNTERS, GAUGES, PROM_PREFIX

    ours = {name: value for name, value in exported.items()
            if name.startswith(PROM_PREFIX) and not name.endswith("_created")}
    expected = {PROM_PREFIX + name + "_total" for name in COUNTERS} | {PROM_PREFIX + name for name in GAUGES}
    assert set(ours) == expected
    assert all(value == 0 for value in ours.values())


def test_every_tier_has_panels() -> None:
    """The CPU tier and each lower tier (remote, disk) have panels of their own."""
    from scheduler_side.tiers.registry import TIERS

    exprs = expressions(json.loads(DASHBOARD.read_text()))
    for tier in ("cpu", *TIERS):
        assert any(f"vllm:offload_connector_{tier}_" in expr for expr in exprs), tier


@pytest.mark.vllm
def test_only_counters_end_in_total(exported: dict[str, float]) -> None:
    """Prometheus keeps `_total` for counters: a gauge named `..._total` (cpu_blocks_total was one) reads as
    a counter to rate() and to people. Our counter names get it from prometheus_client, once."""
    from offload_connector.vllm.stats import COUNTERS, GAUGES

    assert not [name for name in GAUGES if name.endswith("_total")]
    assert not [name for name in COUNTERS if name.endswith("_total")]
