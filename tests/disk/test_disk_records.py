"""Records of the disk tier on real files: every read is verified, and a record that fails any check is a
miss (its CPU block reported failed, never served as KV) and is deleted from disk."""

from __future__ import annotations

import os
import shutil

import pytest
from disk_helpers import IDENTITY, OTHER_MODEL, block, fill, key, make_io, make_pool, record_path, run

from offload_connector.disk.format import HEADER_BYTES, Sealer, rank_fingerprint, record_bytes

AUTH = b"k" * 32


@pytest.fixture
def pool():
    return make_pool()


def written(tmp_path, pool, n=3, **kw):
    """An I/O engine with blocks 1..n written under keys 1..n; returns (io, their bytes)."""
    io = make_io(tmp_path / "disk", pool, **kw)
    data = [fill(pool, i, seed=i) for i in range(1, n + 1)]
    result = run(io, "write", 0, list(range(1, n + 1)), [key(i) for i in range(1, n + 1)])
    assert result.failed_keys == []
    for i in range(1, n + 1):
        fill(pool, i, seed=1000 + i)  # the rows now hold something else
    return io, data


def test_round_trip_is_bit_exact_and_files_are_private(tmp_path, pool):
    io, data = written(tmp_path, pool)
    # 1. the records are complete files, private to this user, no temporaries left
    names = sorted(os.listdir(io.dir))
    assert len(names) == 3 and all(n.endswith(".kv") for n in names)
    assert os.stat(tmp_path / "disk").st_mode & 0o777 == 0o700
    assert all(os.stat(os.path.join(io.dir, n)).st_mode & 0o777 == 0o600 for n in names)
    assert os.path.getsize(record_path(io, key(1))) == record_bytes(pool.bytes_per_block)
    # 2. reading them into other rows gives the same bytes
    result = run(io, "read", 1, [5, 6, 7], [key(1), key(2), key(3)])
    assert result.failed_keys == [] and result.dropped_keys == []
    assert [block(pool, c) for c in (5, 6, 7)] == data
    assert io.counters.read_blocks == 3 and io.counters.written_blocks == 3
    io.close()


def test_a_missing_record_is_a_miss_kept_out_of_dropped(tmp_path, pool):
    io, _ = written(tmp_path, pool, n=1)
    result = run(io, "read", 1, [4], [key(9)])
    assert result.failed_keys == [key(9)] and result.dropped_keys == []
    assert io.counters.read_miss_blocks == 1
    io.close()


@pytest.mark.parametrize("where", ["payload", "header length", "header key", "header padding",
                                   "last payload byte", "padding after the payload"])
def test_a_flipped_byte_is_a_miss_and_the_record_is_deleted(tmp_path, pool, where):
    io, _ = written(tmp_path, pool, n=1)
    path = record_path(io, key(1))
    offset = {"payload": HEADER_BYTES + 100, "header length": 8, "header key": 80, "header padding": 1000,
              "last payload byte": HEADER_BYTES + pool.bytes_per_block - 1,
              "padding after the payload": HEADER_BYTES + pool.bytes_per_block + 5}[where]
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))
    result = run(io, "read", 1, [4], [key(1)])
    assert result.failed_keys == [key(1)] and result.dropped_keys == [key(1)]
    assert io.counters.corrupt_blocks + io.counters.foreign_blocks == 1 and io.counters.read_blocks == 0
    assert not os.path.exists(path)
    io.close()


def test_a_truncated_record_is_a_miss(tmp_path, pool):
    io, _ = written(tmp_path, pool, n=2)
    os.truncate(record_path(io, key(1)), HEADER_BYTES + 10)
    os.truncate(record_path(io, key(2)), 0)
    result = run(io, "read", 1, [4, 5], [key(1), key(2)])
    assert sorted(result.failed_keys) == [key(1), key(2)] and sorted(result.dropped_keys) == [key(1), key(2)]
    assert io.counters.corrupt_blocks == 2
    io.close()


def test_another_models_record_under_our_name_is_foreign(tmp_path, pool):
    """A record of another model (its own directory) copied into ours: the fingerprint refuses it."""
    other = make_io(tmp_path / "other", pool, identity=OTHER_MODEL)
    fill(pool, 1, seed=1)
    run(other, "write", 0, [1], [key(1)])
    ours = make_io(tmp_path / "disk", pool)
    assert ours.dir != other.dir  # another model never even looks in this directory ...
    shutil.copy(record_path(other, key(1)), record_path(ours, key(1)))  # ... but a copy is refused too
    result = run(ours, "read", 1, [4], [key(1)])
    assert result.dropped_keys == [key(1)] and ours.counters.foreign_blocks == 1
    other.close()
    ours.close()


