"""Loading tokenizers: what identifies them in the recipe, and how their own thread pool is set."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer

from zephon import ConfigurationError, Pipeline, _tokenizer
from zephon._tokenizer import leave_cores_to_workers, load_tokenizer
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource


def test_digest_is_the_tokenizer_files_content(tmp_path, demo_tokenizer_path):
    copy = tmp_path / "tokenizer.json"
    shutil.copy(demo_tokenizer_path, copy)
    same = load_tokenizer(str(copy))
    assert same.digest == load_tokenizer(str(demo_tokenizer_path)).digest
    changed = tmp_path / "changed" / "tokenizer.json"
    changed.parent.mkdir()
    changed.write_text(copy.read_text().replace('"<|eos|>"', '"<|end|>"'))
    assert load_tokenizer(str(changed.parent)).digest != same.digest


@pytest.mark.parametrize("name", ["nope/tokenizer.json", "tokenizer.json", "tok.JSON", "nope/tokenizer.Json", "./nope",
                                  "/nope/tok", "~/nope", "models/nope/latest"])
def test_a_missing_local_tokenizer_path_is_refused_at_once_not_looked_for_on_the_hub(name, monkeypatch):
    from tokenizers import Tokenizer

    def hub(*args, **kwargs):
        raise AssertionError("asked the hub for a local path")

    monkeypatch.chdir("/")
    monkeypatch.setattr(Tokenizer, "from_pretrained", hub)
    with pytest.raises(ConfigurationError, match=f"cannot load tokenizer '{re.escape(name)}': no such file or directory"
                                                 r"( \(a relative path: [^)]*\))?$"):
        load_tokenizer(name)


@pytest.mark.parametrize("name,looked_for_from", [("zephon/data/tokenizr.json", True), ("./tok", True),
                                                  ("/nope/tokenizer.json", False), ("~/nope.json", False)])
def test_a_missing_relative_tokenizer_path_names_the_working_directory_it_was_looked_for_from(
    name, looked_for_from, tmp_path, monkeypatch
):
    """The README's `tokenizer_id="zephon/data/tokenizer.json"` names the file from the repository's
    root only: run from elsewhere, the refusal said "no such file or directory" and not where it looked."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError) as refused:
        load_tokenizer(name)
    note = f" (a relative path: looked for from the working directory {tmp_path})"
    assert str(refused.value).endswith(note) == looked_for_from


def test_a_hub_id_still_goes_to_the_hub(monkeypatch):
    from tokenizers import Tokenizer

    asked = []
    monkeypatch.setattr(Tokenizer, "from_pretrained", lambda name: asked.append(name) or Tokenizer.from_str("{}"))
    with pytest.raises(ConfigurationError, match="cannot load tokenizer 'someone/model'"):
        load_tokenizer("someone/model")
    assert asked == ["someone/model"]


def test_a_hub_id_the_hub_cannot_provide_says_how_to_fail_at_once_offline(monkeypatch):
    """`tokenize("gpt2")` on a machine without a network failed after ~20 s of the hub library's
    retries, each logged, saying only that the hub could not provide it."""
    from tokenizers import Tokenizer

    def unreachable(name):
        raise OSError("Name or service not known")

    monkeypatch.setattr(Tokenizer, "from_pretrained", unreachable)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(ConfigurationError, match=r"give the tokenizer.json's path \(HF_HUB_OFFLINE=1 makes"):
        load_tokenizer("gpt2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigurationError, match=r"could not provide it \(Name or service not known\)$"):
        load_tokenizer("gpt2")


@pytest.mark.parametrize("directory_there", [False, True], ids=["nothing there", "a directory without tokenizer.json"])
def test_a_hub_shaped_id_neither_local_nor_on_the_hub_names_the_working_directory_it_was_looked_for_from(
    directory_there, tmp_path, monkeypatch
):
    """`tokenizers/gpt2`, a local path mistyped (one slash, no `.json`), is tried as a hub id; its
    refusal said "not a local tokenizer.json or directory" without the working directory that other
    relative paths name, so a script run from another directory did not say where it had looked."""
    from tokenizers import Tokenizer

    def unreachable(name):
        raise OSError("Name or service not known")

    monkeypatch.setattr(Tokenizer, "from_pretrained", unreachable)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    if directory_there:
        (tmp_path / "tokenizers" / "gpt2").mkdir(parents=True)
    with pytest.raises(ConfigurationError) as refused:
        load_tokenizer("tokenizers/gpt2")
    note = f" (a relative path: looked for from the working directory {tmp_path})"
    local = "a directory holding no tokenizer.json" if directory_there else (
        f"not a local tokenizer.json or directory{note}"
    )
    assert str(refused.value) == (
        f"cannot load tokenizer 'tokenizers/gpt2': {local}, and the hub could not provide it "
        "(Name or service not known)"
    )


@pytest.fixture
def undecided_pool(monkeypatch):
    """A process in which no tokenize operator was built yet, with the variable as the test sets it."""
    monkeypatch.setattr(_tokenizer, "_pool_decision", _tokenizer._PoolDecision())
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)


