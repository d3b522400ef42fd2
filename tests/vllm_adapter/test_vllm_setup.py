"""Start-up of the vLLM adapter: config resolution, set-up checks, the GPU pool view, the plugin.

The first group needs no vLLM (plain stand-ins for vLLM's config objects); the rest skip without it.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from offload_connector.config import ConfigError
from offload_connector.vllm.engine_setup import describe_kv_cache, resolve_config, shared_pool_ranks
from offload_connector.vllm.errors import UnsupportedSetupError


class AttentionSpec(SimpleNamespace):
    """Stand-ins named like vLLM's specs, in vLLM's hierarchy (the checks go by class names)."""


class FullAttentionSpec(AttentionSpec):
    pass


class SlidingWindowSpec(AttentionSpec):
    pass


class MambaSpec(SimpleNamespace):
    pass


class ChunkedLocalAttentionSpec(AttentionSpec):
    pass


def fake_configs(num_groups: int = 1, block_size: int = 32, prefix_caching: bool = True, pp: int = 1,
                 tp: int = 2, hash_block_size: int | None = None, spec_cls: type = FullAttentionSpec,
                 extra_group_cls: type | None = None, extra_page_bytes: int = 4096, extra_layers: int = 3,
                 mamba_cache_mode: str = "align", num_speculative_blocks: int = 0):
    spec = spec_cls(block_size=block_size, page_size_bytes=4096, sliding_window=64)
    groups = [SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1", "l2"]) for _ in range(num_groups)]
    if extra_group_cls is not None:  # a hybrid model with HMA on: a second group of another kind
        extra = extra_group_cls(block_size=block_size, page_size_bytes=extra_page_bytes, sliding_window=128,
                                extra_retained_tokens=0, mamba_cache_mode=mamba_cache_mode,
                                num_speculative_blocks=num_speculative_blocks)
        groups.append(SimpleNamespace(kv_cache_spec=extra, layer_names=[f"x{i}" for i in range(extra_layers)]))
    kv_cache_config = SimpleNamespace(num_blocks=100, kv_cache_groups=groups, kv_cache_tensors=[],
                                      hash_block_size=hash_block_size, kv_cache_layout="LBNHC")
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching, block_size=32),
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp, world_size=tp))
    return vllm_config, kv_cache_config


# ---------------------------------------------------------------- config from kv_connector_extra_config
def test_inline_keys_win_over_the_config_file(tmp_path) -> None:
    path = tmp_path / "offload.yaml"
    path.write_text("cpu_bytes: 2GiB\nstore_policy: lazy\ntransfer:\n  num_streams: 4\n")
    cfg = resolve_config({"config_file": str(path), "store_policy": "eager", "transfer": {"backend": "cpu"}})
    assert cfg.cpu_bytes == 2 * 2**30
    assert cfg.store_policy == "eager"
    assert cfg.transfer.num_streams == 4 and cfg.transfer.backend == "cpu"


def test_no_extra_config_is_the_embedded_default() -> None:
    assert resolve_config(None).cpu_bytes == 8 * 2**30
    assert resolve_config({}).store_policy == "lazy"
    assert resolve_config({}, num_kv_groups=2).store_policy == "eager"  # a hybrid model keeps vLLM's HMA on
    assert resolve_config({"store_policy": "lazy"}, num_kv_groups=2).store_policy == "lazy"


def test_bad_extra_config_names_the_key() -> None:
    with pytest.raises(ConfigError, match="store_polcy"):
        resolve_config({"store_polcy": "eager"})
    with pytest.raises(ConfigError, match="config_file"):
        resolve_config({"config_file": "/nonexistent/offload.yaml"})
    with pytest.raises(ConfigError, match="cpu_bytes"):
        resolve_config({"cpu_bytes": "lots"})


def test_a_bad_key_names_where_it_was_set(tmp_path, monkeypatch) -> None:
    """Issue 12 item 7: the error names the file (absolute path) or kv_connector_extra_config."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "offload.yaml").write_text("store_policy: lazy\ntransfer:\n  num_streams: 0\n")
    (tmp_path / "twice.yaml").write_text("eviction: lru\neviction: arc\n")
    absolute = str((tmp_path / "offload.yaml").resolve())
    # 1. A bad value in the file (named relative to the working directory): the file's absolute path.
    with pytest.raises(ConfigError, match="transfer.num_streams") as err:
        resolve_config({"config_file": "offload.yaml", "eviction": "arc"})
    assert str(err.value).endswith(f"(in {absolute})")
    # 2. A bad inline key on top of a good file: kv_connector_extra_config, not the file.
    with pytest.raises(ConfigError, match="store_polcy") as err:
        resolve_config({"config_file": "offload.yaml", "store_polcy": "lazy", "transfer": {"num_streams": 2}})
    assert str(err.value).endswith("(in kv_connector_extra_config)")
    # 3. A key given twice in the file, and a missing file: the absolute path, once.
    with pytest.raises(ConfigError, match="eviction") as err:
        resolve_config({"config_file": "twice.yaml"})
    assert str((tmp_path / "twice.yaml").resolve()) in str(err.value)
    with pytest.raises(ConfigError, match="config_file") as err:
        resolve_config({"config_file": "missing.yaml"})
    assert str(err.value).count(str(tmp_path.resolve() / "missing.yaml")) == 1


