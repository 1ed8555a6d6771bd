"""The bad-input catalogue (SPEC §6, docs/RELIABILITY.md): one test per case, through the real
Pipeline -> shard -> iterate path.

Default policy: the record is skipped deterministically and counted by reason, and the ledger
balances (read == emitted + filtered + skipped). With `on_error="raise"` the first bad record
fails the run with `BadRecordError` naming its address (dataset, shard, index).
Storage-level failures (a shard gone) are not record errors: they fail with the shard's URL.
"""

from __future__ import annotations

import json
import os
import random
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from tests.reliability.harness import (
    PER_SHARD,
    SHARDS,
    TOKENIZER,
    address,
    assert_ledger_balances,
    clean_records,
    global_batch,
    jsonl_dataset,
    pair_tar,
    pixels_by_address,
    run_epoch,
    tar_bytes,
    text_pipeline,
    token_values_of,
    tokens_by_record,
    vlm_pipeline,
    words,
    write_lines,
)
from tests.unit.test_vlm_assets import (  # the shared bad-image makers
    cmyk_jpeg,
    encode,
    gradient,
    palette_alpha_png,
    png_header_only,
    sixteen_bit_png,
    truncated_jpeg,
)
from vlm import ImageSpec, decode_image, patchify
from zephon import BadRecordError, ConfigurationError, Pipeline
from zephon.io import Dataset, ShardUnavailableError, _dataset, _local
from zephon.work import ScheduledMixtureWorkSource


def fail_fast(pipeline) -> BadRecordError:
    with pytest.raises(BadRecordError) as info:
        run_epoch(pipeline.options(on_error="raise"), keep_batches=False)
    return info.value


# -- line-level cases ----------------------------------------------------------------------------
BAD_LINES = {
    "malformed_json": b'{"text": "a line cut in the middle',
    "blank_line": b"",
    "invalid_utf8": b'{"text": "caf\xe9 au lait"}',
    "not_an_object": b'["a", "list", "not", "an", "object"]',
    "missing_field": json.dumps({"id": "x", "body": "the text is under another key"}).encode(),
    "not_text": json.dumps({"id": "x", "text": 12345}).encode(),
    # a null is no text, as a Parquet null is: counted as the field missing
    "null_text": json.dumps({"id": "x", "text": None}).encode(),
    "empty_document": json.dumps({"id": "x", "text": " \n\t "}).encode(),
    # valid JSON and valid UTF-8, but the string holds a lone surrogate: it has no UTF-8 form to tokenize
    "lone_surrogate": b'{"text": "caf\\ud800 au lait"}',
    # two values of one key: json.loads kept the last, dropping the other unsaid
    "duplicate_key": b'{"id": "x", "text": "the first text", "text": "the second text"}',
}
REASON = {"blank_line": "malformed_json", "lone_surrogate": "invalid_utf8", "null_text": "missing_field"}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_line_is_skipped_and_counted_by_reason(tmp_path, case):
    dataset = jsonl_dataset(tmp_path, {(1, 5): BAD_LINES[case], (0, 11): BAD_LINES[case]})
    run = run_epoch(text_pipeline(dataset))
    reason = REASON.get(case, case)
    assert run.skipped("d") == Counter({reason: 2})
    assert_ledger_balances(run, {"d": SHARDS * PER_SHARD})
    used = set(tokens_by_record(run.batches))
    assert address(dataset, 1, 5) not in used and address(dataset, 0, 11) not in used
    assert len(used) == SHARDS * PER_SHARD - 2, "every other record is delivered"


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_line_fails_fast_naming_its_address_with_on_error_raise(tmp_path, case):
    dataset = jsonl_dataset(tmp_path, {(1, 5): BAD_LINES[case]})
    error = fail_fast(text_pipeline(dataset))
    assert error.address == address(dataset, 1, 5)
    assert error.reason == REASON.get(case, case)
    assert str(error.address) in str(error) and "part-00001.jsonl#5" in str(error)


@pytest.mark.parametrize("line", [b"", b"  \t", b"\r"])
def test_a_blank_line_is_said_to_be_one(tmp_path, line):
    """Its detail was JSON's "Expecting value: line 1 column 1 (char 0)" (column 2 for a CRLF
    file's blank line), the words for a broken record, sending the user to look for one."""
    error = fail_fast(text_pipeline(jsonl_dataset(tmp_path, {(1, 5): line})))
    assert (error.reason, error.detail) == ("malformed_json", "a blank line, which holds no record")


@pytest.mark.parametrize("text, said", [
    ("", "field 'text' is empty"),
    (" \n\t ", "field 'text' holds only whitespace (4 characters)"),
    ("caf\ud800 au lait", "field 'text' holds a lone surrogate (as a JSON \\ud800 escape makes), which has no UTF-8 form"),
])
def test_a_text_that_cannot_be_tokenized_is_said_why(tmp_path, text, said):
    """The detail of an empty_document or invalid_utf8 skip was the field's name alone."""
    dataset = jsonl_dataset(tmp_path, {(1, 5): json.dumps({"id": "x", "text": text}).encode()})
    assert fail_fast(text_pipeline(dataset)).detail == said