@pytest.mark.parametrize(("parallelism", "before", "after"), [
    (2, None, "false"),
    (1, None, None),
    (4, "true", "true"),
])
def test_tokenizers_pool_is_off_only_when_several_workers_tokenize(monkeypatch, undecided_pool, parallelism, before,
                                                                   after):
    if before is not None:
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", before)
    leave_cores_to_workers(parallelism)
    assert os.environ.get("TOKENIZERS_PARALLELISM") == after


def _kjv_pipeline(demo_data_dir, demo_tokenizer_path, parallelism):
    source = StaticMixtureWorkSource([Dataset.from_path("kjv", str(demo_data_dir / "kjv"))], seed=0,
                                     records_per_chunk=4)
    return (
        Pipeline(source)
        .options(num_lanes=2, runner="thread")
        .tokenize(tokenizer_id=str(demo_tokenizer_path), field="text", parallelism=parallelism)
        .pack_flat(max_length=256)
        .batch(microbatch_size=2)
    )


def test_the_pool_is_off_before_the_first_encode(undecided_pool, monkeypatch, demo_data_dir, demo_tokenizer_path):
    seen = []
    encode_batch = Tokenizer.encode_batch_fast

    def spying_encode_batch(self, *args, **kwargs):
        seen.append(os.environ.get("TOKENIZERS_PARALLELISM"))
        return encode_batch(self, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "encode_batch_fast", spying_encode_batch)
    with _kjv_pipeline(demo_data_dir, demo_tokenizer_path, 2).shard(0, 1) as loader:
        next(iter(loader))
    assert seen and set(seen) == {"false"}


def test_a_loader_built_while_another_may_tokenize_leaves_the_environment_alone(
    undecided_pool, demo_data_dir, demo_tokenizer_path, caplog
):
    """Writing the environment while another thread's tokenizer reads it (getenv) is a data race
    in the C library. A loader tokenizes from its construction on (its token estimate), so later
    loaders must not write the variable, even where their parallelism would turn the pool off;
    they say once how to get that instead."""
    with caplog.at_level(logging.INFO, logger="zephon"), \
            _kjv_pipeline(demo_data_dir, demo_tokenizer_path, 1).shard(0, 1) as first:
        next(iter(first))
        for _ in range(2):
            with _kjv_pipeline(demo_data_dir, demo_tokenizer_path, 2).shard(0, 1) as later:
                next(iter(later))
    assert "TOKENIZERS_PARALLELISM" not in os.environ
    assert sum("cannot change while tokenizers may run" in r.getMessage() for r in caplog.records) == 1


