"""Fuzzing the shard readers: random bytes and structures as JSON Lines, tar, Parquet and Arrow shards.

What must hold for any input:
- planning a shard either works or fails naming the shard (never a bare error from deep inside);
- once planned, reading a chunk never raises under on_error="skip" (a shard that changed after
  planning included), and every record slot of the chunk comes back exactly once, as a record or
  as a skip with one of the documented reasons;
- under on_error="raise" a read fails exactly when some slot would be skipped, with BadRecordError;
- through the whole pipeline, the ledger accounts for every slot of the shard.
"""

from __future__ import annotations

import gzip
import io
import json
import tarfile
import tempfile
import zlib
from contextlib import contextmanager, nullcontext
from pathlib import Path
from unittest import mock

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from hypothesis import HealthCheck, example, given
from hypothesis import strategies as st

from tests.fuzz.conftest import fuzz_settings
from tests.reliability.harness import assert_ledger_balances, run_epoch, text_pipeline
from zephon import BadRecordError, ConfigurationError
from zephon.io import (REASONS, Dataset, ShardUnavailableError, _compression, _dataset, _resume_points,
                       _seekable_copy)

SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]


@contextmanager
def shard_dir():
    with tempfile.TemporaryDirectory(prefix="zephon-fuzz-") as root:
        yield Path(root)


def plan(root: Path, name: str, *, intact: bool, **options) -> Dataset | None:
    """The planned dataset, or None when planning refused the shard, naming it.

    An `intact` shard (the writer's bytes, undamaged and uncut) must plan: accepting any named
    refusal for every input let a planner that refused every shard pass the tests below."""
    shard = next(p for p in sorted(root.iterdir()) if p.is_file())
    try:
        return Dataset.from_path("f", str(root), retries=1, retry_delay=0, **options)
    except ShardUnavailableError as error:
        assert not intact, f"an intact shard was refused: {error}"
        assert error.url == str(shard)
    except Exception as error:  # noqa: BLE001 - a format library's own error, which must name the shard
        assert not intact, f"an intact shard was refused: {type(error).__name__}: {error}"
        notes = " ".join(getattr(error, "__notes__", []))
        assert f"while planning shard {shard}" in notes, f"{type(error).__name__}: {error} does not name {name}"
    return None


def check_every_slot_accounted(dataset: Dataset, records_per_chunk: int, *, unreadable_ok: bool = False) -> int:
    """Read every chunk with both policies; return how many slots were skipped.

    With `unreadable_ok` a chunk may also fail as a whole with ShardUnavailableError naming the
    shard (Parquet: pyarrow reports corrupt pages as OSError, see docs/RELIABILITY.md)."""
    skipped_total = 0
    for shard_index, shard in enumerate(dataset.shards):
        seen = []
        for chunk in dataset.chunks(records_per_chunk):
            if chunk.shard != shard_index:
                continue
            try:
                out = dataset.read_chunk(chunk, on_error="skip")
            except ShardUnavailableError as error:
                assert unreadable_ok and error.url == shard.url, error
                return skipped_total
            assert all(isinstance(r, dict) for r in out.records)
            assert {reason for _, reason in out.skipped} <= REASONS
            indexes = sorted([a.index for a in out.addresses] + [a.index for a, _ in out.skipped])
            assert indexes == list(range(chunk.start, chunk.stop)), "each slot exactly once"
            assert all(a.shard == shard.url and a.dataset == "f" for a in out.addresses)
            seen.extend(indexes)
            skipped_total += len(out.skipped)
            try:
                strict = dataset.read_chunk(chunk, on_error="raise")
            except BadRecordError as error:
                assert out.skipped and (error.address, error.reason) == out.skipped[0]
            else:
                assert not out.skipped and len(strict.records) == chunk.num_records
        assert seen == list(range(shard.num_records))
    return skipped_total


