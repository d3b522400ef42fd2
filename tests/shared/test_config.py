"""Config: defaults, sizes, and one test per bad-input case, each checking the message names the key."""

import pytest

from offload_connector.config import ConfigError, load_config, locate, merge_configs
from offload_connector.sizes import written
from offload_connector.sizing import num_cpu_blocks


def test_defaults_and_embedded_default():
    cfg = load_config()
    assert cfg.cpu_bytes == 8 * 2**30 and cfg.store_policy == "lazy" and cfg.transfer.backend == "auto"
    assert load_config({}).transfer.num_streams == 2


def test_an_unset_store_policy_is_eager_with_several_kv_cache_groups_and_a_set_one_is_kept():
    assert load_config({}).store_policy == "lazy"
    assert load_config({}, num_kv_groups=2).store_policy == "eager"  # keeps vLLM's hybrid KV cache manager on
    assert load_config({"engine": {"sliding_window": 8}}).store_policy == "eager"  # the fake engine's hybrid
    assert load_config({"store_policy": "lazy"}, num_kv_groups=2).store_policy == "lazy"
    assert load_config({"store_policy": "eager"}).store_policy == "eager"
    with pytest.raises(ConfigError, match="eager with engine.sliding_window"):
        load_config({"store_policy": "lazy", "engine": {"sliding_window": 8}})


@pytest.mark.parametrize("text,expected", [
    ("512MiB", 512 * 2**20), ("8GiB", 8 * 2**30), ("8GB", 8 * 10**9), ("1024", 1024), (4096, 4096),
    ("1.5GiB", int(1.5 * 2**30)), ("64 KiB", 65536),
])
def test_sizes(text, expected):
    assert load_config({"cpu_bytes": text}).cpu_bytes == expected


def test_yaml_file(tmp_path):
    path = tmp_path / "offload.yaml"
    path.write_text("cpu_bytes: 1GiB\nstore_policy: lazy\ntransfer:\n  backend: cpu\n")
    cfg = load_config(path)
    assert cfg.cpu_bytes == 2**30 and cfg.store_policy == "lazy" and cfg.transfer.backend == "cpu"