_RSS_GROWTH_OF_LOADING = """
import sys
def rss_mib():
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) // 1024
import tokenizers
from zephon._tokenizer import load_tokenizer
before = rss_mib()
load_tokenizer(sys.argv[1])
print(rss_mib() - before)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads Linux RSS")
def test_loading_a_large_tokenizer_keeps_only_what_it_holds(tmp_path):
    """Parsing Tekken's tokenizer.json grows a glibc process by ~70 MiB (~145 MiB with merges written
    as pairs), part of it freed heap that glibc would keep; load_tokenizer hands that back, leaving
    ~44 MiB."""
    from vlm._assets import tekken_tokenizer

    directory = tekken_tokenizer(cache=tmp_path)
    growth = subprocess.run([sys.executable, "-c", _RSS_GROWTH_OF_LOADING, str(directory)],
                            capture_output=True, text=True, check=True).stdout
    assert int(growth) < 100, f"loading Tekken grew the process by {growth.strip()} MiB"


@pytest.mark.parametrize("keep_field", [False, True])
def test_tokenizing_a_field_into_itself_keeps_the_tokens(demo_tokenizer_path, keep_field):
    """Dropping the source field after tokenizing used to drop the tokens just written there when
    `output_field` named the same field: every record then reached the packer without its tokens."""
    from zephon._record_ops import TokenizeOp
    from zephon._records import Chunk, ChunkRecords, RecordAddress

    op = TokenizeOp(str(demo_tokenizer_path), field="text", output_field="text", keep_field=keep_field)
    chunk = ChunkRecords(Chunk("d", 0, 0, 1), [{"text": "hello world"}], [RecordAddress("d", "s", 0)])
    out = op.build("skip")(chunk)
    assert out.records[0]["text"].dtype == np.int32 and len(out.records[0]["text"]) > 0


@pytest.mark.parametrize("split", [True, False])
def test_special_token_strings_in_a_text_are_text_unless_asked_otherwise(demo_tokenizer_path, split):
    """A web page quoting `<|pad|>` must not put the pad id mid-document, under a label that trains
    on it; both settings tokenize in one process, each with its own tokenizer."""
    from zephon._record_ops import TokenizeOp
    from zephon._records import Chunk, ChunkRecords, RecordAddress

    handle = load_tokenizer(str(demo_tokenizer_path))
    specials = {handle.token_id(t) for t in ("<|bos|>", "<|eos|>", "<|pad|>")}
    op = TokenizeOp(str(demo_tokenizer_path), split_special_tokens=split)
    other = TokenizeOp(str(demo_tokenizer_path), split_special_tokens=not split)
    text = "hello <|eos|> world <|pad|>"
    chunk = ChunkRecords(Chunk("d", 0, 0, 1), [{"text": text}], [RecordAddress("d", "s", 0)])
    other.build("skip")(ChunkRecords(Chunk("d", 0, 0, 1), [{"text": text}], [RecordAddress("d", "s", 0)]))
    ids = set(op.build("skip")(chunk).records[0]["input_ids"].tolist())
    assert (ids & specials == set()) is split
    assert op.fingerprint() != other.fingerprint()


def test_a_lookup_shares_the_instance_the_tokenize_stage_encodes_with(demo_tokenizer_path):
    """Ids looked up for a packer or a pad come from the tokenize stage's own instance, whether the
    setting is named or left to its default, and only the other setting parses the file again."""
    from zephon._record_ops import TokenizeOp

    path = str(demo_tokenizer_path)
    stage = TokenizeOp(path).handle()
    assert load_tokenizer(path) is stage
    assert load_tokenizer(path, split_special_tokens=True) is stage
    assert load_tokenizer(path, split_special_tokens=False) is not stage


def _renamed_eos(demo_tokenizer_path) -> str:
    """The demo tokenizer with its EOS token spelt `<|end|>`: another tokenizer, another digest."""
    return demo_tokenizer_path.read_text().replace('"<|eos|>"', '"<|end|>"')


def test_a_tokenizer_file_changed_since_it_was_loaded_is_loaded_again(tmp_path, demo_tokenizer_path, monkeypatch):
    """The cache was keyed by the name alone: a tokenizer.json rewritten in place (a sweep that
    trains a tokenizer per ablation into one path) or a relative path read from another working
    directory gave the first file's tokenizer and digest, so a new pipeline encoded with a stale
    tokenizer and resumed checkpoints of it."""
    path = tmp_path / "tokenizer.json"
    shutil.copy(demo_tokenizer_path, path)
    before = load_tokenizer(str(path))
    path.write_text(_renamed_eos(demo_tokenizer_path))
    os.utime(path, ns=(1, 1))  # the rewrite may fall in the same clock tick as the copy
    after = load_tokenizer(str(path))
    assert after.digest != before.digest and after.tokenizer.token_to_id("<|end|>") is not None
    assert load_tokenizer(str(path)) is after  # an unchanged file is still parsed once

    (tmp_path / "other").mkdir()
    shutil.copy(demo_tokenizer_path, tmp_path / "other" / "tokenizer.json")
    monkeypatch.chdir(tmp_path)
    here = load_tokenizer("tokenizer.json")
    monkeypatch.chdir(tmp_path / "other")
    assert load_tokenizer("tokenizer.json").digest != here.digest


def test_a_tokenizer_file_rewritten_while_it_loads_gives_the_digest_of_the_tokenizer_parsed(
    tmp_path, demo_tokenizer_path, monkeypatch
):
    """The file was read twice, to parse and to digest: a rewrite in between (a sweep writing the
    next ablation's tokenizer) paired the old tokenizer with the new file's digest in the recipe."""
    import tokenizers

    from zephon._sha256 import sha256

    path = tmp_path / "tokenizer.json"
    shutil.copy(demo_tokenizer_path, path)
    original = path.read_bytes()

    class RewrittenAfterParsing:
        """`Tokenizer`, with the file rewritten as soon as any tokenizer has been parsed."""

        def __getattr__(self, name):
            parse = getattr(Tokenizer, name)

            def parse_then_rewrite(*args, **kwargs):
                tokenizer = parse(*args, **kwargs)
                path.write_text(_renamed_eos(demo_tokenizer_path))
                return tokenizer

            return parse_then_rewrite

    monkeypatch.setattr(tokenizers, "Tokenizer", RewrittenAfterParsing())
    handle = load_tokenizer(str(path))
    assert handle.tokenizer.token_to_id("<|eos|>") is not None
    assert handle.digest == sha256(original).hexdigest()


def test_a_tokenize_operator_names_the_tokenizer_it_encodes_with_after_the_file_changed(tmp_path,
                                                                                         demo_tokenizer_path):
    """A loader builds its stages, then measures tokens (seconds), then takes the fingerprint: the
    file changing in between must not make the recipe name another tokenizer than the encoding one."""
    from zephon._record_ops import TokenizeOp

    path = tmp_path / "tokenizer.json"
    shutil.copy(demo_tokenizer_path, path)
    op = TokenizeOp(str(path))
    op.build("skip")
    digest = load_tokenizer(str(path)).digest
    path.write_text(_renamed_eos(demo_tokenizer_path))
    os.utime(path, ns=(1, 1))
    assert op.fingerprint()["tokenizer"] == digest
    assert TokenizeOp(str(path)).fingerprint()["tokenizer"] != digest  # a new operator reads the new file


def test_a_tokenizer_json_that_truncates_or_pads_tokenizes_whole_documents_without_padding(tmp_path, demo_tokenizer_path):
    """A tokenizer.json saved with truncation and padding on (as many hub files are, for a model's
    inputs) cut every document to its `max_length` and padded the shorter documents of an encode
    batch with pad ids as if they were text, silently: documents are packed by the packer, whole."""
    from zephon._record_ops import TokenizeOp
    from zephon._records import Chunk, ChunkRecords, RecordAddress

    tokenizer = Tokenizer.from_file(str(demo_tokenizer_path))
    tokenizer.enable_truncation(8)
    tokenizer.enable_padding(pad_id=2, pad_token="<|pad|>")
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    texts = ["hello world " * 20, "hi"]

    def ids(path) -> list[list[int]]:
        chunk = ChunkRecords(Chunk("d", 0, 0, 2), [{"text": t} for t in texts], [RecordAddress("d", "s", i) for i in range(2)])
        return [r["input_ids"].tolist() for r in TokenizeOp(str(path)).build("skip")(chunk).records]

    plain = ids(demo_tokenizer_path)
    assert len(plain[0]) > 8
    assert ids(tmp_path / "tokenizer.json") == plain


def test_a_tokenizers_own_truncation_turned_off_is_said_at_info_by_the_jobs_rank_0_alone(
    tmp_path, demo_tokenizer_path, monkeypatch, caplog
):
    """Every rank loads the same tokenizer.json: each of a thousand said it turned the file's
    truncation off. torchrun's RANK tells the ranks apart before any process group exists."""
    tokenizer = Tokenizer.from_file(str(demo_tokenizer_path))
    tokenizer.enable_truncation(8)
    said = {}
    for rank in ("3", "0"):
        monkeypatch.setenv("RANK", rank)
        path = tmp_path / rank / "tokenizer.json"
        path.parent.mkdir()
        tokenizer.save(str(path))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="zephon"):
            load_tokenizer(str(path))
        said[rank] = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert said["3"] == []
    assert len(said["0"]) == 1 and "truncation and padding are turned off" in said["0"][0]