# -- JSON Lines ---------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10,
)
records = st.fixed_dictionaries({"text": st.text(max_size=60)}, optional={"id": st.integers()})
lines = st.one_of(
    records.map(lambda r: json.dumps(r).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.text(max_size=40).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.just(b"["),  # a pretty-printed array's first line
    st.binary(max_size=60).map(lambda b: b.replace(b"\n", b"")),
    # objects written pair by pair, so that a key may come twice (json.dumps of a dict never repeats one)
    st.lists(st.tuples(st.sampled_from(["text", "id"]), json_values), max_size=4).map(
        lambda pairs: ("{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in pairs) + "}").encode()),
)


def _expected_reason(line: bytes) -> str | None:
    """An independent oracle of the JSON Lines rules."""
    objects = []
    try:
        value = json.loads(line.decode("utf-8"), object_pairs_hook=lambda pairs: objects.append(pairs) or dict(pairs))
    except UnicodeDecodeError:
        return "invalid_utf8"
    except ValueError:
        return "malformed_json"
    if any(len({key for key, _ in pairs}) < len(pairs) for pairs in objects):
        return "duplicate_key"
    return None if isinstance(value, dict) else "not_an_object"


def _one_array(data: bytes) -> bool:
    """An independent oracle of the one rule that refuses a whole JSON Lines shard: one JSON array
    (its first line "[" alone, or one line opening with "["), not one object per line."""
    first_line = data.removeprefix(b"\xef\xbb\xbf").split(b"\n")[0].strip(b" \t\r")
    one_line = data.count(b"\n") == 0 or data.count(b"\n") == 1 and data.endswith(b"\n")
    return bool(data) and (first_line == b"[" or one_line and first_line.startswith(b"["))


@fuzz_settings(ci=40, suppress_health_check=SLOW_OK)
@given(
    body=st.lists(lines, max_size=30),
    final_newline=st.booleans(),
    compression=st.sampled_from([None, "gz", "zst"]),
    frame_ends=st.lists(st.floats(0, 1), max_size=4),
    cut=st.none() | st.floats(0, 1),
    flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), max_size=3),
    records_per_chunk=st.integers(1, 7),
)
def test_jsonl_reader_accounts_for_every_line(body, final_newline, compression, frame_ends, cut, flips,
                                              records_per_chunk):
    """`frame_ends` cut a compressed shard into frames or members anywhere, inside a line too: a
    read may enter at one (`_lines.entry_points`)."""
    data = b"\n".join(body) + (b"\n" if final_newline and body else b"")
    suffix = {None: "", "gz": ".gz", "zst": ".zst"}[compression]
    codec = {None: lambda b: b, "gz": gzip.compress, "zst": zstandard.ZstdCompressor().compress}[compression]
    ends = sorted({int(end * len(data)) for end in frame_ends} - {0} | {len(data)}) if compression else [len(data)]
    stored = b"".join(codec(data[begin:end]) for begin, end in zip([0, *ends], ends))
    damaged = bytearray(stored)
    for where, value in flips if compression else ():  # a corrupt compressed stream
        if damaged:
            damaged[min(int(where * len(damaged)), len(damaged) - 1)] = value
    intact = bytes(damaged) == stored
    stored = bytes(damaged)
    if cut is not None:
        intact = intact and int(len(stored) * cut) == len(stored)
        stored = stored[: int(len(stored) * cut)]
    with shard_dir() as root:
        (root / f"shard.jsonl{suffix}").write_bytes(stored)
        dataset = plan(root, "shard", intact=intact and not _one_array(data))
        assert dataset is None or not (intact and _one_array(data)), "a shard that is one JSON array was planned"
        if dataset is None:
            return
        skipped = check_every_slot_accounted(dataset, records_per_chunk)
        if cut is None and not (flips and compression):
            slots = data.split(b"\n")[: -1 if data.endswith(b"\n") else None] if data else []
            expected = [_expected_reason(line) for line in slots]
            assert dataset.num_records == len(expected)
            assert skipped == sum(r is not None for r in expected)