@pytest.mark.parametrize("value, named", [(12345, "an int"), (["a", "list"], "a list"), ({"a": 1}, "a dict")])
def test_a_text_field_that_is_not_a_string_is_named_with_what_it_holds(tmp_path, value, named):
    """A caption that is a number or a list: the detail (in `BadRecordError` and
    `stats()["skipped_examples"]`) said only `field 'text'`, leaving the user to guess what was wrong."""
    line = json.dumps({"id": "x", "text": value}).encode()
    dataset = jsonl_dataset(tmp_path, {(1, 5): line})
    error = fail_fast(text_pipeline(dataset))
    assert error.reason == "not_text"
    assert error.detail == f"field 'text' holds {named}, not a string"


def _errors_on_every_rank(pipeline, world_size: int) -> list[tuple[int, str]]:
    """(rank, message) of each `BadRecordError` the ranks of `world_size` raised, each building its
    loader and iterating it to the end."""
    errors = []
    for rank in range(world_size):
        with pipeline.shard(rank, world_size, global_batch_size=global_batch(pipeline)) as loader:
            try:
                for _ in loader:
                    pass
            except BadRecordError as error:
                errors.append((rank, str(error)))
    return errors


@pytest.mark.parametrize("case", ["empty_document", "missing_field", "malformed_json"])
def test_on_error_raise_fails_when_training_reaches_a_bad_record_not_while_the_token_estimate_samples(
    tmp_path, case
):
    """The token estimate reads a sample while `shard()` plans, in an order of its own: a stage's
    bad record (`empty_document`, `missing_field`; a read's was skipped there already) failed
    inside `shard()` under `on_error="raise"`, from planning, naming whichever bad record the
    sample held first. Now the estimate skips and counts it, and the run fails where training
    reaches it, naming its file and index, the same error on one rank and on two."""
    dataset = jsonl_dataset(tmp_path, {(1, 5): BAD_LINES[case]})
    pipeline = text_pipeline(dataset, estimate_tokens=True, on_error="raise")
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:  # plans without failing
        with pytest.raises(BadRecordError) as info:
            for _ in loader:
                pass
    error = info.value
    assert error.address == address(dataset, 1, 5) and error.reason == REASON.get(case, case)
    assert "part-00001.jsonl#5" in str(error)
    assert _errors_on_every_rank(pipeline, 1) == [(0, str(error))]
    assert [message for _, message in _errors_on_every_rank(pipeline, 2)] == [str(error)]


# -- a document far longer than the context --------------------------------------------------------
MAX_LENGTH = 64


@pytest.fixture(scope="module")
def huge_document_corpus(tmp_path_factory):
    """Shard 1, line 3 holds a document of more than 1000 x MAX_LENGTH tokens."""
    rng = random.Random("huge")
    text = words(rng, 1000 * MAX_LENGTH + 500)
    root = tmp_path_factory.mktemp("huge")
    dataset = jsonl_dataset(root, {(1, 3): json.dumps({"id": "huge", "text": text}).encode()})
    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    return dataset, tokenizer.encode(text, add_special_tokens=False).ids + [tokenizer.token_to_id("<|eos|>")]


def test_huge_document_is_wrapped_into_rows_with_every_token_delivered(huge_document_corpus):
    dataset, tokens = huge_document_corpus
    assert len(tokens) > 1000 * MAX_LENGTH
    run = run_epoch(text_pipeline(dataset, max_length=MAX_LENGTH, algorithm="wrap"))
    huge = address(dataset, 1, 3)
    assert tokens_by_record(run.batches)[huge] == len(tokens)
    assert token_values_of(run.batches, huge) == Counter(tokens)
    assert run.skipped("d") == Counter() and run.totals["d"]["emitted"] == SHARDS * PER_SHARD
    assert_ledger_balances(run, {"d": SHARDS * PER_SHARD})


def test_huge_document_is_cut_into_max_length_pieces_by_first_fit(huge_document_corpus):
    dataset, tokens = huge_document_corpus
    run = run_epoch(text_pipeline(dataset, max_length=MAX_LENGTH, algorithm="first_fit"))
    huge = address(dataset, 1, 3)
    rows_of_huge = [
        (row_sources, batch.tokens["document_ids"][row])
        for batch in run.batches
        for row, row_sources in enumerate(batch.sources)
        if huge in row_sources
    ]
    whole_rows = [s for s, doc_ids in rows_of_huge if s == (huge,) and (doc_ids == 0).all()]
    assert len(whole_rows) >= (len(tokens) - 1) // MAX_LENGTH, "every piece but the last fills a row alone"
    assert len(rows_of_huge) <= len(whole_rows) + 1
    assert tokens_by_record(run.batches)[huge] == len(tokens)
    assert token_values_of(run.batches, huge) == Counter(tokens)
    assert_ledger_balances(run, {"d": SHARDS * PER_SHARD})


# -- a recipe that drops every record ------------------------------------------------------------
def _first_batches(pipeline, count: int) -> list:
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        iterator = iter(loader)
        return [next(iterator) for _ in range(count)]