# ---------------------------------------------------------------- KV-cache shape and refusals
def test_shape_and_tp_split() -> None:
    vllm_config, kv_cache_config = fake_configs(tp=2)
    shape = describe_kv_cache(vllm_config, kv_cache_config)
    assert (shape.block_size, shape.bytes_per_block, shape.num_layers) == (32, 3 * 4096, 3)
    # cpu_bytes is for the whole engine: each of the 2 ranks gets half.
    assert shape.num_cpu_blocks(resolve_config({"cpu_bytes": 2 * 3 * 4096 * 10})) == 10


def test_hybrid_shape_lists_each_groups_window_and_counts_layer_slots() -> None:
    """HMA on: the groups overlay one another in the KV tensors, so a block id owns one page per layer
    slot (the largest group's layer count), not one per layer."""
    shape = describe_kv_cache(*fake_configs(extra_group_cls=SlidingWindowSpec, extra_layers=2))
    assert shape.groups == ((None, 0), (128, 0))
    assert (shape.num_layers, shape.bytes_per_block) == (3, 3 * 4096)
    two_full = describe_kv_cache(*fake_configs(num_groups=2))
    assert two_full.groups == ((None, 0), (None, 0))


def test_a_mamba_hybrid_in_align_mode_lists_its_state_groups_and_layers() -> None:
    """Mamba/SSM state groups (vLLM's align mode, pages padded to the attention page) overlay the attention
    layers like any group: one page per layer slot; the shape says which groups and layers hold state."""
    shape = describe_kv_cache(*fake_configs(extra_group_cls=MambaSpec, extra_layers=2))
    assert shape.groups == ((None, 0), (None, 0)) and shape.state_groups == (1,)
    assert shape.state_layers == ("x0", "x1")
    assert (shape.num_layers, shape.bytes_per_block) == (3, 3 * 4096)
    assert describe_kv_cache(*fake_configs(extra_group_cls=SlidingWindowSpec)).state_groups == ()


def test_a_mamba_hybrid_needs_eager_stores_and_says_hma_cannot_be_turned_off() -> None:
    from offload_connector.vllm.engine_setup import check_groups_config

    hybrid = describe_kv_cache(*fake_configs(extra_group_cls=MambaSpec))
    check_groups_config(resolve_config({}, len(hybrid.groups)), hybrid)
    with pytest.raises(UnsupportedSetupError, match="store_policy='lazy'.*allowed with several groups: store_policy: "
                                                     "eager.*a Mamba hybrid always runs with vLLM's hybrid KV"):
        check_groups_config(resolve_config({"store_policy": "lazy"}), hybrid)
    with pytest.raises(UnsupportedSetupError, match="the remote tier supports one KV-cache group.*no remote "
                                                     "section .a Mamba hybrid"):
        check_groups_config(resolve_config({"remote": {"url": "redis://127.0.0.1:1"}}, 2), hybrid)