def test_turning_tokenizers_own_pool_off_is_said_at_info_by_the_jobs_rank_0_alone(undecided_pool, monkeypatch, caplog):
    said = {}
    for rank in ("3", "0"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setattr(_tokenizer, "_pool_decision", _tokenizer._PoolDecision())
        monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="zephon"):
            leave_cores_to_workers(2)
        assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
        said[rank] = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert said["3"] == []
    assert said["0"] == ["tokenize runs on 2 workers: TOKENIZERS_PARALLELISM=false (set it yourself to choose)"]


@pytest.mark.parametrize("split", [True, False])
def test_a_pickled_tokenize_operator_encodes_special_token_strings_as_the_original_does(demo_tokenizer_path, split):
    """`tokenizers` leaves the split-special-tokens switch out of a Tokenizer's pickle: a pipeline
    sent to another process (a rank given rank 0's pipeline) encoded `<|eos|>` in a text as the EOS
    id there and as text here, under the same fingerprint."""
    import pickle

    from zephon._record_ops import TokenizeOp
    from zephon._records import Chunk, ChunkRecords, RecordAddress

    def ids(op) -> list[int]:
        chunk = ChunkRecords(Chunk("d", 0, 0, 1), [{"text": "hello <|eos|> world"}], [RecordAddress("d", "s", 0)])
        return op.build("skip")(chunk).records[0]["input_ids"].tolist()

    op = TokenizeOp(str(demo_tokenizer_path), split_special_tokens=split)
    op.handle()  # loaded and kept, as `Pipeline.tokenize` does before anything can pickle it
    copy = pickle.loads(pickle.dumps(op))
    assert copy.fingerprint() == op.fingerprint()
    assert ids(copy) == ids(op)