@pytest.mark.parametrize("runner", ["inline", "thread"])
def test_endless_plan_that_drops_every_record_fails_naming_why_instead_of_spinning(tmp_path, runner):
    """A misnamed field drops every record: an endless plan would read the data forever without
    a row (100 % CPU, no error), so the lane gives up after reading its share twice over, saying
    how to see the first record dropped and why: the reasons alone did not name the field."""
    dataset = jsonl_dataset(tmp_path)
    with pytest.raises(ConfigurationError, match=r"read \d+ records in a row and handed over no row "
                                                 r"\(dropped: missing_field: \d+\).*on_error=\"raise\""):
        _first_batches(text_pipeline(dataset, field="body", num_epochs=None, runner=runner), 1)
    with pytest.raises(BadRecordError, match="field 'body'"):
        _first_batches(text_pipeline(dataset, field="body", num_epochs=None, runner=runner, on_error="raise"), 1)


class _OnlyLaneZeroReads:
    """A user's work source: lane 0 gets the chunks of `inner`'s lane 0, every other lane only
    empty slots, for ever. Past `spin` empty slots it raises, so a loader that spins fails the
    test instead of hanging it."""

    def __init__(self, inner, spin: int) -> None:
        self.inner, self.spin = inner, spin

    def bind(self, count_tokens, num_lanes):
        return _OnlyLaneZeroReadsPlan(self.inner.bind(count_tokens, num_lanes), self.spin)


class _OnlyLaneZeroReadsPlan:
    def __init__(self, plan, spin: int) -> None:
        self.plan, self.spin, self.empty_slots = plan, spin, 0
        self.datasets, self.num_lanes = plan.datasets, plan.num_lanes

    def slot(self, lane, s):
        if lane == 0:
            return self.plan.slot(0, s)
        self.empty_slots += 1
        if self.empty_slots > self.spin:
            raise RuntimeError(f"{self.empty_slots} empty slots read and still no error: the loader spins")
        return None

    def num_slots(self, lane):
        return None

    def fingerprint(self) -> dict:
        return {"kind": "only_lane_zero_reads", "inner": self.plan.fingerprint()}


@pytest.mark.parametrize("runner", ["inline", "thread"])
def test_endless_work_plan_giving_a_lane_only_empty_slots_fails_naming_the_lane_instead_of_spinning(
    tmp_path, monkeypatch, runner
):
    """A WorkPlan may leave slots empty (None): a lane an endless plan leaves empty for ever was
    read for ever, queueing a flush per segment without bound (no row, no error)."""
    monkeypatch.setattr("zephon.work._plan.EMPTY_SLOTS_LIMIT", 64)
    recipe = text_pipeline(jsonl_dataset(tmp_path), num_epochs=None, runner=runner, num_lanes=2)
    pipeline = Pipeline(_OnlyLaneZeroReads(recipe.source, spin=100 * 64), operators=recipe.operators,
                        options=recipe.settings)
    with pytest.raises(ConfigurationError, match=r"gave lane 1 no chunk in 64 slots in a row"):
        _first_batches(pipeline, 2)


def test_finite_plan_that_drops_every_record_fails_at_its_end_with_every_record_counted(tmp_path):
    """It ended with no batch and no error: a training job that "succeeded" after zero steps."""
    pipeline = text_pipeline(jsonl_dataset(tmp_path), field="body", num_epochs=1)
    records = SHARDS * PER_SHARD
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        with pytest.raises(ConfigurationError, match=rf"lanes read {records} records and handed over no row "
                                                     rf"\(dropped: missing_field: {records}\).*on_error=\"raise\""):
            list(loader)
        assert loader.stats()["datasets"]["d"]["total"]["skipped"] == {"missing_field": records}


def test_endless_plan_keeps_going_on_a_few_surviving_records_or_one_good_dataset(tmp_path):
    """The guard does not fire on a recipe that makes rows, however few records survive: one
    record per chunk kept by a filter, or a mixture whose other dataset drops every record."""
    dataset = jsonl_dataset(tmp_path / "d")
    sparse = text_pipeline(dataset, num_epochs=None, filter_fn=lambda record: record["id"] in ("r3", "r7", "r11", "r15"))
    assert len(_first_batches(sparse, 40)) == 40
    no_text = json.dumps({"id": "x", "body": "the text is under another key"}).encode()
    broken = jsonl_dataset(tmp_path / "e", {(s, i): no_text for s in range(SHARDS) for i in range(PER_SHARD)}, name="e")
    assert len(_first_batches(text_pipeline([dataset, broken], num_epochs=None), 40)) == 40