def test_prefix_caching_off_on_a_mamba_hybrid_says_what_it_gives() -> None:
    with pytest.raises(UnsupportedSetupError, match="set enable_prefix_caching=True .*mamba_cache_mode='align'"):
        describe_kv_cache(*fake_configs(extra_group_cls=MambaSpec, prefix_caching=False))


def test_hybrid_models_need_eager_stores_and_no_remote_tier() -> None:
    from offload_connector.vllm.engine_setup import check_groups_config

    hybrid = describe_kv_cache(*fake_configs(extra_group_cls=SlidingWindowSpec))
    check_groups_config(resolve_config({}, len(hybrid.groups)), hybrid)  # unset: eager for a hybrid model
    with pytest.raises(UnsupportedSetupError, match="store_policy='lazy'.*allowed with several groups: "
                                                     "store_policy: eager"):
        check_groups_config(resolve_config({"store_policy": "lazy"}), hybrid)
    single = describe_kv_cache(*fake_configs())
    check_groups_config(resolve_config({"store_policy": "lazy"}), single)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"extra_group_cls": MambaSpec, "mamba_cache_mode": "none"},
     r"2 KV-cache groups \(FullAttentionSpec, MambaSpec\)\. Its Mamba/SSM state groups run in "
     r"mamba_cache_mode='none'; allowed: 'align' .* set --enable-prefix-caching"),
    ({"extra_group_cls": MambaSpec, "num_speculative_blocks": 2}, r"2 speculative state blocks .*allowed with Mamba "
                                                                  r"state groups: num_speculative_blocks 0"),
    ({"extra_group_cls": MambaSpec, "extra_page_bytes": 2048}, r"page bytes\) differ: .*leave mamba_block_size "
                                                               "unset"),
    ({"extra_group_cls": ChunkedLocalAttentionSpec}, r"ChunkedLocalAttentionSpec groups are not supported; "
                                                     "allowed: full attention"),
    ({"extra_group_cls": SimpleNamespace}, r"SimpleNamespace groups are not supported"),
    ({"extra_group_cls": SlidingWindowSpec, "extra_page_bytes": 2048}, r"page bytes\) differ: "
                                                                       r"\[\(32, 2048\), \(32, 4096\)\]"),
    ({"spec_cls": SlidingWindowSpec}, "full-attention"),
    ({"block_size": 16}, "block size"),
    ({"hash_block_size": 16}, "block size"),
    ({"prefix_caching": False}, "enable_prefix_caching"),
    ({"pp": 2}, "pipeline_parallel_size"),
])
def test_unsupported_setups_fail_at_start_up(kwargs: dict, match: str) -> None:
    with pytest.raises(UnsupportedSetupError, match=match):
        describe_kv_cache(*fake_configs(**kwargs))


def test_prefix_caching_off_says_what_to_set_and_why_mla_on_cpu_may_not_take_it() -> None:
    vllm_config, kv_cache_config = fake_configs(prefix_caching=False)
    with pytest.raises(UnsupportedSetupError, match=r"set enable_prefix_caching=True \(vllm serve "
                                                    r"--enable-prefix-caching") as err:
        describe_kv_cache(vllm_config, kv_cache_config)
    assert "AMX" not in str(err.value)
    vllm_config.model_config = SimpleNamespace(use_mla=True)
    vllm_config.device_config = SimpleNamespace(device_type="cpu")
    with pytest.raises(UnsupportedSetupError, match="turns it off for MLA models whatever was set, unless its "
                                                    "AMX MLA backend runs"):
        describe_kv_cache(vllm_config, kv_cache_config)