def test_another_ranks_or_keys_record_is_foreign(tmp_path, pool):
    rank1 = make_io(tmp_path / "disk", pool, rank=1, world_size=2)
    rank0 = make_io(tmp_path / "disk", pool, rank=0, world_size=2)
    fill(pool, 1, seed=1)
    run(rank1, "write", 0, [1], [key(1)])
    run(rank0, "write", 1, [1], [key(2)])
    shutil.copy(record_path(rank1, key(1)), record_path(rank0, key(1)))  # rank 1's bytes for rank 0
    os.rename(record_path(rank0, key(2)), record_path(rank0, key(3)))  # key 2's record named key 3
    result = run(rank0, "read", 2, [4, 5], [key(1), key(3)])
    assert sorted(result.dropped_keys) == [key(1), key(3)] and rank0.counters.foreign_blocks == 2
    rank0.close()
    rank1.close()


def forge(path: str, pool, cpu_block_id: int, cache_key: bytes, auth_key: bytes | None) -> None:  # noqa: ANN001
    """Write a record with a valid plain checksum (and a keyed hash under `auth_key`, when given)."""
    from worker_side.tiers.disk.records import PoolSegments
    segments = PoolSegments.from_pool(pool).segments(cpu_block_id)
    header = Sealer(rank_fingerprint(IDENTITY, 0, 1), auth_key).seal(cache_key, segments, pool.bytes_per_block)
    with open(path, "wb") as f:
        f.write(header + b"".join(bytes(s) for s in segments))
        f.write(bytes(record_bytes(pool.bytes_per_block) - f.tell()))


def test_with_an_auth_key_a_record_forged_without_it_is_a_miss(tmp_path, pool):
    io, data = written(tmp_path, pool, n=1, auth_key=AUTH)
    # 1. a signed record reads back
    assert run(io, "read", 1, [4], [key(1)]).failed_keys == [] and block(pool, 4) == data[0]
    # 2. a poisoned block with a valid plain checksum but no keyed hash: refused
    fill(pool, 2, seed=666)
    forge(record_path(io, key(5)), pool, 2, key(5), auth_key=None)
    # 3. one signed with another key: refused
    forge(record_path(io, key(6)), pool, 2, key(6), auth_key=b"x" * 32)
    result = run(io, "read", 2, [5, 6], [key(5), key(6)])
    assert sorted(result.dropped_keys) == [key(5), key(6)] and io.counters.foreign_blocks == 2
    io.close()


def test_a_signed_record_is_refused_without_the_key(tmp_path, pool):
    signer, _ = written(tmp_path, pool, n=1, auth_key=AUTH)
    signer.close()
    reader = make_io(tmp_path / "disk", pool)
    assert run(reader, "read", 1, [4], [key(1)]).dropped_keys == [key(1)]
    reader.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_record_owned_by_another_user_is_never_served_nor_deleted(tmp_path, pool):
    io, _ = written(tmp_path, pool, n=1)
    path = record_path(io, key(1))
    os.chown(path, 12345, 12345)
    result = run(io, "read", 1, [4], [key(1)])
    assert result.failed_keys == [key(1)] and io.counters.foreign_blocks == 1
    assert os.path.exists(path)  # not ours to delete
    io.close()


def test_writes_copy_the_rows_before_returning(tmp_path, pool):
    """The scheduler holds nothing for a write: the rows may be reused as soon as submit_write returns."""
    io = make_io(tmp_path / "disk", pool)
    data = fill(pool, 1, seed=1)
    io.submit_write(0, [1], [key(1)])
    fill(pool, 1, seed=2)  # reused at once
    assert io.wait_idle(30) and io.poll()[0].failed_keys == []
    run(io, "read", 1, [3], [key(1)])
    assert block(pool, 3) == data
    io.close()


def test_writes_beyond_the_inflight_bound_are_dropped(tmp_path, pool):
    io = make_io(tmp_path / "disk", pool, max_inflight_bytes=pool.bytes_per_block)
    result = run(io, "write", 0, [1, 2, 3], [key(1), key(2), key(3)])
    assert len(result.failed_keys) == 2 and io.counters.dropped_writes == 2 and io.counters.written_blocks == 1
    io.close()


def test_a_record_already_there_is_not_written_again(tmp_path, pool):
    io, data = written(tmp_path, pool, n=1)
    before = os.stat(record_path(io, key(1))).st_mtime_ns
    assert run(io, "write", 1, [2], [key(1)]).failed_keys == []
    assert io.counters.write_exists == 1 and io.counters.written_blocks == 1
    assert os.stat(record_path(io, key(1))).st_mtime_ns == before
    io.close()