def test_a_schedule_phase_that_draws_only_on_dropped_records_does_not_stop_the_plan(tmp_path):
    """A middle phase may draw only on a dataset whose records some lane drops: that lane reads
    no row for the whole phase, then makes rows again when the next phase brings the good
    dataset back. The guard waits for the last phase before it counts epochs."""
    good = jsonl_dataset(tmp_path / "a", name="a")
    no_text = json.dumps({"id": "x", "body": "the text is under another key"}).encode()
    all_but_one = {(s, i): no_text for s in range(SHARDS) for i in range(PER_SHARD) if (s, i) != (0, 0)}
    mostly_dropped = jsonl_dataset(tmp_path / "b", all_but_one, name="b")  # one lane gets no record of b
    source = ScheduledMixtureWorkSource([good, mostly_dropped], [(0, {"a": 1, "b": 1}), (200, {"b": 1}), (2000, {"a": 1, "b": 1})],
                                        records_per_chunk=4, num_epochs=None)
    pipeline = Pipeline(source).options(num_lanes=2, runner="inline", flush_every_chunks=2).tokenize(
        str(TOKENIZER), eos="<|eos|>").pack_flat(64).batch(2)
    assert len(_first_batches(pipeline, 300)) == 300


# -- shards: empty, vanished, shrunk -------------------------------------------------------------
def test_zero_length_shard_holds_no_records_and_changes_no_batch(tmp_path):
    plain = jsonl_dataset(tmp_path / "plain")
    jsonl_dataset(tmp_path / "with_empty")
    (tmp_path / "with_empty" / "part-00000_empty.jsonl").write_bytes(b"")  # sorts between the two shards
    with_empty = Dataset.from_path("d", str(tmp_path / "with_empty"))
    assert [s.num_records for s in with_empty.shards] == [PER_SHARD, 0, PER_SHARD]
    reference = run_epoch(text_pipeline(plain), keep_batches=False)
    run = run_epoch(text_pipeline(with_empty), keep_batches=False)
    assert run.digests == reference.digests
    assert run.totals == reference.totals
    assert_ledger_balances(run, {"d": SHARDS * PER_SHARD})
    assert run_epoch(text_pipeline(with_empty, on_error="raise"), keep_batches=False).digests == reference.digests


@pytest.mark.parametrize("runner", ["inline", "process"])
def test_shard_deleted_between_planning_and_reading_fails_naming_its_url(tmp_path, runner):
    dataset = jsonl_dataset(tmp_path, retries=2, retry_delay=0.01)
    pipeline = text_pipeline(dataset, runner=runner)
    with pipeline.shard(0, 1, global_batch_size=8) as loader:  # planned; nothing read yet
        os.remove(dataset.shards[1].url)
        with pytest.raises(ShardUnavailableError) as info:
            list(loader)
    assert info.value.url == dataset.shards[1].url
    assert dataset.shards[1].url in str(info.value) and info.value.attempts == 2


@pytest.mark.parametrize("runner", ["inline", "process"])
def test_shard_made_unreadable_after_planning_fails_naming_its_url_and_the_denial(tmp_path, runner, monkeypatch):
    """`chmod 000` on a shard mid-run. Root reads it anyway, so the test has the open refused as
    the kernel refuses an unprivileged user (the process runner's forked workers inherit it): the
    denial is retried like any storage error, then ends the run naming the file and the denial."""
    dataset = jsonl_dataset(tmp_path, retries=2, retry_delay=0.01)
    denied = dataset.shards[1].url
    os.chmod(denied, 0)
    real_open = open

    def kernel_open(path, *args, **kwargs):
        if str(path) == denied:
            raise PermissionError(13, os.strerror(13), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(_local, "open", kernel_open, raising=False)
    pipeline = text_pipeline(dataset, runner=runner)
    with pipeline.shard(0, 1, global_batch_size=8) as loader:
        with pytest.raises(ShardUnavailableError) as info:
            list(loader)
    assert info.value.url == denied and info.value.attempts == 2
    assert "PermissionError" in info.value.cause and denied in str(info.value)


def test_shard_cut_short_after_planning_fails_naming_it_or_counts_its_lost_records_where_no_version_is_told(
    tmp_path, monkeypatch
):
    """A file cut after planning is another version of it (its size and mtime changed): the run
    fails naming it, since a cut cannot be told from a rewrite. On storage that tells no version
    (an HTTP server sending neither ETag nor Last-Modified) the records it lost are counted."""
    dataset = jsonl_dataset(tmp_path / "versioned")
    shard = Path(dataset.shards[0].url)
    lines = shard.read_bytes().split(b"\n")
    shard.write_bytes(b"\n".join(lines[:10]) + b"\n")
    with pytest.raises(ShardUnavailableError, match="changed after planning") as info:
        run_epoch(text_pipeline(dataset))
    assert info.value.url == str(shard)

    monkeypatch.setattr(_dataset, "version_of", lambda fs, path: None)
    dataset = jsonl_dataset(tmp_path / "unversioned")
    shard = Path(dataset.shards[0].url)
    lines = shard.read_bytes().split(b"\n")
    shard.write_bytes(b"\n".join(lines[:10]) + b"\n")  # 10 of the 16 planned lines remain
    run = run_epoch(text_pipeline(dataset))
    assert run.skipped("d") == Counter({"truncated_shard": 6})
    assert_ledger_balances(run, {"d": SHARDS * PER_SHARD})
    error = fail_fast(text_pipeline(dataset))
    assert error.reason == "truncated_shard" and error.address in {address(dataset, 0, i) for i in range(10, 16)}


# -- Parquet --------------------------------------------------------------------------------------
def _parquet(path: Path, table: pa.Table) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=5)


