"""`stats()["skipped_examples"]` names the first records skipped per dataset and reason, with what
was wrong, and the first of each is logged: the counts alone never said which record to look at."""

from __future__ import annotations

import json
import logging

import pytest

from zephon import Pipeline
from zephon._skip_examples import EXAMPLES_PER_REASON
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

RECORDS = 48
MALFORMED = (5, 17, 40)  # as many as are kept: every one is shown, whichever lane took it first
MISSING_TEXT = (2, 9, 22, 31, 44)  # more than are kept: the first three the loader took are shown


def write_corpus(path):
    lines = []
    for i in range(RECORDS):
        if i in MALFORMED:
            lines.append('{"text": "broken line ' + str(i))
        elif i in MISSING_TEXT:
            lines.append(json.dumps({"body": f"text under another name {i}", "id": i}))
        else:
            lines.append(json.dumps({"text": f"record {i} says something worth training on", "id": i}))
    path.write_text("\n".join(lines) + "\n")
    return path


def pipeline(corpus, tokenizer, runner):
    source = StaticMixtureWorkSource([Dataset.from_path("d", str(corpus))], num_epochs=1, seed=3, records_per_chunk=8)
    return (
        Pipeline(source).options(num_lanes=2, runner=runner)
        .tokenize(tokenizer_id=str(tokenizer), field="text", eos="<|eos|>")
        .pack_flat(max_length=64).batch(microbatch_size=2)
    )


def run(tmp_path, tokenizer, runner):
    corpus = tmp_path / "data.jsonl"
    if not corpus.exists():
        write_corpus(corpus)
    with pipeline(corpus, tokenizer, runner).shard(0, 1, global_batch_size=4) as loader:
        for _ in loader:
            pass
        return corpus, loader.stats(), loader.state_dict()


@pytest.mark.parametrize("runner", ["inline", "thread", "process"])
def test_stats_name_the_first_skipped_records_of_each_reason_with_their_details(tmp_path, demo_tokenizer_path, runner):
    corpus, stats, _ = run(tmp_path, demo_tokenizer_path, runner)
    assert stats["datasets"]["d"]["total"]["skipped"] == {"malformed_json": 3, "missing_field": 5}
    examples = stats["skipped_examples"]["d"]
    assert sorted(examples) == ["malformed_json", "missing_field"]
    malformed = examples["malformed_json"]
    assert sorted(e["index"] for e in malformed) == list(MALFORMED)
    for example in malformed:
        assert example["shard"] == str(corpus) and example["address"] == f"d:{corpus}#{example['index']}"
        assert example["detail"].startswith("JSONDecodeError: "), example
        assert example["lane"] in (0, 1)
    missing = examples["missing_field"]
    assert len(missing) == EXAMPLES_PER_REASON == 3
    assert {e["index"] for e in missing} < set(MISSING_TEXT) and len({e["index"] for e in missing}) == 3
    for example in missing:
        assert example["detail"].startswith("field 'text'; ") and "'body'" in example["detail"], example


def test_every_runner_shows_the_same_examples_in_the_same_order(tmp_path, demo_tokenizer_path):
    """The first by the order the loader takes its lanes' chunks, not by which worker finished first."""
    shown = {runner: run(tmp_path, demo_tokenizer_path, runner)[1]["skipped_examples"]
             for runner in ("inline", "thread", "process")}
    assert shown["thread"] == shown["inline"] and shown["process"] == shown["inline"], shown


def test_the_examples_are_never_in_the_state(tmp_path, demo_tokenizer_path):
    _, stats, state = run(tmp_path, demo_tokenizer_path, "inline")
    saved = json.dumps(state)
    assert stats["skipped_examples"] and "skipped_examples" not in saved
    assert "JSONDecodeError" not in saved and "'body'" not in saved


def test_the_first_skip_of_each_reason_is_logged_once_and_says_where_the_rest_are(
    tmp_path, demo_tokenizer_path, caplog
):
    with caplog.at_level(logging.WARNING, logger="zephon"):
        corpus, stats, _ = run(tmp_path, demo_tokenizer_path, "inline")
    lines = [r.getMessage() for r in caplog.records if r.name == "zephon" and "skipped a record" in r.getMessage()]
    assert len(lines) == 2, lines
    for reason in ("malformed_json", "missing_field"):
        (line,) = [line for line in lines if f" as {reason} at " in line]
        first = stats["skipped_examples"]["d"][reason][0]
        assert line.startswith("dataset 'd': ") and first["address"] in line and first["detail"] in line
        assert "loader.stats()['skipped_examples']" in line and "later skips are counted" in line