@fuzz_settings(ci=40, suppress_health_check=SLOW_OK)
@given(
    body=st.lists(lines | st.binary(min_size=200, max_size=3000).map(lambda b: b.replace(b"\n", b"")), min_size=1,
                  max_size=60),
    bom=st.booleans(),
    member_end=st.none() | st.integers(1, 15),
    padding=st.integers(0, 3),
    cut=st.none() | st.floats(0, 1),
    block=st.integers(4, 64),
    spacing=st.integers(1, 300),
    longest_begun=st.integers(0, 4000),
    records_per_chunk=st.integers(1, 7),
    order=st.randoms(use_true_random=False),
)
def test_a_gzip_stream_read_from_resume_points_gives_what_its_start_gives(
        body, bom, member_end, padding, cut, block, spacing, longest_begun, records_per_chunk, order):
    """Reads of a shard written as one gzip stream (or as members whose first lines all fall in its
    first SEEK_STRIDE lines: one entry point still, and a point may stand after a member), in any
    order and entering at the resume points earlier reads noted (`_resume_points`), give each chunk
    the records and skips a read from the shard's start gives, a stream cut short included."""
    data = (b"\xef\xbb\xbf" if bom else b"") + b"".join(line + b"\n" for line in body)
    lines_of = data.split(b"\n")
    first = b"".join(line + b"\n" for line in lines_of[:member_end]) if member_end else data
    stored = gzip.compress(first) + b"\0" * padding + (gzip.compress(data[len(first):]) if member_end else b"")
    if cut is not None:
        stored = stored[: int(len(stored) * cut)]
    store = _resume_points.ResumePoints(first_spacing=spacing)
    with shard_dir() as root, mock.patch.object(_resume_points, "resume_points", store), \
            mock.patch.object(_compression, "_COMPRESSED_BLOCK_SIZE", block), \
            mock.patch.object(_resume_points, "LONGEST_BEGUN", longest_begun):
        (root / "shard.jsonl.gz").write_bytes(stored)
        dataset = plan(root, "shard", intact=cut is None and not _one_array(data))
        if dataset is None:
            return
        chunks = dataset.chunks(records_per_chunk)
        with mock.patch.object(_resume_points, "key_of", lambda shard: None):
            from_start = [_read(dataset, chunk) for chunk in chunks]
        shuffled = order.sample(range(len(chunks)), len(chunks))
        for k in shuffled + shuffled[::-1]:  # the second time round, from the points the first noted
            assert _read(dataset, chunks[k]) == from_start[k], k


@fuzz_settings(ci=40, suppress_health_check=SLOW_OK)
@given(
    body=st.lists(lines | st.binary(min_size=200, max_size=3000).map(lambda b: b.replace(b"\n", b"")), min_size=1,
                  max_size=60),
    bom=st.booleans(),
    final_newline=st.booleans(),
    compression=st.sampled_from(["gz", "zst"]),
    frame=st.integers(1, 3000),
    cut=st.none() | st.floats(0, 1),
    records_per_chunk=st.integers(1, 7),
    order=st.randoms(use_true_random=False),
)
def test_a_shard_in_one_stream_read_from_its_seekable_copy_gives_what_the_shard_gives(
        body, bom, final_newline, compression, frame, cut, records_per_chunk, order):
    """Planned with a seekable copy in frames of `frame` bytes of text (`_seekable_copy`), reads in
    any order give each chunk the records and skips a read of the shard itself gives; a stream cut
    short gets no copy and is read from itself."""
    data = (b"\xef\xbb\xbf" if bom else b"") + b"\n".join(body) + (b"\n" if final_newline else b"")
    whole = (gzip.compress if compression == "gz" else zstandard.ZstdCompressor().compress)(data)
    stored = whole if cut is None else whole[: int(len(whole) * cut)]
    intact = stored == whole
    with shard_dir() as root, tempfile.TemporaryDirectory(prefix="zephon-fuzz-scans-") as scans, \
            mock.patch.object(_seekable_copy, "COPY_FRAME_BYTES", frame):
        (root / f"shard.jsonl.{compression}").write_bytes(stored)
        plain = plan(root, "shard", intact=intact and not _one_array(data))
        if plain is None:
            return
        copied = plan(root, "shard", intact=True, scan_cache=scans, seekable_copies=True)
        assert copied.shards == plain.shards
        copies = list(Path(scans).glob("*/*.zst*"))
        assert [str(path) for path in copies] == ([copied._access[0].copy] if copied._access[0].copy else [])
        assert not (copies and not intact), "a copy of a stream cut short"
        chunks = plain.chunks(records_per_chunk)
        with mock.patch.object(_resume_points, "key_of", lambda shard: None):
            expected = [_read(plain, chunk) for chunk in chunks]
        for k in order.sample(range(len(chunks)), len(chunks)):
            assert _read(copied, chunks[k]) == expected[k], k