def test_parquet_shard_without_the_text_column_skips_its_rows_as_missing_field(tmp_path):
    """Decided behaviour: a schema is a per-shard fact, so a shard that lacks the field is not an
    error of the dataset; each of its rows is skipped as `missing_field` (on_error="raise" fails on
    its first row), and shards with the right schema are read as usual."""
    good = clean_records(PER_SHARD, 0)
    _parquet(tmp_path / "part-0.parquet", pa.Table.from_pylist(good))
    wrong = [{"id": r["id"], "body": r["text"]} for r in clean_records(PER_SHARD, 1)]
    _parquet(tmp_path / "part-1.parquet", pa.Table.from_pylist(wrong))
    typed = [{"id": i, "text": i * 7} for i in range(8)]  # a text column of integers
    _parquet(tmp_path / "part-2.parquet", pa.Table.from_pylist(typed))
    dataset = Dataset.from_path("d", str(tmp_path))
    run = run_epoch(text_pipeline(dataset))
    assert run.skipped("d") == Counter({"missing_field": PER_SHARD, "not_text": 8})
    assert run.totals["d"]["emitted"] == PER_SHARD
    assert_ledger_balances(run, {"d": 2 * PER_SHARD + 8})
    error = fail_fast(text_pipeline(dataset))
    assert error.reason in ("missing_field", "not_text") and error.address.shard.endswith(".parquet")


def test_parquet_string_that_is_not_utf8_skips_its_row_as_invalid_utf8(tmp_path):
    rows = clean_records(PER_SHARD, 0)
    rows[6]["text"] = "MARKER " + rows[6]["text"]
    sink = tmp_path / "part-0.parquet"
    pq.write_table(pa.Table.from_pylist(rows), sink, use_dictionary=False, compression="NONE")
    # pyarrow checks no UTF-8 when it reads pages, only when it converts (statistics hold copies too)
    sink.write_bytes(sink.read_bytes().replace(b"MARKER", b"\xffARKER"))
    _parquet(tmp_path / "part-1.parquet", pa.Table.from_pylist(clean_records(PER_SHARD, 1)))
    dataset = Dataset.from_path("d", str(tmp_path))
    run = run_epoch(text_pipeline(dataset))
    assert run.skipped("d") == Counter({"invalid_utf8": 1})
    assert_ledger_balances(run, {"d": 2 * PER_SHARD})
    assert fail_fast(text_pipeline(dataset)).address == address(dataset, 0, 6)


def test_parquet_shard_with_corrupt_pages_fails_naming_the_shard(tmp_path):
    _parquet(tmp_path / "part-0.parquet", pa.Table.from_pylist(clean_records(PER_SHARD, 0)))
    _parquet(tmp_path / "part-1.parquet", pa.Table.from_pylist(clean_records(PER_SHARD, 1)))
    dataset = Dataset.from_path("d", str(tmp_path), retries=2, retry_delay=0.01)
    corrupt = Path(dataset.shards[1].url)
    data = bytearray(corrupt.read_bytes())
    data[4 : len(data) // 2] = bytes(len(data) // 2 - 4)  # pages zeroed, footer intact
    planned = corrupt.stat()
    corrupt.write_bytes(bytes(data))
    os.utime(corrupt, ns=(planned.st_atime_ns, planned.st_mtime_ns))  # bit rot: the version planned
    with pytest.raises(ShardUnavailableError) as info:
        run_epoch(text_pipeline(dataset), keep_batches=False)
    assert info.value.url == str(corrupt) and str(corrupt) in str(info.value)
    assert "changed after planning" not in str(info.value), "the decoder, not the version check, refused it"


def test_a_corrupt_compressed_parquet_page_fails_at_once_not_retried_as_storage(tmp_path, caplog):
    """pyarrow reports a snappy page it cannot decompress as a bare OSError, which was taken for a
    storage error: retried with backoff, each retry logged as a failed read, before the same
    refusal. The chunk's bytes were all read into memory by then, so it is the data, at once."""
    rows = clean_records(PER_SHARD, 0)
    sink = tmp_path / "part-0.parquet"
    pq.write_table(pa.Table.from_pylist(rows), sink, compression="snappy", use_dictionary=False)
    data = bytearray(sink.read_bytes())
    first_page = pq.ParquetFile(sink).metadata.row_group(0).column(0).data_page_offset
    data[first_page + 24 : first_page + 64] = bytes(40)  # the page's compressed bytes, header kept
    sink.write_bytes(bytes(data))
    dataset = Dataset.from_path("d", str(tmp_path), retries=3, retry_delay=0.01)
    with pytest.raises(ShardUnavailableError) as info:
        dataset.read_chunk(dataset.chunks(records_per_chunk=PER_SHARD)[0], on_error="skip")
    assert info.value.url == str(sink) and "undecodable Parquet" in str(info.value), str(info.value)
    assert info.value.attempts == 1, str(info.value)
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]