@pytest.mark.parametrize("data,key,allowed", [
    ({"cpu_bytz": 1}, "cpu_bytz", "cpu_bytes"),
    ({"transfer": {"streams": 2}}, "transfer.streams", "num_streams"),
    ({"metrics": "yes"}, "metrics", "bool"),
    ({"transfer": {"num_streams": "2"}}, "transfer.num_streams", "int"),
    ({"cpu_bytes": 0}, "cpu_bytes", "positive"),
    ({"cpu_bytes": -5}, "cpu_bytes", "positive"),
    ({"cpu_bytes": "8 gigs"}, "cpu_bytes", "8GiB"),
    ({"cpu_bytes": "GiB"}, "cpu_bytes", "8GiB"),
    ({"num_cpu_blocks": 1}, "num_cpu_blocks", ">= 2"),
    ({"num_cpu_blocks": 0}, "num_cpu_blocks", ">= 2"),
    ({"transfer": {"num_streams": 0}}, "transfer.num_streams", ">= 1"),
    ({"store_policy": "sometimes"}, "store_policy", "'eager' | 'lazy'"),
    ({"eviction": "lfu"}, "eviction", "'lru'"),
    ({"transfer": {"backend": "rocm"}}, "transfer.backend", "'auto' | 'cuda' | 'cpu'"),
    ({"hash_algo": "md5"}, "hash_algo", "'xxh3_128' | 'sha256'"),
    ({"engine": {"block_size": 0}}, "engine.block_size", ">= 1"),
])
def test_bad_input_names_key_value_and_allowed(data, key, allowed):
    with pytest.raises(ConfigError) as info:
        load_config(data)
    msg = str(info.value)
    assert f"'{key}'" in msg and allowed in msg
    assert info.value.key == key


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config_file"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("cpu_bytes: [1,\n")
    with pytest.raises(ConfigError, match="config_file"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(listy)


def test_config_error_is_a_value_error_with_plain_message():
    with pytest.raises(ValueError) as info:
        load_config({"store_policy": 3})
    assert not str(info.value).startswith('"')


def test_inline_overrides_file_keys():
    merged = merge_configs({"cpu_bytes": "1GiB", "transfer": {"backend": "cpu", "num_streams": 4}},
                           {"transfer": {"num_streams": 1}})
    cfg = load_config(merged)
    assert cfg.transfer.backend == "cpu" and cfg.transfer.num_streams == 1 and cfg.cpu_bytes == 2**30


def test_vllms_key_overrides_the_file_or_default_cpu_bytes():
    """`cpu_bytes_to_use` inline (vLLM's name) replaces the file's or the embedded default's `cpu_bytes`."""
    from offload_connector.vllm.engine_setup import resolve_config

    assert load_config(merge_configs({"cpu_bytes": "8GiB"}, {"cpu_bytes_to_use": "4GiB"})).cpu_bytes == 4 * 2**30
    assert resolve_config({"cpu_bytes_to_use": "4GiB"}).cpu_bytes == 4 * 2**30  # over the embedded default
    with pytest.raises(ConfigError, match="not both"):
        merge_configs({}, {"cpu_bytes": "1GiB", "cpu_bytes_to_use": "2GiB"})  # one source, both names


def test_cpu_blocks_split_across_ranks():
    cfg = load_config({"cpu_bytes": "1MiB"})
    assert num_cpu_blocks(cfg, 1024, world_size=1) == 1024
    assert num_cpu_blocks(cfg, 1024, world_size=2) == 512
    assert num_cpu_blocks(load_config({"num_cpu_blocks": 7}), 1024, 4) == 7
    with pytest.raises(ConfigError, match="cpu_bytes"):
        num_cpu_blocks(load_config({"cpu_bytes": 1000}), 1024)


def test_vllms_cpu_bytes_to_use_is_an_alias_of_cpu_bytes():
    """Users moving from vLLM's built-in CPU offload write its key; issue 12 item 10."""
    assert load_config({"cpu_bytes_to_use": "1GiB"}).cpu_bytes == 2**30
    with pytest.raises(ConfigError, match="not both"):
        load_config({"cpu_bytes_to_use": "1GiB", "cpu_bytes": "2GiB"})
    with pytest.raises(ConfigError, match=r"cpu_bytes_to_use \(alias of cpu_bytes\)"):
        load_config({"cpu_byte": "1GiB"})


@pytest.mark.parametrize(("bad", "key", "allowed"), [
    ({"cpu_bytes": "１２３"}, "cpu_bytes", "positive int"),  # unicode digits
    ({"cpu_bytes": "9" * 400 + "GiB"}, "cpu_bytes", "up to 1 EiB"),  # was an OverflowError
    ({"cpu_bytes": 2**70}, "cpu_bytes", "up to 1 EiB"),
    ({"transfer": {"num_streams": 100000}}, "transfer.num_streams", "<= 64"),  # started threads until a crash
    ({"transfer": {1: "cpu"}}, "transfer.1", "string keys"),  # named <root>, "allowed: None"
])
def test_config_holes_are_refused_naming_the_key(bad, key, allowed):
    """Issue 12 item 6."""
    with pytest.raises(ConfigError, match=allowed) as info:
        load_config(bad)
    assert info.value.key == key


@pytest.mark.parametrize("text", ["[]\n", "false\n", "0\n"])
def test_a_yaml_file_that_is_not_a_mapping_is_refused(tmp_path, text):
    path = tmp_path / "offload.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="a mapping of config keys"):
        load_config(path)


def test_an_empty_yaml_file_means_the_defaults(tmp_path):
    path = tmp_path / "offload.yaml"
    path.write_text("")
    assert load_config(path).store_policy == "lazy"


def test_a_key_given_twice_is_refused(tmp_path):
    path = tmp_path / "offload.yaml"
    path.write_text("store_policy: lazy\ncpu_bytes: 1GiB\nstore_policy: eager\n")
    with pytest.raises(ConfigError, match="each key once") as info:
        load_config(path)
    assert info.value.key == "store_policy" and "line 3" in str(info.value)


def test_a_missing_config_file_says_where_it_was_looked_for(tmp_path, monkeypatch):
    """Issue 12 item 7: a relative config_file did not say which directory it was resolved against."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=f"looked for {tmp_path / 'nope.yaml'}"):
        load_config("nope.yaml")


def test_unreadable_config_files_are_config_errors(tmp_path):
    """A NUL byte in the path, a file that is not UTF-8 text: one ConfigError each, no raw traceback."""
    with pytest.raises(ConfigError, match="config_file"):
        load_config("bad\0name.yaml")
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="readable UTF-8"):
        load_config(str(binary))


@pytest.mark.parametrize(("text", "guess"), [
    ("64mb", "'64MiB' or '64MB'"), ("8gib", "'8GiB' or '8GB'"), ("8G", "'8GiB' or '8GB'"), ("2Ki", "'2KiB' or '2KB'"),
    ("8 tIb", "'8TiB' or '8TB'"), ("1x", ""),
])
def test_a_size_unit_outside_the_documented_ones_is_refused_with_the_allowed_forms(text, guess):
    """Issue 41: `64mb` was read as decimal megabytes without a word; units are taken as documented."""
    with pytest.raises(ConfigError) as info:
        load_config({"cpu_bytes": text})
    message = str(info.value)
    assert f"got {text!r}; allowed: a positive int (bytes) or a number with a unit, written in this case" in message
    assert ("did you mean " + guess + "?") in message if guess else "did you mean" not in message


def test_a_parsed_size_remembers_how_it_was_written():
    cfg = load_config({"cpu_bytes": "8B", "disk": {"path": "d", "bytes": "2GiB"}})
    assert cfg.cpu_bytes == 8 and written(cfg.cpu_bytes) == "8B"
    assert cfg.disk.bytes == 2 * 2**30 and written(cfg.disk.bytes) == "2GiB"
    assert written(load_config({"cpu_bytes": 4096}).cpu_bytes) == 4096


@pytest.mark.parametrize(("data", "key", "guess"), [
    ({"store_polcy": "lazy"}, "store_polcy", "'store_policy'"),
    ({"cpu_bytes_to_us": "1GiB"}, "cpu_bytes_to_us", "'cpu_bytes_to_use'"),
    ({"transfer": {"backnd": "cpu"}}, "transfer.backnd", "'backend'"),
    ({"disk": {"path": "d", "byte": "1GiB"}}, "disk.byte", "'bytes'"),
    ({"eviction": "LRU"}, "eviction", "'lru'"),
])
def test_a_near_miss_gets_did_you_mean(data, key, guess):
    with pytest.raises(ConfigError) as info:
        load_config(data)
    assert info.value.key == key and f"did you mean {guess}?" in str(info.value)


@pytest.mark.parametrize(("key", "instead"), [
    ("kv_offloading_size", "cpu_bytes"), ("kv-offloading-size", "cpu_bytes"), ("kv_offloading_backend", "no such key"),
    ("eviction_policy", "eviction: 'lru' | 'arc'"), ("block_size", "vLLM's --block-size"),
])
def test_vllms_own_offload_options_say_what_to_use_instead(key, instead):
    with pytest.raises(ConfigError) as info:
        load_config({key: 8})
    message = str(info.value)
    assert f"allowed: {instead}" in message or instead in message.split("allowed: ")[1]
    assert f"{key} is an option of vLLM's own CPU offload, not of OffloadConnector" in message


def test_an_error_from_a_file_names_the_file_or_says_the_key_was_left_at_its_default(tmp_path):
    path = tmp_path / "offload.yaml"
    path.write_text("eviction: lfu\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).endswith(f"(in {path.resolve()})")
    err = ConfigError("cpu_bytes", "8GiB", "<= 1 GiB here")
    assert str(locate(err, [("kv_connector_extra_config", {}), ("/x/offload.yaml", {"eviction": "arc"})])).endswith(
        "(not set in kv_connector_extra_config or /x/offload.yaml: the default)")
    assert str(locate(err, [("kv_connector_extra_config", {"cpu_bytes_to_use": "8GiB"})])).endswith(
        "(in kv_connector_extra_config)")  # vLLM's name for it