def test_the_pool_stays_on_when_an_inline_runner_tokenizes_whatever_the_parallelism(
        undecided_pool, demo_data_dir, demo_tokenizer_path):
    """The inline runner runs every stage on the caller's one thread whatever an operator's
    parallelism, so no Zephon workers compete with tokenizers' own pool: it stays on, as the README
    says ("when more than one worker tokenizes"). It was turned off whenever parallelism > 1."""
    source = StaticMixtureWorkSource([Dataset.from_path("kjv", str(demo_data_dir / "kjv"))], seed=0,
                                     records_per_chunk=4)
    pipeline = (
        Pipeline(source)
        .options(num_lanes=2, runner="inline")
        .tokenize(tokenizer_id=str(demo_tokenizer_path), field="text", parallelism=4)
        .pack_flat(max_length=256)
        .batch(microbatch_size=2)
    )
    with pipeline.shard(0, 1) as loader:
        next(iter(loader))
    assert "TOKENIZERS_PARALLELISM" not in os.environ


_PEAK_RSS_GROWTH_OF_TOKENIZING_A_CHUNK = """
import glob, hashlib, json, sys
import zstandard
from zephon._record_ops import TokenizeOp
from zephon._records import Chunk, ChunkRecords, RecordAddress

def peak_rss_mib():
    with open("/proc/self/status") as f:
        return int(f.read().split("VmHWM:")[1].split()[0]) / 1024

data_dir, tokenizer = sys.argv[1], sys.argv[2]
lines = []
for shard in sorted(glob.glob(data_dir + "/kjv/*.jsonl.zst")):
    with open(shard, "rb") as f:
        lines += zstandard.ZstdDecompressor().stream_reader(f).read().decode().splitlines()
book = " ".join(json.loads(line)["text"] for line in lines if line.strip())[:400_000]
texts = [book[k:] + book[:k] for k in range(0, 16_000, 1_000)]  # 16 documents of 400k characters
tokenize = TokenizeOp(tokenizer).build("skip")
records = [{"text": text} for text in texts]
addresses = [RecordAddress("d", "s", i) for i in range(len(texts))]
tokenize(ChunkRecords(Chunk("d", 0, 0, 1), [{"text": "warm up"}], addresses[:1]))
before = peak_rss_mib()
out = tokenize(ChunkRecords(Chunk("d", 0, 0, len(texts)), records, addresses))
digest = hashlib.sha256(b"".join(record["input_ids"].tobytes() for record in out.records)).hexdigest()
print(json.dumps({"growth_mib": peak_rss_mib() - before, "sha256": digest}))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads Linux peak RSS")
def test_with_tokenizers_pool_off_a_chunk_of_long_documents_is_encoded_one_at_a_time(demo_data_dir, demo_tokenizer_path):
    """One call encoded a whole chunk, and its encodings (each token's id, string, offsets and
    masks) were all alive until the last: sixteen documents of 400k characters grew a worker's peak
    RSS by 167 MiB, one at a time by 85 MiB, in the same time. Where tokenizers' own pool is on
    (a single worker) the chunk stays one batch, which the pool spreads over the cores; the ids
    are the same either way."""
    def run(pool: str) -> dict:
        env = {**os.environ, "TOKENIZERS_PARALLELISM": pool}
        return json.loads(subprocess.run(
            [sys.executable, "-c", _PEAK_RSS_GROWTH_OF_TOKENIZING_A_CHUNK, str(demo_data_dir), str(demo_tokenizer_path)],
            env=env, capture_output=True, text=True, check=True).stdout)

    off, on = run("false"), run("true")
    assert off["sha256"] == on["sha256"]
    assert off["growth_mib"] < 0.6 * on["growth_mib"], (off, on)


@pytest.mark.parametrize("value, off", [(None, False), ("true", False), ("1", False), ("nope", False),
                                        ("false", True), ("FALSE", True), ("0", True), ("off", True),
                                        ("No", True), ("n", True), ("f", True), ("", True)])
def test_tokenizers_pool_is_read_as_off_for_the_values_tokenizers_reads_so(monkeypatch, value, off):
    """tokenizers 0.23 keeps one thread busy for these values and spreads a batch over the cores
    for any other (checked by its CPU time against wall time)."""
    if value is None:
        monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    else:
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", value)
    assert _tokenizer.tokenizers_pool_is_off() is off


def test_a_chunk_encoded_in_several_calls_gives_the_ids_offsets_and_skips_of_one_call(monkeypatch, demo_tokenizer_path):
    """With tokenizers' pool off a chunk is encoded in runs of at most `_CHARACTERS_PER_CALL`
    characters: texts longer than that alone, a lone surrogate (which fails its whole call) still
    skipped alone, and every record's ids and marker offsets those of the chunk encoded at once."""
    from zephon import _record_ops
    from zephon._record_ops import TokenizeOp
    from zephon._records import Chunk, ChunkRecords, RecordAddress

    limit = _record_ops._CHARACTERS_PER_CALL
    long_text = ("In the beginning <image> was the word. " * (limit // 20))[: limit + 7]
    texts = ["short one <image>", long_text, "bad \ud800 text", "", "another <image> short", long_text[::-1],
             "tail"]

    def tokenize(pool: str) -> tuple[list, list, dict]:
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", pool)
        op = TokenizeOp(str(demo_tokenizer_path), eos="<|eos|>", marker="<image>")
        calls = []
        chunk = ChunkRecords(Chunk("d", 0, 0, len(texts)), [{"text": text} for text in texts],
                             [RecordAddress("d", "s", i) for i in range(len(texts))])
        encode_batch = _record_ops._encode

        def counted(*args, **kwargs):
            calls.append(args[2])
            return encode_batch(*args, **kwargs)

        monkeypatch.setattr(_record_ops, "_encode", counted)
        out = op.build("skip")(chunk)
        skipped = {address.index: reason for address, reason in out.skipped}
        return [(r["input_ids"].tolist(), list(r["image_offsets"])) for r in out.records], calls, skipped

    at_once, at_once_calls, at_once_skips = tokenize("true")
    in_runs, in_runs_calls, in_runs_skips = tokenize("false")
    assert at_once_calls[0] is None and in_runs_calls[0] == limit
    assert in_runs == at_once and len(in_runs) == 5
    assert in_runs_skips == at_once_skips == {2: "invalid_utf8", 3: "empty_document"}


@pytest.mark.parametrize("lengths, characters, expected", [
    ([], 10, []),
    ([3, 3, 3], None, [[3, 3, 3]]),
    ([3, 3, 3], 9, [[3, 3, 3]]),
    ([3, 3, 3], 8, [[3, 3], [3]]),
    ([12, 3, 3, 12], 8, [[12], [3, 3], [12]]),
    ([2, 12, 2], 8, [[2], [12], [2]]),
])
def test_texts_are_cut_into_consecutive_runs_of_at_most_the_characters_a_longer_text_alone(lengths, characters,
                                                                                           expected):
    from zephon._record_ops import _runs

    texts = ["x" * n for n in lengths]
    assert [[len(text) for text in run] for run in _runs(texts, characters)] == expected