def test_a_storage_error_while_parquet_row_groups_decode_is_still_retried(tmp_path, monkeypatch):
    """The other side of the corrupt page above: an OSError of the shard's own read while pyarrow
    decodes (here its first, of the chunk's read-ahead) is storage, retried as before;
    only one no read raised is the data's. Nothing checked this: taking every OSError there for
    the data's passed every other test."""
    from zephon.io import _parquet as parquet_format
    from zephon.io import _parquet_spans

    _parquet(tmp_path / "part-0.parquet", pa.Table.from_pylist(clean_records(PER_SHARD, 0)))
    dataset = Dataset.from_path("d", str(tmp_path), retries=3, retry_delay=0.01)
    failures = {"left": 1}

    class FailingOnce:
        def __init__(self, file):
            self._file = file

        def seek(self, *args):
            return self._file.seek(*args)

        def read(self, size=-1):
            if failures["left"]:
                failures["left"] -= 1
                raise OSError("connection reset by peer")
            return self._file.read(size)

    spanned = _parquet_spans.spanned
    monkeypatch.setattr(parquet_format, "spanned", lambda file, metadata, groups: spanned(FailingOnce(file), metadata, groups))
    records = dataset.read_chunk(dataset.chunks(records_per_chunk=PER_SHARD)[0], on_error="skip").records
    assert not failures["left"] and len(records) == PER_SHARD


def test_parquet_page_whose_checksum_fails_fails_naming_the_shard(tmp_path):
    """A flipped bit in an uncompressed page decodes to another record: only the page checksum,
    where the writer stored one, tells, and pyarrow checks it only when asked."""
    rows = clean_records(PER_SHARD, 0)
    rows[6]["text"] = "MARKER " + rows[6]["text"]
    sink = tmp_path / "part-0.parquet"
    pq.write_table(pa.Table.from_pylist(rows), sink, use_dictionary=False, compression="NONE",
                   write_page_checksum=True)
    sink.write_bytes(sink.read_bytes().replace(b"MARKER", b"MARKET"))
    dataset = Dataset.from_path("d", str(tmp_path), retries=1)
    with pytest.raises(ShardUnavailableError, match="checksum") as info:
        run_epoch(text_pipeline(dataset), keep_batches=False)
    assert info.value.url == str(sink)


@pytest.mark.parametrize("suffix", [".parquet", ".tar", ".jsonl.zst"])
def test_shard_that_is_not_a_file_of_its_format_fails_planning_naming_it(tmp_path, suffix):
    shard = tmp_path / f"part-0{suffix}"
    shard.write_bytes(random.Random(3).randbytes(4096))
    with pytest.raises(Exception) as info:
        Dataset.from_path("d", str(tmp_path), retries=1)
    error = info.value
    named = str(shard) in str(error) or f"while planning shard {shard}" in " ".join(getattr(error, "__notes__", []))
    assert named, f"{type(error).__name__}: {error}"


# -- WebDataset tars ------------------------------------------------------------------------------
def _text_tar(path: Path, records: list[dict], drop_text: set[int] = frozenset()) -> bytes:
    data = tar_bytes([
        [(f"k{i:03d}.json", json.dumps({"id": r["id"]}).encode())]
        + ([] if i in drop_text else [(f"k{i:03d}.txt", r["text"].encode())])
        for i, r in enumerate(records)
    ])
    path.write_bytes(data)
    return data


def test_truncated_tar_shard_counts_the_cut_record_as_truncated_shard(tmp_path):
    _text_tar(tmp_path / "a-000.tar", clean_records(PER_SHARD, 0))
    data = _text_tar(tmp_path / "a-001.tar", clean_records(PER_SHARD, 1))
    # Each record is two members of 1024 bytes (header + one data block): cut inside record 12's text.
    (tmp_path / "a-001.tar").write_bytes(data[: 12 * 2048 + 1024 + 512 + 40])
    dataset = Dataset.from_path("t", str(tmp_path))
    assert [s.num_records for s in dataset.shards] == [PER_SHARD, 13], "planning sees the cut record's header"
    run = run_epoch(text_pipeline(dataset, field="txt"))
    assert run.skipped("t") == Counter({"truncated_shard": 1})
    assert_ledger_balances(run, {"t": PER_SHARD + 13})
    error = fail_fast(text_pipeline(dataset, field="txt"))
    assert error.reason == "truncated_shard" and error.address == address(dataset, 1, 12)
    assert "tar cut short" in error.detail


def test_tar_with_a_damaged_header_fails_planning_naming_the_shard(tmp_path):
    """tarfile ends its walk at a header that does not parse as if the archive ended there: the
    records after it would have left the plan unseen, with nothing counted."""
    data = bytearray(_text_tar(tmp_path / "a-000.tar", clean_records(PER_SHARD, 0)))
    data[4 * 2048] ^= 0x20  # one flipped bit in the name of record 4's first member: its checksum fails
    (tmp_path / "a-000.tar").write_bytes(bytes(data))
    with pytest.raises(tarfile.ReadError, match="damaged tar header at byte 8192") as info:
        Dataset.from_path("t", str(tmp_path))
    assert f"while planning shard {tmp_path / 'a-000.tar'}" in " ".join(info.value.__notes__)