def _read(dataset: Dataset, chunk) -> tuple:
    out = dataset.read_chunk(chunk, on_error="skip")
    return out.records, out.addresses, out.skipped


# -- WebDataset tar -----------------------------------------------------------------------------
member_names = st.tuples(
    st.sampled_from(["a", "A", "b", "dir/c", "d.e", "noext", "x/y/z"]),
    st.sampled_from(["txt", "TXT", "json", "Json", "jpg", "seg.txt", "cls", ""]),
).map(lambda kv: f"{kv[0]}.{kv[1]}" if kv[1] else kv[0])
payloads = st.one_of(st.binary(max_size=80), st.text(max_size=40).map(str.encode),
                     json_values.map(lambda v: json.dumps(v).encode()))


@st.composite
def tar_shards(draw) -> tuple[bytes, bool]:
    """A tar shard's bytes, and whether they are the writer's own (no byte changed, none cut)."""
    members = draw(st.lists(st.tuples(member_names, payloads, st.booleans()), max_size=12))
    sink = io.BytesIO()
    with tarfile.open(fileobj=sink, mode="w", format=draw(st.sampled_from([tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT]))) as tar:
        for name, payload, is_dir in members:
            info = tarfile.TarInfo(name)
            if is_dir:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    written = sink.getvalue()
    data = bytearray(written)
    for _ in range(draw(st.integers(0, 3))):  # flipped bytes anywhere, headers included
        if data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data), bytes(data) == written


@fuzz_settings(ci=40, suppress_health_check=SLOW_OK)
@given(data=tar_shards(), records_per_chunk=st.integers(1, 5), shrink_after_planning=st.none() | st.floats(0, 1))
def test_tar_reader_accounts_for_every_record(data, records_per_chunk, shrink_after_planning):
    data, intact = data
    with shard_dir() as root:
        shard = root / "shard.tar"
        shard.write_bytes(data)
        # A shard cut after planning is another version of its file, refused by name before it is
        # read; planned as on storage that tells no version, the cut meets the reader itself.
        unversioned = shrink_after_planning is not None
        with mock.patch.object(_dataset, "version_of", return_value=None) if unversioned else nullcontext():
            dataset = plan(root, "shard", intact=intact)
        if dataset is None:
            return
        if shrink_after_planning is not None:  # the shard changes between planning and reading
            shard.write_bytes(data[: int(len(data) * shrink_after_planning)])
        check_every_slot_accounted(dataset, records_per_chunk)


def _compressed_tar(tar: bytes, layout: str, piece: int) -> bytes:
    """`tar` compressed whole as one gzip stream, or in gzip members or zstd frames of `piece` bytes."""
    if layout == "gzip stream":
        return gzip.compress(tar)
    compress = gzip.compress if layout == "gzip members" else zstandard.ZstdCompressor().compress
    return b"".join(compress(tar[at:at + piece]) for at in range(0, len(tar), piece))


def _decompressed_prefix(stored: bytes, layout: str) -> bytes:
    """What `stored`, maybe cut short, decompresses to before its end, by its codec's own library."""
    out, rest = [], stored
    while rest:
        decoder = (zstandard.ZstdDecompressor().decompressobj() if layout.startswith("zstd")
                   else zlib.decompressobj(wbits=zlib.MAX_WBITS | 16))
        out.append(decoder.decompress(rest))
        rest = decoder.unused_data
    return b"".join(out)


def _tar_read(dataset: Dataset, chunk) -> tuple:
    """A chunk's records and (index, reason) skips: what does not name the shard's file."""
    read = dataset.read_chunk(chunk, on_error="skip")
    return read.records, [(address.index, reason) for address, reason in read.skipped]