def test_a_record_read_again_by_a_new_iteration_is_listed_once(tmp_path, demo_tokenizer_path):
    """Each new iteration replays its lanes from their cursors' segments, skipping those records
    again: a reason with fewer skips than are kept must not list them again."""
    corpus = tmp_path / "data.jsonl"
    corpus.write_text("".join(
        '{"text": "broken line\n' if i == 17 else json.dumps({"text": f"record {i} says something", "id": i}) + "\n"
        for i in range(RECORDS)
    ))
    with pipeline(corpus, demo_tokenizer_path, "inline").shard(0, 1, global_batch_size=4) as loader:
        for _ in range(3):
            for _, _ in zip(range(1), loader):
                pass
        stats = loader.stats()
    assert stats["datasets"]["d"]["total"]["skipped"] == {"malformed_json": 1}
    assert [e["index"] for e in stats["skipped_examples"]["d"]["malformed_json"]] == [17]


def test_a_long_detail_is_cut_in_the_example_and_its_log_line_saying_how_much_was_left_out(caplog):
    """A user's image processor may raise with its input in the message: the example and the
    warning kept all of it, a log line as long as that input."""
    from zephon._records import Chunk, ChunkRecords, RecordAddress
    from zephon._skip_examples import DETAIL_CHARS, SkipExamples

    address = RecordAddress("d", "/data/a.tar", 7)
    detail = "ValueError: " + "x" * (3 * DETAIL_CHARS)
    batch = ChunkRecords(Chunk("d", 0, 0, 8), skip_details={"processor_error": {address: detail}})
    examples = SkipExamples(logging.getLogger("zephon"))
    with caplog.at_level(logging.WARNING, logger="zephon"):
        examples.note_chunk(0, batch)
    kept = examples.snapshot()["d"]["processor_error"][0]["detail"]
    assert kept == f"{detail[:DETAIL_CHARS]}… ({len(detail) - DETAIL_CHARS} more characters)"
    [logged] = [record.getMessage() for record in caplog.records]
    assert kept in logged and detail not in logged


@pytest.mark.parametrize("runner", ["inline", "process"])
def test_a_packers_refusals_are_shown_with_what_the_record_held_and_described_only_when_kept(tmp_path, runner):
    """pack_flat over ids stored in the data: a record whose ids are text, out of range or absent
    is refused by the packer, which named the record and the reason only (`not_tokens: 1` left the
    user to open the shard). Only the examples kept are described: a misnamed field refuses every
    record, and describing each would cost more than packing it."""
    from unittest import mock

    from zephon import _packing

    lines = [{"input_ids": list(range(1, 9)), "id": i} for i in range(RECORDS)]
    lines[3] = {"input_ids": "a caption, not its ids", "id": 3}
    lines[11] = {"input_ids": [5, -1, 7], "id": 11}
    for i in range(20, RECORDS):
        lines[i] = {"input_id": list(range(1, 9)), "id": i}  # misnamed from here on: 28 refusals
    corpus = tmp_path / "ids.jsonl"
    corpus.write_text("".join(json.dumps(line) + "\n" for line in lines))
    source = StaticMixtureWorkSource([Dataset.from_path("d", str(corpus))], num_epochs=1, seed=3, records_per_chunk=8)
    pipeline = Pipeline(source).options(num_lanes=2, runner=runner).pack_flat(max_length=16).batch(microbatch_size=2)
    described = mock.Mock(wraps=_packing._describe_no_tokens)
    with mock.patch.object(_packing, "_describe_no_tokens", described):
        with pipeline.shard(0, 1, global_batch_size=4) as loader:
            for _ in loader:
                pass
            stats = loader.stats()
    assert stats["datasets"]["d"]["total"]["skipped"] == {"missing_field": 28, "not_tokens": 2}
    examples = stats["skipped_examples"]["d"]
    not_tokens = {e["index"]: e["detail"] for e in examples["not_tokens"]}
    assert not_tokens == {
        3: "'input_ids' holds a string of 22 characters (token ids are what `tokenize` writes), "
           "not a flat list of token ids in [0, 2**31)",
        11: "'input_ids' holds ids from -1 to 7, not a flat list of token ids in [0, 2**31)",
    }
    missing = examples["missing_field"]
    assert len(missing) == EXAMPLES_PER_REASON
    assert all(e["detail"] == "it lacks 'input_ids': fields it has: 'id', 'input_id'; did you mean 'input_id'?" for e in missing)
    assert described.call_count == 2 + EXAMPLES_PER_REASON


def test_a_plugin_accumulators_refusals_given_as_pairs_are_kept_without_a_detail():
    """`drain_skips()` of an accumulator written before details (address, reason) is still taken."""
    from zephon._records import RecordAddress
    from zephon._skip_examples import SkipExamples

    examples = SkipExamples(logging.getLogger("zephon"))
    examples.note_skips(1, [(RecordAddress("d", "s", 4), "too_long"), (RecordAddress("d", "s", 5), "too_long", "why")])
    assert [(e["index"], e["detail"]) for e in examples.snapshot()["d"]["too_long"]] == [(4, ""), (5, "why")]