def test_tar_cut_inside_a_header_plans_the_records_before_the_cut(tmp_path):
    """Like a cut between records, a cut inside a header looks like a shorter tar to planning."""
    data = _text_tar(tmp_path / "a-000.tar", clean_records(PER_SHARD, 0))
    (tmp_path / "a-000.tar").write_bytes(data[: 6 * 2048 + 200])
    assert [s.num_records for s in Dataset.from_path("t", str(tmp_path)).shards] == [6]


def test_tar_record_holding_one_member_twice_is_skipped_as_duplicate_member(tmp_path):
    """Which of the two captions is the record's is not known: keeping the last was a silent guess."""
    (tmp_path / "a-000.tar").write_bytes(tar_bytes([
        [("k000.txt", b"the first caption"), ("k000.txt", b"the second caption")], [("k001.txt", b"a caption")],
    ]))
    dataset = Dataset.from_path("t", str(tmp_path))
    read = dataset.read_chunk(dataset.chunks(2)[0])
    assert read.records == [{"__key__": "k001", "txt": "a caption"}]
    assert [(a.index, reason) for a, reason in read.skipped] == [(0, "duplicate_member")]
    with pytest.raises(BadRecordError, match="duplicate_member"):
        dataset.read_chunk(dataset.chunks(2)[0], on_error="raise")


def test_tar_record_missing_its_text_member_is_skipped_as_missing_field(tmp_path):
    """Text side of a broken pair; a pair missing its image is `missing_image` (see
    tests/unit/test_vlm_bad_images_pipeline.py and the image cases below)."""
    _text_tar(tmp_path / "a-000.tar", clean_records(PER_SHARD, 0), drop_text={2, 9})
    _text_tar(tmp_path / "a-001.tar", clean_records(PER_SHARD, 1))
    dataset = Dataset.from_path("t", str(tmp_path))
    run = run_epoch(text_pipeline(dataset, field="txt"))
    assert run.skipped("t") == Counter({"missing_field": 2})
    assert_ledger_balances(run, {"t": 2 * PER_SHARD})
    error = fail_fast(text_pipeline(dataset, field="txt"))
    assert error.reason == "missing_field" and error.address in (address(dataset, 0, 2), address(dataset, 0, 9))


# -- images through decode_images ---------------------------------------------------------------
SPEC = ImageSpec(max_pixels=64 * 64)
IMAGES_PER_SHARD = 6


def _corrupt_jpeg() -> bytes:
    """A JPEG whose header parses but whose start-of-scan segment is zeroed: the decoder fails."""
    data = bytearray(encode(gradient(48, 64), "JPEG", quality=90))
    sos = data.index(b"\xff\xda")
    data[sos + 2 : sos + 12] = bytes(10)
    return bytes(data)


BAD_IMAGES = {
    "corrupt_jpeg": ("jpg", _corrupt_jpeg, "corrupt_image"),
    "truncated_jpeg": ("jpg", truncated_jpeg, "truncated_image"),
    "garbage_bytes": ("jpg", lambda: bytes(random.Random(5).randbytes(3000)), "corrupt_image"),
    "decompression_bomb_header": ("png", lambda: png_header_only(20000, 20000), "decompression_bomb"),
}
CONVERTED = {"cmyk_jpeg": ("jpg", cmyk_jpeg), "sixteen_bit_png": ("png", sixteen_bit_png),
             "palette_alpha_png": ("png", palette_alpha_png)}


def _pairs_dataset(root: Path, odd: tuple[str, bytes] | None) -> Dataset:
    """2 shards of 6 pairs each; shard 1's pair 2 gets the `odd` image."""
    for shard in range(2):
        pairs = [(f"s{shard}-{i}", "png", encode(gradient(40 + 8 * i, 56 + 4 * shard))) for i in range(IMAGES_PER_SHARD)]
        if odd is not None and shard == 1:
            pairs[2] = (f"s{shard}-2", *odd)
        pair_tar(root / f"pairs-{shard}.tar", pairs)
    return Dataset.from_path("pairs", str(root))


@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
def test_bad_image_is_skipped_by_reason_or_fails_fast_naming_its_address(tmp_path, case):
    extension, make, reason = BAD_IMAGES[case]
    dataset = _pairs_dataset(tmp_path, (extension, make()))
    run = run_epoch(vlm_pipeline(dataset, SPEC))
    assert run.skipped("pairs") == Counter({reason: 1})
    assert_ledger_balances(run, {"pairs": 2 * IMAGES_PER_SHARD})
    assert address(dataset, 1, 2) not in pixels_by_address(run.batches)
    assert len(pixels_by_address(run.batches)) == 2 * IMAGES_PER_SHARD - 1
    error = fail_fast(vlm_pipeline(dataset, SPEC))
    assert error.reason == reason and error.address == address(dataset, 1, 2)