@fuzz_settings(ci=40, suppress_health_check=SLOW_OK)
@given(data=tar_shards(), layout=st.sampled_from(["gzip stream", "gzip members", "zstd frames"]),
       piece=st.integers(64, 3000), cut=st.none() | st.floats(0, 1), block=st.integers(16, 512),
       spacing=st.integers(1, 3000), records_per_chunk=st.integers(1, 5), order=st.randoms(use_true_random=False),
       copy_frame=st.none() | st.integers(64, 4000))
def test_a_compressed_tar_plans_and_reads_as_the_tar_it_decompresses_to(data, layout, piece, cut, block, spacing,
                                                                        records_per_chunk, order, copy_frame):
    """A tar (damaged or not) compressed whole, its stream maybe cut, read in any order from its
    members' or frames' starts and from resume points, or with `copy_frame` from a seekable copy
    in frames of that many bytes (`_seekable_copy`): planned and read as the plain tar of what it
    decompresses to, record for record and reason for reason, or refused where that tar is."""
    stored = _compressed_tar(data[0], layout, piece)
    if cut is not None:
        stored = stored[: int(len(stored) * cut)]
    plain_bytes = _decompressed_prefix(stored, layout)
    store = _resume_points.ResumePoints(first_spacing=spacing)
    with shard_dir() as plain_root, shard_dir() as root, shard_dir() as scans, \
            mock.patch.object(_resume_points, "resume_points", store), \
            mock.patch.object(_compression, "_COMPRESSED_BLOCK_SIZE", block), \
            mock.patch.object(_seekable_copy, "COPY_FRAME_BYTES", copy_frame or 1):
        (plain_root / "shard.tar").write_bytes(plain_bytes)
        (root / ("shard.tar.zst" if layout.startswith("zstd") else "shard.tar.gz")).write_bytes(stored)
        plain = plan(plain_root, "shard", intact=False)
        copies = {"scan_cache": scans, "seekable_copies": True} if copy_frame else {}
        compressed = plan(root, "shard", intact=False, **copies)
        if not plain_bytes and stored:  # cut before anything decompressed: refused, where no tar is empty
            assert compressed is None
            return
        assert (plain is None) == (compressed is None)
        if plain is None:
            return
        assert compressed.num_records == plain.num_records
        chunks = compressed.chunks(records_per_chunk)
        expected = [_tar_read(plain, chunk) for chunk in plain.chunks(records_per_chunk)]
        shuffled = order.sample(range(len(chunks)), len(chunks))
        for k in shuffled + shuffled[::-1]:  # the second time round, from the points the first noted
            assert _tar_read(compressed, chunks[k]) == expected[k], k


# -- Parquet --------------------------------------------------------------------------------------
column_values = {
    "string": st.text(max_size=30),
    "int64": st.integers(-(2**63), 2**63 - 1),
    "double": st.floats(allow_nan=True),
    "bool": st.booleans(),
    "list": st.lists(st.integers(0, 9), max_size=3),
}


def _random_table(draw) -> pa.Table:
    """Up to 25 rows of 1 to 3 columns of random kinds, nulls among their values."""
    names = draw(st.lists(st.sampled_from(["text", "id", "body", "meta"]), min_size=1, max_size=3, unique=True))
    kinds = {name: draw(st.sampled_from(sorted(column_values))) for name in names}
    rows = draw(st.integers(0, 25))
    return pa.table({name: [draw(st.none() | column_values[kind]) for _ in range(rows)]
                     for name, kind in kinds.items()})


def _maybe_damaged(draw, written: bytes) -> tuple[bytes, bool]:
    """`written` with up to 2 bytes changed and maybe cut short, and whether it is still as written."""
    data = bytearray(written)
    for _ in range(draw(st.integers(0, 2))):
        if data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data), bytes(data) == written


@st.composite
def parquet_shards(draw) -> tuple[bytes, bool]:
    """A Parquet shard's bytes, and whether they are the writer's own (no byte changed, none cut)."""
    sink = io.BytesIO()
    pq.write_table(_random_table(draw), sink, row_group_size=draw(st.integers(1, 10)))
    return _maybe_damaged(draw, sink.getvalue())


