"""Chained block hashes: chaining, salts, partial blocks, stability across processes."""

import subprocess
import sys

import pytest

from offload_connector.hashing import hash_block_tokens, hash_request_tokens, with_group_id


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_same_block_after_different_prefixes_differs(algo):
    a = hash_request_tokens([1, 2, 3, 4, 9, 9, 9, 9], 4, algo=algo)
    b = hash_request_tokens([5, 6, 7, 8, 9, 9, 9, 9], 4, algo=algo)
    assert a[1] != b[1]
    assert hash_request_tokens([1, 2, 3, 4, 9, 9, 9, 9, 1], 4, algo=algo) == a


def test_salt_separates_tenants_for_the_whole_chain():
    toks = list(range(12))
    plain = hash_request_tokens(toks, 4)
    salted = hash_request_tokens(toks, 4, cache_salt="tenant-a")
    other = hash_request_tokens(toks, 4, cache_salt="tenant-b")
    assert all(p != s != o for p, s, o in zip(plain, salted, other, strict=True))


def test_partial_blocks_get_no_hash():
    assert len(hash_request_tokens(list(range(7)), 4)) == 1
    assert hash_request_tokens([1, 2, 3], 4) == []


def test_incremental_hashing_matches_full():
    toks = list(range(20))
    full = hash_request_tokens(toks, 4)
    tail = hash_request_tokens(toks, 4, start=2, parent=full[1])
    assert full[2:] == tail


def test_extra_keys_change_hash():
    assert hash_block_tokens(None, [1, 2], ("lora-a",)) != hash_block_tokens(None, [1, 2])


def test_group_id_key():
    h = hash_block_tokens(None, [1, 2])
    assert with_group_id(h, 0) != with_group_id(h, 1)
    assert with_group_id(h, 0)[:-4] == h and len(with_group_id(h, 3)) == len(h) + 4


def test_stable_across_processes():
    code = ("from offload_connector.hashing import hash_request_tokens;"
            "print(hash_request_tokens(list(range(8)), 4, cache_salt='s')[-1].hex())")
    out = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
           for _ in range(2)}
    assert out == {hash_request_tokens(list(range(8)), 4, cache_salt="s")[-1].hex() + "\n"}