@pytest.mark.parametrize("case", sorted(CONVERTED))
def test_odd_image_mode_is_converted_to_rgb_not_skipped(tmp_path, case):
    extension, make = CONVERTED[case]
    data = make()
    dataset = _pairs_dataset(tmp_path, (extension, data))
    run = run_epoch(vlm_pipeline(dataset, SPEC, on_error="raise"))
    assert run.skipped("pairs") == Counter()
    assert_ledger_balances(run, {"pairs": 2 * IMAGES_PER_SHARD})
    expected = patchify(np.ascontiguousarray(decode_image(data, SPEC)), SPEC.patch_size)
    delivered = pixels_by_address(run.batches)[address(dataset, 1, 2)]
    assert delivered.dtype == np.uint8 and np.array_equal(delivered, expected)


# -- the same dirty corpus, the same result --------------------------------------------------------
def test_dirty_corpus_gives_the_same_digests_and_stats_on_every_run_and_world_size(tmp_path, huge_document_corpus):
    replace = {(0, 1): BAD_LINES["malformed_json"], (0, 4): BAD_LINES["invalid_utf8"],
               (1, 2): BAD_LINES["missing_field"], (1, 7): BAD_LINES["empty_document"],
               (1, 9): BAD_LINES["not_an_object"], (0, 13): BAD_LINES["blank_line"]}
    dirty = jsonl_dataset(tmp_path / "dirty", replace)
    (tmp_path / "dirty" / "part-00002.jsonl").write_bytes(b"")
    dirty = Dataset.from_path("d", str(tmp_path / "dirty"))
    huge, _ = huge_document_corpus
    huge = Dataset.from_path("huge", huge.url)

    def pipeline(runner: str = "inline"):
        return text_pipeline([dirty, huge], runner=runner, estimate_tokens=True)

    first = run_epoch(pipeline(), keep_batches=False)
    assert first.skipped("d") == Counter({"malformed_json": 2, "invalid_utf8": 1, "missing_field": 1,
                                          "empty_document": 1, "not_an_object": 1})
    assert_ledger_balances(first, {"d": SHARDS * PER_SHARD, "huge": SHARDS * PER_SHARD})
    again = run_epoch(pipeline(), keep_batches=False)
    on_four = run_epoch(pipeline("thread"), world_size=4, keep_batches=False)
    for other in (again, on_four):
        assert other.digests == first.digests
        assert other.totals == first.totals


# -- token ids given in the data (no tokenize) ---------------------------------------------------
BAD_TOKEN_FIELDS = {
    "missing_field": {"id": "x"},
    "not_tokens": {"id": "x", "ids": "a string, not token ids"},
    "negative_id": {"id": "x", "ids": [5, -1, 7]},
    "id_past_int32": {"id": "x", "ids": [5, 2**31, 7]},
    "fractional_ids": {"id": "x", "ids": [1.5, 2.5]},
    "nested_ids": {"id": "x", "ids": [[1, 2], [3, 4]]},
    "bool_among_ids": {"id": "x", "ids": [5, True, 7]},  # a JSON `true`, which NumPy read as token 1
    "empty_document": {"id": "x", "ids": []},
}
TOKEN_REASON = {"negative_id": "not_tokens", "id_past_int32": "not_tokens", "fractional_ids": "not_tokens",
                "nested_ids": "not_tokens", "bool_among_ids": "not_tokens"}


@pytest.mark.parametrize("algorithm", ["wrap", "first_fit"])
@pytest.mark.parametrize("case", sorted(BAD_TOKEN_FIELDS))
def test_packing_token_ids_from_the_data_skips_a_record_without_usable_ids_by_reason(tmp_path, case, algorithm):
    """Without a tokenizer the packer reads ids straight from the records: a record without the
    field used to stop the run with a bare KeyError, one with text a bare ValueError, an id past
    int32 wrapped silently and an empty list was 'emitted' with nothing packed."""
    good = [json.dumps({"id": f"r{i}", "ids": list(range(1, i + 2))}).encode() for i in range(PER_SHARD)]
    for shard in range(SHARDS):
        lines = list(good)
        if shard == 1:
            lines[5] = json.dumps(BAD_TOKEN_FIELDS[case]).encode()
        write_lines(tmp_path / f"part-{shard:05d}.jsonl", lines)
    dataset = Dataset.from_path("d", str(tmp_path))
    source = ScheduledMixtureWorkSource([dataset], [(0, {"d": 1})], records_per_chunk=4, num_epochs=1)
    pipeline = Pipeline(source).options(num_lanes=4, runner="inline", flush_every_chunks=2).pack_flat(
        16, algorithm, field="ids").batch(2)
    run = run_epoch(pipeline)
    assert run.skipped("d") == Counter({TOKEN_REASON.get(case, case): 1})
    assert_ledger_balances(run, {"d": SHARDS * PER_SHARD})
    delivered = sum(int(np.count_nonzero(b.tokens["document_ids"] >= 0)) for b in run.batches)
    expected = SHARDS * sum(i + 1 for i in range(PER_SHARD)) - (5 + 1)  # record 5 of shard 1 replaced
    assert delivered == expected