@fuzz_settings(ci=40, suppress_health_check=SLOW_OK)
@given(data=parquet_shards(), records_per_chunk=st.integers(1, 8))
def test_parquet_reader_accounts_for_every_row(data, records_per_chunk):
    _plan_and_read_a_shard("shard.parquet", *data, records_per_chunk)


def _plan_and_read_a_shard(name: str, data: bytes, intact: bool, records_per_chunk: int) -> None:
    """Plan a shard of `data` named `name` and read every chunk of it (`plan`,
    `check_every_slot_accounted`); a shard pyarrow cannot decode may fail a read, naming it."""
    with shard_dir() as root:
        (root / name).write_bytes(data)
        dataset = plan(root, name.partition(".")[0], intact=intact)
        if dataset is not None:
            check_every_slot_accounted(dataset, records_per_chunk, unreadable_ok=True)


# -- Arrow IPC ------------------------------------------------------------------------------------
@st.composite
def arrow_shards(draw) -> tuple[bytes, bool]:
    """An Arrow IPC shard's bytes (a stream or a file, in random record batches, buffers compressed
    or not), and whether they are the writer's own (no byte changed, none cut)."""
    table = _random_table(draw)
    sink = io.BytesIO()
    new = draw(st.sampled_from([pa.ipc.new_stream, pa.ipc.new_file]))
    options = pa.ipc.IpcWriteOptions(compression=draw(st.sampled_from([None, "zstd"])))
    with new(sink, table.schema, options=options) as writer:
        writer.write_table(table, max_chunksize=draw(st.integers(1, 10)))
    return _maybe_damaged(draw, sink.getvalue())


@fuzz_settings(ci=40, suppress_health_check=SLOW_OK)
@given(data=arrow_shards(), records_per_chunk=st.integers(1, 8))
def test_arrow_reader_accounts_for_every_row(data, records_per_chunk):
    """A damaged message header or buffer is refused naming the shard, at planning or at the read
    of a chunk holding it; no damage reaches Python as a bare error or crashes the process."""
    _plan_and_read_a_shard("shard.arrow", *data, records_per_chunk)


# -- the whole pipeline's ledger ---------------------------------------------------------------------
@fuzz_settings(ci=12, suppress_health_check=SLOW_OK)
@given(shards=st.lists(st.lists(lines, min_size=8, max_size=24), min_size=2, max_size=3))
@example(shards=[[b"not json"] * 8, [b'{"no_text": 1}'] * 8])  # no good record: refused at its end, all counted
@example(shards=[[b"["] + [b'{"text": "a"}'] * 7, [b'{"text": "b"}'] * 8])  # one JSON array: refused at planning
def test_pipeline_ledger_accounts_for_every_slot_of_a_random_corpus(shards):
    """At least 16 slots, so that each of the 4 lanes gets a chunk of 4."""
    with shard_dir() as root:
        total = 0
        for i, body in enumerate(shards):
            data = b"".join(line + b"\n" for line in body)
            (root / f"part-{i}.jsonl").write_bytes(data)
            total += data.count(b"\n")  # a text line may hold a newline of its own
        if any(_one_array(b"".join(line + b"\n" for line in body)) for body in shards):
            with pytest.raises(ConfigurationError, match="is one JSON array, not JSON Lines"):
                Dataset.from_path("f", str(root))
            return
        dataset = Dataset.from_path("f", str(root))
        run = run_epoch(text_pipeline(dataset), keep_batches=False, may_make_no_row=True)
        assert_ledger_balances(run, {"f": total})
        # A corpus with no good record fails at its end, naming why, and only such a one.
        assert bool(run.refused) == (run.totals["f"]["emitted"] == 0), (run.refused, run.totals["f"])
        reasons = {k.split(":", 1)[1] for k in run.totals["f"] if k.startswith("skipped:")}
        assert reasons <= REASONS | {"missing_field", "not_text", "empty_document"}