@pytest.mark.parametrize(("tp", "replicas", "backend", "nnodes", "remote", "shared_by"), [
    (2, 2, "mp", 1, False, 2),  # MLA at TP 2 on one host: one pool
    (4, 4, "mp", 1, False, 4),
    (2, 1, "mp", 1, False, 1),  # heads split across ranks: a pool each
    (4, 2, "mp", 1, False, 1),  # 2 KV heads over 4 ranks: pairs replicate, not all ranks
    (2, 2, "ray", 1, False, 1),  # workers possibly on other hosts
    (2, 2, "mp", 2, False, 1),
    (2, 2, "mp", 1, True, 1),  # the remote tier keys blocks per rank
    (1, 1, "uni", 1, False, 1),
])
def test_ranks_share_a_pool_only_when_all_hold_the_same_kv_on_one_host(tp, replicas, backend, nnodes, remote,
                                                                      shared_by) -> None:
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(
        tensor_parallel_size=tp, world_size=tp, distributed_executor_backend=backend, nnodes=nnodes))
    config = resolve_config({"remote": {"url": "redis://127.0.0.1:1"}} if remote else {})
    assert shared_pool_ranks(vllm_config, SimpleNamespace(kv_tp_replicas=replicas), config) == shared_by


def test_importing_the_package_does_not_import_vllm() -> None:
    code = ("import sys, offload_connector, offload_connector.config, offload_connector.vllm.engine_setup, "
            "offload_connector.vllm.compat, offload_connector.vllm.gpu_pool, offload_connector.vllm.plugin, scheduler_side; "
            "sys.exit(1 if 'vllm' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# ---------------------------------------------------------------- with vLLM
@pytest.mark.vllm
def test_gpu_pool_view_on_vllm_block_pool() -> None:
    pytest.importorskip("vllm")
    from vllm.v1.core.block_pool import BlockPool

    from offload_connector.vllm.gpu_pool import GpuPoolError, VllmGpuPool

    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
    view = VllmGpuPool(pool)
    # 1. vLLM's free queue starts as 1..7 (0 is the null block); the view walks it from the head.
    assert [i for i, _ in view.eviction_candidates()] == [1, 2, 3, 4, 5, 6, 7]
    # 2. touch takes blocks out of the queue; free(front=True) puts them back at the head, in order.
    view.touch([5, 6])
    assert [i for i, _ in view.eviction_candidates()] == [1, 2, 3, 4, 7]
    view.free([5, 6], front=True)
    assert [i for i, _ in view.eviction_candidates()] == [5, 6, 1, 2, 3, 4, 7]
    # 3. A block vLLM also holds stays out of the queue until both references are gone.
    pool.touch([pool.blocks[2]])
    view.touch([2])
    view.free([2])
    assert 2 not in [i for i, _ in view.eviction_candidates()]
    pool.free_blocks([pool.blocks[2]])
    assert view.num_free_blocks() == 7
    assert [i for i, _ in view.eviction_candidates()] == [2, 5, 6, 1, 3, 4, 7]  # 2 came back unhashed: head
    # 4. free(after=...) puts the blocks reaching zero right behind a free block, first listed first; the
    # frontier reads on from a free block.
    view.touch([7, 4])
    assert not view.is_free(7) and view.is_free(1)
    view.free([7, 4], after=1)
    assert [i for i, _ in view.eviction_candidates()] == [2, 5, 6, 1, 7, 4, 3]
    assert view.frontier(2, after=1)[0] == [7, 4] and view.frontier(9, after=3)[0] == []
    view.touch([4])
    with pytest.raises(GpuPoolError):
        view.frontier(1, after=4)  # not free
    with pytest.raises(GpuPoolError):
        view.free([7], after=4)
    view.free([4])
    # 5. Misuse is refused before anything changes.
    with pytest.raises(GpuPoolError):
        view.free([3])
    with pytest.raises(GpuPoolError):
        view.touch([0])


@pytest.mark.vllm
def test_block_hash_keys_match_vllm() -> None:
    pytest.importorskip("vllm")
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    from offload_connector.hashing import with_group_id

    h = bytes(range(32))
    assert all(with_group_id(h, g) == make_block_hash_with_group_id(h, g) for g in (0, 1, 7, 2**20))


@pytest.mark.vllm
def test_plugin_registers_the_short_name() -> None:
    pytest.importorskip("vllm")
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from offload_connector.vllm.plugin import register

    register()
    register()  # idempotent: vLLM may load plugins more than once
    cls = KVConnectorFactory.get_connector_class(
        KVTransferConfig(kv_connector="OffloadConnector", kv_role="kv_both"))
    from offload_connector.vllm.connector import OffloadConnector

    assert cls is OffloadConnector


@pytest.mark.vllm
def test_stats_aggregate_and_reduce() -> None:
    pytest.importorskip("vllm")
    from offload_connector.vllm.connector import OffloadConnector

    a = OffloadConnector.build_kv_connector_stats(
        {"counters": {"num_stored_blocks": 2, "bytes_stored": 4e9, "store_seconds": 1.0}, "gauges": {"cpu_pool_usage": 0.5}})
    b = OffloadConnector.build_kv_connector_stats(
        {"counters": {"num_stored_blocks": 3, "num_lookup_tokens": 10, "num_hit_tokens": 4,
                      "bytes_loaded": 3e9, "load_seconds": 2.0},
         "gauges": {"cpu_pool_usage": 0.25}})
    summary = a.aggregate(b).reduce()
    assert summary["num_stored_blocks"] == 5
    assert summary["store_GBps"] == 4.0
    assert summary["load_GBps"] == 1.5  # was always 0.0: the key was spelled bytes_loadd
    assert summary["cpu_hit_rate"] == 0.4
    assert summary["cpu_pool_usage"] == 0.25  # gauges: the newest snapshot wins
    assert OffloadConnector.build_kv_connector_stats().is_empty()


@pytest.mark.vllm
def test_our_packages_log_through_vllms_handler() -> None:
    """Issue 12 item 3: vLLM configures only its `vllm` logger, so the connector's INFO start-up line
    never showed. Under vLLM our packages take vLLM's handler and level."""
    pytest.importorskip("vllm")
    import logging

    import vllm.logger  # noqa: F401  (configures vLLM's logging)

    from offload_connector.vllm.engine_setup import OUR_PACKAGES, adopt_vllm_logging

    saved = {n: (logging.getLogger(n).handlers[:], logging.getLogger(n).level, logging.getLogger(n).propagate)
             for n in OUR_PACKAGES}
    try:
        for name in OUR_PACKAGES:
            logging.getLogger(name).handlers = []
        adopt_vllm_logging()
        vllm_logger = logging.getLogger("vllm")
        for name in OUR_PACKAGES:
            ours = logging.getLogger(f"{name}.some_module")
            assert ours.isEnabledFor(logging.INFO) == vllm_logger.isEnabledFor(logging.INFO)
            assert logging.getLogger(name).handlers == vllm_logger.handlers
    finally:
        for name, (handlers, level, propagate) in saved.items():
            logger = logging.getLogger(name)
            logger.handlers, logger.propagate = handlers, propagate
            logger.setLevel(level)


@pytest.mark.vllm
def test_several_groups_are_judged_by_vllms_real_spec_classes() -> None:
    """The kinds above go by class names: check them against vLLM's own classes (instances made without
    their constructors, whose arguments change between releases)."""
    pytest.importorskip("vllm")
    from vllm.v1.kv_cache_interface import FullAttentionSpec as Full
    from vllm.v1.kv_cache_interface import MambaSpec as Mamba
    from vllm.v1.kv_cache_interface import SlidingWindowSpec as Window

    def groups(*classes: type) -> SimpleNamespace:
        return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=object.__new__(c)) for c in classes])

    from offload_connector.vllm.engine_setup import _group_window

    def _window(cls: type) -> object:
        spec = object.__new__(cls)
        object.__setattr__(spec, "sliding_window", 64)
        object.__setattr__(spec, "extra_retained_tokens", 0)
        return spec

    vllm_config, _ = fake_configs()
    assert _group_window(_window(Window)) == (64, 0) and _group_window(object.__new__(Full)) == (None, 0)
    # vLLM's MambaSpec defaults to mamba_cache_mode "none" (no state per block): refused, naming the setting.
    with pytest.raises(UnsupportedSetupError, match=r"\(FullAttentionSpec, MambaSpec\).*mamba_cache_mode='none'"):
        describe_kv_cache(vllm_config, groups(Full, Mamba))
