"""Mooncake-format request traces: reading them and turning hash ids into token ids.

A trace is JSON Lines (gzip-compressed when the name ends in `.gz`), one request per line: `timestamp` (ms),
`input_length` (prompt tokens), `output_length` (tokens to generate), `hash_ids` (one id per 512-token block
of the prompt; ids are chained, so equal ids at the same position mean equal prefixes) and optionally
`session` (the client session that issued the request; a session's last line is its last request).
Two traces are bundled (`BUNDLED_TRACES`, by name): `synthetic` (Mooncake) and `agentic` (coding-agent
sessions, with `session`); see offload_connector/cli/data/NOTICE*.

Invariants kept here:
- `read_trace` either returns every request of the file or raises `TraceError` naming the file, the
  1-based line number, the key and what is allowed; blank lines are skipped.
- Token synthesis is a pure function of the hash id: equal hash ids always give equal token blocks, so
  the engine's chained block hashes reproduce the trace's chains; distinct ids give distinct blocks.
- `scaled=True` makes one trace block one engine block: `block_size` tokens per full hash id, and the
  output length scaled by `block_size / 512`. A partial last block stays partial: its tokens are scaled
  the same way (rounded down, at least one), so the engine caches (hashes) exactly the blocks it would
  cache at full size, never the tail a full-size prompt leaves partial.

Imports nothing from the project and no torch.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import msgspec
import numpy as np

TRACE_BLOCK_TOKENS = 512
VOCAB_SIZE = 32000
BUNDLED_TRACE = "mooncake_synthetic_trace.jsonl"
BUNDLED_TRACES = {"synthetic": BUNDLED_TRACE, "agentic": "agentic_trace.jsonl.gz"}  # name -> file in data/


class TraceError(ValueError):
    """A malformed trace: the message names the file, the line, the key and what is allowed."""


class TraceRequest(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    timestamp: int | float
    input_length: int
    output_length: int
    hash_ids: list[int]
    session: str | None = None


_decoder = msgspec.json.Decoder(TraceRequest)


def bundled_trace_path(name: str = "synthetic") -> Path:
    """Path of a bundled trace by name (`BUNDLED_TRACES`; Apache-2.0, see offload_connector/cli/data/NOTICE*)."""
    if name not in BUNDLED_TRACES:
        raise TraceError(f"unknown bundled trace {name!r}; allowed: {', '.join(BUNDLED_TRACES)}")
    return Path(str(resources.files("offload_connector.cli.data").joinpath(BUNDLED_TRACES[name])))


def resolve_trace(name_or_path: str | None) -> Path:
    """A bundled trace's name (or None: `synthetic`) or a file path, as a path."""
    if name_or_path is None or name_or_path in BUNDLED_TRACES:
        return bundled_trace_path(name_or_path or "synthetic")
    return Path(name_or_path)


def _check(path: str, lineno: int, req: TraceRequest) -> None:
    def fail(key: str, value: object, allowed: str) -> TraceError:
        return TraceError(f"{path}:{lineno}: invalid '{key}': got {value!r}; allowed: {allowed}")

    if isinstance(req.timestamp, bool) or req.timestamp < 0:
        raise fail("timestamp", req.timestamp, "a number >= 0 (milliseconds)")
    if req.input_length < 1:
        raise fail("input_length", req.input_length, "an int >= 1")
    if req.output_length < 1:
        raise fail("output_length", req.output_length, "an int >= 1")
    want = -(-req.input_length // TRACE_BLOCK_TOKENS)
    if len(req.hash_ids) != want:
        raise fail("hash_ids", f"{len(req.hash_ids)} ids", f"ceil(input_length / 512) = {want} ids")
    if any(h < 0 or h >= 1 << 64 for h in req.hash_ids):
        bad = next(h for h in req.hash_ids if h < 0 or h >= 1 << 64)
        raise fail("hash_ids", bad, "ints in [0, 2**64)")


def iter_trace(path: str | Path) -> Iterator[TraceRequest]:
    """Yield the requests of a trace file in order; raise TraceError at the first malformed line."""
    name = str(path)
    try:
        fh = gzip.open(path, "rb") if name.endswith(".gz") else open(path, "rb")
    except OSError as exc:
        raise TraceError(f"cannot open trace {name!r}: {exc.strerror}") from None
    with fh:
        lineno = 0
        try:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                yield _decode_line(name, lineno, line)
        except (OSError, EOFError) as exc:  # a broken gzip stream
            raise TraceError(f"{name}:{lineno + 1}: cannot read ({exc})") from None


def _decode_line(name: str, lineno: int, line: bytes) -> TraceRequest:
    try:
        req = _decoder.decode(line)
    except msgspec.ValidationError as exc:
        raise TraceError(f"{name}:{lineno}: {exc}; expected keys timestamp, input_length, "
                         "output_length (ints), hash_ids (list of ints), optional session (a string)") from None
    except msgspec.DecodeError as exc:
        raise TraceError(f"{name}:{lineno}: not a JSON object ({exc})") from None
    _check(name, lineno, req)
    return req


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """The first `limit` requests (all when None) of a trace file."""
    out: list[TraceRequest] = []
    for req in iter_trace(path):
        if limit is not None and len(out) >= limit:
            break
        out.append(req)
    return out


def block_tokens(hash_id: int, num_tokens: int) -> np.ndarray:
    """The first `num_tokens` tokens of the block named `hash_id`: a fixed pseudo-random function of it."""
    return _mix(np.full(max(0, num_tokens), hash_id, dtype=np.uint64), np.arange(max(0, num_tokens), dtype=np.uint64))


def _mix(hash_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Token `positions[k]` of block `hash_ids[k]`, for every k at once (uint64 arrays)."""
    with np.errstate(over="ignore"):
        x = hash_ids * np.uint64(0x9E3779B97F4A7C15) + (positions + np.uint64(1)) * np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(31)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(29)
    return (x % np.uint64(VOCAB_SIZE)).astype(np.int64)


def prompt_length(req: TraceRequest, block_size: int, scaled: bool) -> int:
    """Prompt tokens: as recorded, or scaled (full blocks `block_size` each, a partial tail scaled down,
    at least one token, and still shorter than a block)."""
    if not scaled:
        return req.input_length
    full, tail = divmod(req.input_length, TRACE_BLOCK_TOKENS)
    if tail == 0:
        return full * block_size
    return full * block_size + min(block_size - 1, max(1, tail * block_size // TRACE_BLOCK_TOKENS))


def output_length(req: TraceRequest, block_size: int, scaled: bool) -> int:
    if not scaled:
        return req.output_length
    return max(1, -(-req.output_length * block_size // TRACE_BLOCK_TOKENS))


def prompt_tokens(req: TraceRequest, block_size: int, scaled: bool) -> list[int]:
    """Token ids of a trace request's prompt (see the module docstring for `scaled`)."""
    per_block = block_size if scaled else TRACE_BLOCK_TOKENS
    length = prompt_length(req, block_size, scaled)
    # Block i holds tokens [i * per_block, (i + 1) * per_block) of the prompt, clipped to its length: all
    # blocks at once (one numpy pass per request, not per block).
    counts = np.clip(length - np.arange(len(req.hash_ids)) * per_block, 0, per_block)
    hash_ids = np.repeat(np.array(req.hash_ids, dtype=np.uint64), counts)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    positions = (np.arange(len(hash_ids)) - starts).astype(np.uint64)
    return _mix(hash_ids, positions).tolist()
