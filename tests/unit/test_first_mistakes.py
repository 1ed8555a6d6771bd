"""The mistakes a newcomer makes first are refused with a named error that says what to do.

Each case is the README's pipeline with one thing wrong, as someone who has not read the rest of
the documentation would get it wrong: a layout that cannot split, a mixture keyed by the wrong
names, a misnamed text field, a loader used after `close()`.
"""

from __future__ import annotations

import io
import json
import logging
import re
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.reliability.harness import TOKENIZER
from tests.unit.test_vlm_assets import encode, gradient
from zephon import BadRecordError, ConfigurationError, Pipeline
from zephon._field_names import fields_it_has
from zephon.integrations.torchtitan import ZephonDataLoader
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource, TokenEstimation


@pytest.fixture
def datasets(demo_data_dir):
    return [Dataset.from_path("bible", str(demo_data_dir / "kjv")),
            Dataset.from_path("jargon", str(demo_data_dir / "jargon"))]


def readme_pipeline(source, tokenizer, field="text"):
    return (
        Pipeline(source).options(num_lanes=8, runner="inline")
        .tokenize(tokenizer_id=str(tokenizer), field=field, eos="<|eos|>")
        .pack_flat(max_length=256)
        .batch(microbatch_size=2)
    )


@pytest.mark.parametrize(
    "global_batch_size,advice",
    [
        (12, "a global_batch_size of 16 would split evenly (a multiple of num_lanes × microbatch_size = 8 × 2)"),
        (100, "a global_batch_size of 96 or 112 would split evenly"),
        (24, "a microbatch_size in [1, 3] would split it, or a global_batch_size of 16 or 32 would split evenly"),
    ],
    ids=["fewer rows than lanes", "not a multiple of the lanes", "lane rows not a multiple of the microbatch"],
)
def test_a_global_batch_that_cannot_split_names_the_sizes_that_would(
    datasets, demo_tokenizer_path, global_batch_size, advice
):
    pipeline = readme_pipeline(StaticMixtureWorkSource(datasets), demo_tokenizer_path)
    with pytest.raises(ConfigurationError) as refused:
        pipeline.shard(0, 1, global_batch_size=global_batch_size)
    assert advice in str(refused.value)


@pytest.mark.parametrize(
    "mixture,named",
    [
        ({"bibel": 0.7, "jargon": 0.3}, "['bibel'] name no dataset; ['bible'] have no weight"),
        ({"bible": 1.0}, ": ['jargon'] have no weight"),
    ],
    ids=["misspelt", "one left out"],
)
def test_a_mixture_keyed_by_other_names_says_which_and_how_to_key_it(datasets, mixture, named):
    with pytest.raises(ConfigurationError) as refused:
        StaticMixtureWorkSource(datasets, mixture=mixture)
    assert named in str(refused.value)
    assert "key the mixture by the names given to Dataset.from_path" in str(refused.value)


def test_a_misnamed_text_field_is_refused_at_planning_naming_why_the_sample_had_no_token(
    datasets, demo_tokenizer_path
):
    """The sample's records all lack the field, so token estimation has no rate to plan by: the
    refusal said to check the field names without saying that every record lacked one."""
    source = StaticMixtureWorkSource(datasets, mixture={"bible": 0.7, "jargon": 0.3},
                                     token_estimation=TokenEstimation(sample_records=64))
    pipeline = readme_pipeline(source, demo_tokenizer_path, field="txt")
    with pytest.raises(ConfigurationError, match=r"dataset 'bible': .* yielded no token \(records dropped: "
                                                 r"missing_field 64; first missing_field at bible:\S+: field 'txt'; "
                                                 r"fields it has: 'book', 'chapter', 'id', 'text'; "
                                                 r"did you mean 'text'\?\).*check its field names"):
        pipeline.shard(0, 1, global_batch_size=16)


# -- a misnamed field names the fields the records have -------------------------------------------
def _jsonl(root):
    root.mkdir()
    lines = [json.dumps({"id": i, "content": f"record number {i}", "url": f"u{i}"}) for i in range(16)]
    (root / "part-0.jsonl").write_text("".join(line + "\n" for line in lines))


def _parquet(root):
    root.mkdir()
    rows = [{"id": i, "content": f"record number {i}", "url": f"u{i}"} for i in range(16)]
    pq.write_table(pa.Table.from_pylist(rows), root / "part-0.parquet")


def _webdataset(root):
    """The member extensions are the fields: a sample's text is under `.content`, beside `.id`."""
    root.mkdir()
    with tarfile.open(root / "part-0.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(16):
            for extension, payload in (("content", f"record number {i}"), ("id", str(i))):
                data = payload.encode()
                info = tarfile.TarInfo(f"k{i:03d}.{extension}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


MISNAMED_LAYOUTS = {
    "jsonl": (_jsonl, "'content', 'id', 'url'"),
    "parquet": (_parquet, "'content', 'id', 'url'"),
    "webdataset": (_webdataset, "'__key__', 'content', 'id'"),
}


def misnamed_pipeline(tmp_path, tokenizer, layout, **options):
    write, _ = MISNAMED_LAYOUTS[layout]
    write(tmp_path / layout)
    estimation = options.pop("token_estimation", None)
    source = StaticMixtureWorkSource([Dataset.from_path("d", str(tmp_path / layout))],
                                     token_estimation=estimation, num_epochs=1, records_per_chunk=4)
    return (
        Pipeline(source).options(num_lanes=2, runner="inline", **options)
        .tokenize(tokenizer_id=str(tokenizer), field="contents", eos="<|eos|>")
        .pack_flat(max_length=64)
        .batch(microbatch_size=1)
    )


@pytest.mark.parametrize("layout", sorted(MISNAMED_LAYOUTS))
def test_a_misnamed_field_refused_at_planning_names_the_fields_a_dropped_record_has(
    tmp_path, demo_tokenizer_path, layout
):
    """The refusal said every record was dropped as missing_field, not what the field is called:
    finding "content" meant opening a shard. JSON keys, Parquet columns and WebDataset member
    extensions are the fields named."""
    pipeline = misnamed_pipeline(tmp_path, demo_tokenizer_path, layout, token_estimation=TokenEstimation())
    with pytest.raises(ConfigurationError) as refused:
        pipeline.shard(0, 1, global_batch_size=2)
    fields = MISNAMED_LAYOUTS[layout][1]
    assert re.search(r"\(records dropped: missing_field 16; first missing_field at d:\S+#0: field 'contents'; "
                     rf"fields it has: {fields}; did you mean 'content'\?\)", str(refused.value))


@pytest.mark.parametrize("layout", sorted(MISNAMED_LAYOUTS))
def test_a_misnamed_field_under_on_error_raise_names_the_fields_the_record_has(
    tmp_path, demo_tokenizer_path, layout
):
    """BadRecordError named the missing field alone."""
    pipeline = misnamed_pipeline(tmp_path, demo_tokenizer_path, layout, on_error="raise")
    with pytest.raises(BadRecordError) as refused, pipeline.shard(0, 1, global_batch_size=2) as loader:
        next(iter(loader))
    fields = MISNAMED_LAYOUTS[layout][1]
    assert refused.value.reason == "missing_field"
    assert refused.value.detail == f"field 'contents'; fields it has: {fields}; did you mean 'content'?"


def test_a_misnamed_pack_flat_field_refused_at_planning_names_the_fields_the_records_have(tmp_path):
    """Token ids stored in the data under "token_ids", packed from "tokens": the sample counted no
    token and no drop (the packer's count of a record without ids is 0), and said neither."""
    (tmp_path / "d").mkdir()
    lines = [json.dumps({"id": i, "token_ids": [5, 6, 7]}) for i in range(16)]
    (tmp_path / "d" / "part-0.jsonl").write_text("".join(line + "\n" for line in lines))
    source = StaticMixtureWorkSource([Dataset.from_path("d", str(tmp_path / "d"))], num_epochs=1,
                                     records_per_chunk=4, token_estimation=TokenEstimation())
    pipeline = (Pipeline(source).options(num_lanes=2, runner="inline")
                .pack_flat(max_length=8, field="tokens").batch(microbatch_size=1))
    with pytest.raises(ConfigurationError) as refused:
        pipeline.shard(0, 1, global_batch_size=2)
    assert re.search(r"yielded no token \(records dropped: missing_field 16; first missing_field at d:\S+#0: "
                     r"it lacks 'tokens': fields it has: 'id', 'token_ids'; did you mean 'token_ids'\?\)",
                     str(refused.value))


def test_token_ids_stored_as_text_refused_at_planning_name_the_pack_flat_refusal(tmp_path):
    """Token ids stored in the data as a string ("5 6 7"), packed by pack_flat: the packer refuses
    every sampled record as `not_tokens`, and the planning refusal said only that the sample
    yielded no token, since pack_flat's counter kept no reasons (pack_multimodal's names its own)."""
    (tmp_path / "d").mkdir()
    lines = [json.dumps({"id": i, "tokens": "5 6 7"}) for i in range(16)]
    (tmp_path / "d" / "part-0.jsonl").write_text("".join(line + "\n" for line in lines))
    source = StaticMixtureWorkSource([Dataset.from_path("d", str(tmp_path / "d"))], num_epochs=1,
                                     records_per_chunk=4, token_estimation=TokenEstimation())
    pipeline = (Pipeline(source).options(num_lanes=2, runner="inline")
                .pack_flat(max_length=8, field="tokens").batch(microbatch_size=1))
    with pytest.raises(ConfigurationError, match=r"yielded no token \(records dropped: not_tokens 16; first not_tokens "
                                                 r"at d:\S+#0: 'tokens' holds a string of 5 characters"):
        pipeline.shard(0, 1, global_batch_size=2)


def _misnamed_images(root, on_error):
    """Pairs whose images are stored as `.image`, while decode_images is told "img"."""
    _png_pairs(root, image_extension="image")
    from vlm import PixtralPlaceholders

    source = StaticMixtureWorkSource([Dataset.from_path("pairs", str(root))], num_epochs=1, records_per_chunk=4,
                                     token_estimation=TokenEstimation() if on_error == "skip" else None)
    return (
        Pipeline(source).options(num_lanes=2, runner="inline", on_error=on_error)
        .decode_images(field="img")
        .tokenize(str(TOKENIZER), field="txt", eos="<|eos|>")
        .pack_multimodal(256, PixtralPlaceholders(3, 4, 5))
        .batch(microbatch_size=1)
    )


def test_a_misnamed_image_field_names_the_fields_the_records_have(tmp_path):
    """decode_images(field="img") on pairs stored as `.image`: planning refuses and
    on_error="raise" fails naming the extensions the samples have, not the candidates alone."""
    with pytest.raises(ConfigurationError) as refused:
        _misnamed_images(tmp_path / "planned", "skip").shard(0, 1, global_batch_size=2)
    assert re.search(r"\(records dropped: missing_image 8; first missing_image at pairs:\S+#0: none of the fields "
                     r"\['img'\] is present; fields it has: '__key__', 'image', 'txt'; did you mean 'image'\?\)",
                     str(refused.value))
    pipeline = _misnamed_images(tmp_path / "raised", "raise")
    with pytest.raises(BadRecordError) as raised, pipeline.shard(0, 1, global_batch_size=2) as loader:
        next(iter(loader))
    assert raised.value.reason == "missing_image"
    assert raised.value.detail == ("none of the fields ['img'] is present; "
                                   "fields it has: '__key__', 'image', 'txt'; did you mean 'image'?")


def test_a_packer_counter_draining_bare_reasons_has_them_counted_not_read_as_records(tmp_path):
    """A plugin packer's token counter written before details drains its refusals as bare reasons:
    unpacked as (address, reason, detail), "not_tokens" was read letter by letter, and the refusal
    counted reason "o" at address "n"."""
    from zephon._packing import PackFlatOp

    class BareReasons(PackFlatOp):
        def token_counter(self):
            count = super().token_counter()
            drain = count.drain_skips
            count.drain_skips = lambda: [reason for _, reason, _ in drain()]
            return count

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "part-0.jsonl").write_text("".join(json.dumps({"tokens": "5 6 7"}) + "\n" for _ in range(16)))
    source = StaticMixtureWorkSource([Dataset.from_path("d", str(tmp_path / "d"))], num_epochs=1,
                                     records_per_chunk=4, token_estimation=TokenEstimation())
    pipeline = (Pipeline(source).options(num_lanes=2, runner="inline")
                .apply(BareReasons(max_length=8, field="tokens")).batch(microbatch_size=1))
    with pytest.raises(ConfigurationError, match=r"yielded no token \(records dropped: not_tokens 16\), so"):
        pipeline.shard(0, 1, global_batch_size=2)


def _png_pairs(root, image_extension: str = "png"):
    """A WebDataset shard of 8 captioned PNGs (`txt`, and the image under `image_extension`) in
    `root`, returned."""
    root.mkdir()
    with tarfile.open(root / "part-0.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(8):
            for extension, data in (("txt", f"picture {i}".encode()), (image_extension, encode(gradient(), "PNG"))):
                info = tarfile.TarInfo(f"k{i:03d}.{extension}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return root


def test_a_pack_length_no_image_fits_is_refused_at_planning_naming_the_packers_reason(tmp_path):
    """pack_multimodal(max_length) below one image's placeholder tokens: the packer drops every
    sampled record as `images_exceed_length`, and the planning refusal said only that the sample
    yielded no token, since the counter threw the packer's reasons away (the reasons of the stages
    before it were named)."""
    from vlm import PixtralPlaceholders

    source = StaticMixtureWorkSource([Dataset.from_path("pairs", str(_png_pairs(tmp_path / "pairs")))], num_epochs=1,
                                     records_per_chunk=4, token_estimation=TokenEstimation())
    pipeline = (Pipeline(source).options(num_lanes=2, runner="inline")
                .decode_images()
                .tokenize(str(TOKENIZER), field="txt", eos="<|eos|>")
                .pack_multimodal(4, PixtralPlaceholders(3, 4, 5)).batch(microbatch_size=1))
    with pytest.raises(ConfigurationError, match=r"yielded no token \(records dropped: images_exceed_length 8; first "
                                                 r"images_exceed_length at pairs:\S+#0: its 1 image\(s\) take \d+ tokens"):
        pipeline.shard(0, 1, global_batch_size=2)


def test_a_video_field_holding_an_empty_list_is_not_said_to_be_absent_or_null_at_planning(tmp_path):
    """`decode_video` drops a record whose video field holds an empty list as `missing_video`, the
    reason of an absent field: the planning refusal said the record lacked the field and that it
    was null, when it holds a list with no video (named as such by `on_error="raise"`)."""
    from vlm import PixtralPlaceholders, VideoSpec

    (tmp_path / "clips").mkdir()
    lines = [json.dumps({"txt": f"clip {i}", "mp4": []}) for i in range(8)]
    (tmp_path / "clips" / "part-0.jsonl").write_text("".join(line + "\n" for line in lines))
    source = StaticMixtureWorkSource([Dataset.from_path("clips", str(tmp_path / "clips"))], num_epochs=1,
                                     records_per_chunk=4, token_estimation=TokenEstimation())
    pipeline = (Pipeline(source).options(num_lanes=2, runner="inline")
                .decode_video(spec=VideoSpec(num_frames=2))
                .tokenize(str(TOKENIZER), field="txt", eos="<|eos|>")
                .pack_multimodal(256, PixtralPlaceholders(3, 4, 5)).batch(microbatch_size=1))
    with pytest.raises(ConfigurationError, match=r"records dropped: missing_video 8") as refused:
        pipeline.shard(0, 1, global_batch_size=2)
    assert "null" not in str(refused.value) and "lacks" not in str(refused.value), str(refused.value)
    assert re.search(r"first missing_video at clips:\S+#0: field 'mp4' holds an empty list\)", str(refused.value))


def _bad_pairs(root):
    """Captions whose image is garbage bytes (odd keys) or absent (even keys): every record dropped,
    for two reasons."""
    root.mkdir()
    with tarfile.open(root / "part-0.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(8):
            members = [("txt", f"picture {i}".encode())] + ([("jpg", b"\xff\xd8 not really")] if i % 2 else [])
            for extension, data in members:
                info = tarfile.TarInfo(f"k{i:03d}.{extension}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return root


def test_a_sample_without_a_token_is_refused_naming_each_reasons_first_record_as_skipped_examples_does(tmp_path):
    """Every sampled record dropped as corrupt_image or missing_image: the refusal gave the counts
    alone ("records dropped: missing_image 4, corrupt_image 4") and said to check the field names,
    a record's detail shown only for a missing field. It names, for each reason, the sample's first
    record so dropped and what was wrong with it, in the words loader.stats()["skipped_examples"]
    gives (here the decoder's error)."""
    from vlm import PixtralPlaceholders

    def pipeline(estimation):
        source = StaticMixtureWorkSource([Dataset.from_path("pairs", str(tmp_path / "pairs"))], num_epochs=1,
                                         records_per_chunk=4, token_estimation=estimation)
        return (Pipeline(source).options(num_lanes=2, runner="inline").decode_images()
                .tokenize(str(TOKENIZER), field="txt", eos="<|eos|>")
                .pack_multimodal(256, PixtralPlaceholders(3, 4, 5)).batch(microbatch_size=1))

    _bad_pairs(tmp_path / "pairs")
    with pytest.raises(ConfigurationError) as refused:
        pipeline(TokenEstimation()).shard(0, 1, global_batch_size=2)
    named = dict(re.findall(r"first (\w+) at (pairs:\S+#\d+):", str(refused.value)))  # reason: address
    assert "records dropped: missing_image 4, corrupt_image 4;" in str(refused.value), str(refused.value)
    assert set(named) == {"missing_image", "corrupt_image"}, str(refused.value)
    assert named["missing_image"].endswith("#0") and named["corrupt_image"].endswith("#1")
    with pipeline(None).shard(0, 1, global_batch_size=2) as loader:  # read as training reads it
        with pytest.raises(ConfigurationError, match="handed over no row"):
            next(iter(loader))
        examples = loader.stats()["skipped_examples"]["pairs"]
    for reason, address in named.items():
        detail = next(e["detail"] for e in examples[reason] if e["address"] == address)
        assert f"first {reason} at {address}: {detail}" in str(refused.value)
    assert f"at {named['corrupt_image']}: no image format recognises these bytes" in str(refused.value)


def test_an_image_field_holding_paths_is_refused_at_planning_showing_the_path(tmp_path):
    """LLaVA-style records naming their image by file: every sampled record dropped as
    not_media_bytes, the refusal said so by count; it shows the first record's path and that
    decode_images opens it only with paths=True."""
    (tmp_path / "llava").mkdir()
    lines = [json.dumps({"txt": f"picture {i}", "jpg": f"images/{i:03d}.jpg"}) for i in range(8)]
    (tmp_path / "llava" / "part-0.jsonl").write_text("".join(line + "\n" for line in lines))
    source = StaticMixtureWorkSource([Dataset.from_path("llava", str(tmp_path / "llava"))], num_epochs=1,
                                     records_per_chunk=4, token_estimation=TokenEstimation())
    from vlm import PixtralPlaceholders

    pipeline = (Pipeline(source).options(num_lanes=2, runner="inline").decode_images()
                .tokenize(str(TOKENIZER), field="txt", eos="<|eos|>")
                .pack_multimodal(256, PixtralPlaceholders(3, 4, 5)).batch(microbatch_size=1))
    with pytest.raises(ConfigurationError) as refused:
        pipeline.shard(0, 1, global_batch_size=2)
    assert re.search(r"records dropped: not_media_bytes 8; first not_media_bytes at llava:\S+#0: expected encoded "
                     r"bytes, got the str 'images/000.jpg'; decode_images reads encoded bytes unless given paths=True",
                     str(refused.value))


def test_a_wide_record_names_its_first_fields_and_counts_the_rest():
    """A table of 30 columns is named by its first 12 (sorted) and a count, so the message stays a line."""
    columns = [f"col{i:02d}" for i in range(30)] + ["texts"]
    assert fields_it_has("text", columns) == (
        "fields it has: " + ", ".join(repr(c) for c in columns[:12]) + " … and 19 more; did you mean 'texts'?"
    )
    assert fields_it_has(("jpg", "png"), ["txt"]) == "fields it has: 'txt'"


def test_a_null_field_is_said_to_be_null_not_guessed_another_name():
    """A JSON `null` is skipped as missing_field too; "did you mean 'text'?" for a record holding
    "text" would send the user looking for a name that is right."""
    assert fields_it_has("text", ["id", "text"]) == "'text' is null"


def test_a_closed_loader_says_how_to_go_on_and_the_state_it_still_gives_resumes_there(
    datasets, demo_tokenizer_path
):
    source = StaticMixtureWorkSource(datasets, mixture={"bible": 0.7, "jargon": 0.3}, records_per_chunk=8)
    pipeline = readme_pipeline(source, demo_tokenizer_path)
    with pipeline.shard(0, 1, global_batch_size=16) as uninterrupted:
        expected = [batch.digest() for _, batch in zip(range(4), uninterrupted)]
    loader = pipeline.shard(0, 1, global_batch_size=16)
    batches = iter(loader)
    taken = [next(batches).digest() for _ in range(3)]
    loader.close()
    for use in (lambda: next(batches), lambda: next(iter(loader))):
        with pytest.raises(ConfigurationError) as refused:
            use()
        assert "make a new loader with pipeline.shard(...)" in str(refused.value)
        assert "load_state_dict(state) of a state_dict() this loader gave" in str(refused.value)
    with pipeline.shard(0, 1, global_batch_size=16) as again:
        again.load_state_dict(loader.state_dict())
        resumed = next(iter(again)).digest()
    assert taken + [resumed] == expected


def test_a_closed_torchtitan_loader_says_to_build_a_new_one_and_load_its_state_not_to_shard_the_pipeline(
    datasets, demo_tokenizer_path
):
    """The adapter passed on the rank loader's refusal, "make a new loader with pipeline.shard(...)",
    which is no loader a TorchTitan trainer can use."""
    source = StaticMixtureWorkSource(datasets, mixture={"bible": 0.7, "jargon": 0.3}, records_per_chunk=8)
    pipeline = readme_pipeline(source, demo_tokenizer_path)
    loader = ZephonDataLoader(pipeline, 0, 1, global_batch_size=16)
    loader.close()
    with pytest.raises(ConfigurationError) as refused:
        next(iter(loader))
    assert str(refused.value) == (
        "this ZephonDataLoader is closed; build a new ZephonDataLoader and, to go on where this one stopped, "
        "give it load_state_dict(state) of a state_dict() this one gave (it still gives one once closed)"
    )
    with ZephonDataLoader(pipeline, 0, 1, global_batch_size=16) as again:
        again.load_state_dict(loader.state_dict())


# -- a finite run whose every record is dropped ---------------------------------------------------
JARGON_RECORDS = 2307
NOTHING_TRAINED = (
    rf"the finite plan's 2 lanes read {JARGON_RECORDS} records and handed over no row "
    rf"\(dropped: missing_field: {JARGON_RECORDS}\): every record was dropped.*Check the field names"
)


def jargon_pipeline(demo_data_dir, tokenizer, field="text", runner="inline", filter_fn=None):
    """The jargon corpus alone, one epoch, no token estimation (which would refuse a misnamed field
    at planning), on 2 lanes."""
    source = StaticMixtureWorkSource([Dataset.from_path("jargon", str(demo_data_dir / "jargon"))], num_epochs=1, seed=1)
    pipeline = Pipeline(source).options(num_lanes=2, runner=runner)
    if filter_fn is not None:
        pipeline = pipeline.filter(filter_fn)
    return (
        pipeline.tokenize(tokenizer_id=str(tokenizer), field=field, eos="<|eos|>")
        .pack_flat(max_length=256).batch(microbatch_size=2)
    )


def jargon_skipped(loader) -> dict:
    return loader.stats()["datasets"]["jargon"]["total"]["skipped"]


@pytest.mark.parametrize("runner", ["inline", "thread", "process"])
def test_a_finite_run_whose_every_record_is_dropped_fails_at_its_end_naming_why(
    demo_data_dir, demo_tokenizer_path, runner
):
    """A misnamed field without TokenEstimation: the run read every record, handed over nothing and
    ended as if it had trained, after zero steps. It now fails at the end of the iteration, once
    every record is counted, so the ledger can still be read."""
    pipeline = jargon_pipeline(demo_data_dir, demo_tokenizer_path, field="txt", runner=runner)
    with pipeline.shard(0, 1, global_batch_size=4) as loader:
        with pytest.raises(ConfigurationError, match=NOTHING_TRAINED):
            for _ in loader:
                pass
        assert jargon_skipped(loader) == {"missing_field": JARGON_RECORDS}


def test_every_rank_of_a_run_whose_every_record_is_dropped_fails_naming_the_whole_recipes_drops(
    demo_data_dir, demo_tokenizer_path
):
    """Each rank reads its own lanes and then asks the others' whether any gives a row: the
    decision and the counts named are the recipe's, the same on 1 rank and on 2."""
    pipeline = jargon_pipeline(demo_data_dir, demo_tokenizer_path, field="txt")
    own = []
    for rank in range(2):
        with pipeline.shard(rank, 2, global_batch_size=4) as loader:
            with pytest.raises(ConfigurationError, match=NOTHING_TRAINED):
                list(loader)
            own.append(jargon_skipped(loader)["missing_field"])
    assert sum(own) == JARGON_RECORDS and all(own), own  # each rank's ledger holds its own lane only


def test_a_filter_that_keeps_a_few_records_trains_on_them_without_error(demo_data_dir, demo_tokenizer_path):
    pipeline = jargon_pipeline(demo_data_dir, demo_tokenizer_path, filter_fn=lambda record: record["term"][:1] == "Q")
    with pipeline.shard(0, 1, global_batch_size=4) as loader:
        batches = list(loader)
        totals = loader.stats()["datasets"]["jargon"]["total"]
    assert batches and 0 < totals["emitted"] < totals["filtered"], totals


def test_a_rank_whose_lanes_drop_every_record_ends_quietly_while_another_trains(demo_data_dir, demo_tokenizer_path):
    """A filter keeps only lane 0's records: on 2 ranks, rank 1 hands over nothing, as a rank does in
    the ragged end of a tiny dataset. The recipe trains on 1 rank, so it must on 2: rank 1 ends
    with no batch and no error, having found a row in rank 0's lane."""
    from zephon.work import Flush, lane_plan

    plain = jargon_pipeline(demo_data_dir, demo_tokenizer_path)
    with plain.shard(0, 1, global_batch_size=4) as loader:
        chunks = [item for item in lane_plan(loader.plan, 0, 2) if not isinstance(item, Flush)]
        lane_0 = {record["id"] for chunk in chunks for record in loader.plan.datasets["jargon"].read_chunk(chunk).records}
    pipeline = jargon_pipeline(demo_data_dir, demo_tokenizer_path, filter_fn=lambda record: record["id"] in lane_0)
    batches = {}
    for world_size in (1, 2):
        for rank in range(world_size):
            with pipeline.shard(rank, world_size, global_batch_size=4) as loader:
                batches[rank, world_size] = [batch.digest() for batch in loader]
    assert batches[1, 2] == [] and batches[0, 2] == batches[0, 1] != []


def test_a_run_that_handed_over_batches_and_then_ran_out_ends_without_error(demo_data_dir, demo_tokenizer_path):
    """Iterated again, or resumed from a state saved at its end, a finished run gives no batch:
    that is its end, not a recipe that drops everything."""
    pipeline = jargon_pipeline(demo_data_dir, demo_tokenizer_path)
    with pipeline.shard(0, 1, global_batch_size=4) as loader:
        assert list(loader)
        assert list(loader) == []
        state = loader.state_dict()
    with pipeline.shard(0, 2, global_batch_size=4) as resumed:
        resumed.load_state_dict(state)
        assert list(resumed) == []


def test_a_torchtitan_loader_over_a_run_whose_every_record_is_dropped_fails_the_same_way(
    demo_data_dir, demo_tokenizer_path
):
    pipeline = jargon_pipeline(demo_data_dir, demo_tokenizer_path, field="txt")
    with ZephonDataLoader(pipeline, 0, 1, global_batch_size=4) as loader:
        with pytest.raises(ConfigurationError, match=NOTHING_TRAINED):
            next(iter(loader))
        assert jargon_skipped(loader) == {"missing_field": JARGON_RECORDS}  # not wiped by handing back nothing


# -- a map that changes its record in place and returns nothing ----------------------------------
def _cleans_in_place(record):
    """The commonest slip in a map: the record is changed where it is, and nothing is returned,
    so every record comes back None, which drops it as `filtered`."""
    record["text"] = record["text"].lower()


FILTERED_BY_A_MAP = "a map returned None for: one that changes its record in place needs `return record`"


def test_a_map_without_a_return_is_named_in_the_token_estimation_refusal(datasets, demo_tokenizer_path):
    """The refusal said `filtered 64` and to check the filters, in a recipe that has none."""
    source = StaticMixtureWorkSource(datasets, mixture={"bible": 0.7, "jargon": 0.3},
                                     token_estimation=TokenEstimation(sample_records=64))
    pipeline = (Pipeline(source).options(num_lanes=8, runner="inline").map(_cleans_in_place)
                .tokenize(tokenizer_id=str(demo_tokenizer_path), eos="<|eos|>").pack_flat(max_length=256)
                .batch(microbatch_size=2))
    with pytest.raises(ConfigurationError, match=r"yielded no token \(records dropped: filtered 64\)") as refused:
        pipeline.shard(0, 1, global_batch_size=16)
    assert FILTERED_BY_A_MAP in str(refused.value)


def test_a_map_without_a_return_is_named_when_a_run_hands_over_no_row(demo_data_dir, demo_tokenizer_path):
    """Without token estimation the endless plan's refusal said `filtered: N` and to check the filters."""
    source = StaticMixtureWorkSource([Dataset.from_path("jargon", str(demo_data_dir / "jargon"))], seed=1)
    pipeline = (Pipeline(source).options(num_lanes=2, runner="inline").map(_cleans_in_place)
                .tokenize(tokenizer_id=str(demo_tokenizer_path), eos="<|eos|>").pack_flat(max_length=256)
                .batch(microbatch_size=2))
    with pipeline.shard(0, 1, global_batch_size=4) as loader:
        with pytest.raises(ConfigurationError, match=r"handed over no row \(dropped: filtered: \d+\)") as refused:
            next(iter(loader))
    assert FILTERED_BY_A_MAP in str(refused.value)


def test_a_refusal_without_filtered_records_says_nothing_of_maps(demo_data_dir, demo_tokenizer_path):
    pipeline = jargon_pipeline(demo_data_dir, demo_tokenizer_path, field="txt")
    with pipeline.shard(0, 1, global_batch_size=4) as loader:
        with pytest.raises(ConfigurationError, match=NOTHING_TRAINED) as refused:
            for _ in loader:
                pass
    assert "return record" not in str(refused.value)


def write_records(path, count: int, field: str):
    path.write_text("".join(json.dumps({field: f"record {i} of {path.stem} says a few words", "id": i}) + "\n"
                            for i in range(count)))
    return Dataset.from_path(path.stem, str(path))


def mixture_of_two(tmp_path, tokenizer, second_field: str):
    """A 0.6/0.4 endless mixture, no TokenEstimation, whose second dataset holds its text under `second_field`."""
    source = StaticMixtureWorkSource(
        [write_records(tmp_path / "good.jsonl", 400, "text"), write_records(tmp_path / "other.jsonl", 100, second_field)],
        {"good": 0.6, "other": 0.4}, seed=5, records_per_chunk=16,
    )
    return (
        Pipeline(source).options(num_lanes=2, runner="inline")
        .tokenize(tokenizer_id=str(tokenizer), field="text", eos="<|eos|>")
        .pack_flat(max_length=64).batch(microbatch_size=2)
    )


def read_microbatches(pipeline, count: int) -> dict:
    with pipeline.shard(0, 1, global_batch_size=4) as loader:
        for _, _ in zip(range(count), loader):
            pass
        return loader.stats()["datasets"]


DROPPED_WARNING = "was dropped"


def test_a_mixture_dataset_whose_every_record_is_dropped_is_warned_of_once_naming_why(
    tmp_path, demo_tokenizer_path, caplog
):
    """Without TokenEstimation the run trained on the other dataset alone, its weight unmet, and said nothing."""
    with caplog.at_level(logging.WARNING, logger="zephon"):
        datasets = read_microbatches(mixture_of_two(tmp_path, demo_tokenizer_path, "body"), 60)
    assert datasets["other"]["total"]["read"] >= 2 * 100 and datasets["other"]["total"]["emitted"] == 0, datasets
    warned = [r.getMessage() for r in caplog.records if DROPPED_WARNING in r.getMessage()]
    assert len(warned) == 1, warned
    (line,) = warned
    assert line.startswith("dataset 'other': every one of the 100 records this rank read of it"), line
    assert "(missing_field: 100)" in line and "mixture weight (0.4)" in line
    assert "TokenEstimation would refuse this dataset at planning" in line
    assert "'good'" not in line


def test_no_mixture_dataset_is_warned_of_when_each_gives_records(tmp_path, demo_tokenizer_path, caplog):
    with caplog.at_level(logging.WARNING, logger="zephon"):
        datasets = read_microbatches(mixture_of_two(tmp_path, demo_tokenizer_path, "text"), 60)
    assert datasets["other"]["total"]["read"] >= 2 * 100 and datasets["other"]["total"]["emitted"] > 0, datasets
    assert not [r.getMessage() for r in caplog.records if DROPPED_WARNING in r.getMessage()]


def test_a_new_iteration_reading_records_again_does_not_bring_the_dropped_warning_before_a_full_pass(
    tmp_path, demo_tokenizer_path, caplog
):
    """A new iteration replays each lane from its cursor's segment: counted again, those records
    made a rank that had read under a full pass of the dataset say it had read one."""
    pipeline = mixture_of_two(tmp_path, demo_tokenizer_path, "body")
    with caplog.at_level(logging.WARNING, logger="zephon"), pipeline.shard(0, 1, global_batch_size=4) as loader:
        for _ in range(120):
            for _, _ in zip(range(1), loader):
                pass
            if any(DROPPED_WARNING in r.getMessage() for r in caplog.records):
                break
        read = loader.stats()["datasets"]["other"]["total"]["read"]
    warned = [r.getMessage() for r in caplog.records if DROPPED_WARNING in r.getMessage()]
    assert len(warned) == 1, warned
    assert read >= 100, f"warned when this rank had read {read} of the 100 records of its pass: {warned[0]}"


def test_qwen_placeholders_after_a_decoder_without_a_spec_name_the_spec_to_decode_with(datasets):
    """`decode_images()` decodes with `ImageSpec()` (16 px patches, not merged), so a Qwen2-VL
    recipe that forgot its spec was refused with "placeholders merge 2x2 patches but the ImageSpec
    merges 1": no word of which ImageSpec (none was written) nor of the preset to give."""
    from vlm import ImageSpec, QwenPlaceholders

    pipeline = Pipeline(StaticMixtureWorkSource(datasets)).decode_images()
    with pytest.raises(ConfigurationError) as refused:
        pipeline.pack_multimodal(1024, QwenPlaceholders(1, 2, 3, merge_size=2))
    message = str(refused.value)
    assert "decode_images or decode_video before it, else ImageSpec()" in message
    assert "merge_size=2 before pack_multimodal (ImageSpec.qwen2_vl() or ImageSpec.qwen3_vl())" in message
    assert f"merges 1x1 (its patch_size={ImageSpec().patch_size};" in message


def test_a_vlm_pipeline_without_a_packer_is_told_of_pack_multimodal_not_only_pack_flat(datasets):
    """decode_images(...).batch(1) was refused with "needs a packing operator (e.g. pack_flat)":
    followed, pack_flat packs the captions alone and drops every decoded image, unsaid."""
    pipeline = Pipeline(StaticMixtureWorkSource(datasets)).decode_images().batch(microbatch_size=1)
    with pytest.raises(ConfigurationError, match=r"pack_multimodal\(max_length, placeholders\) for the images"):
        pipeline.shard(0, 1)


@pytest.mark.parametrize("packer", ["pack_flat", "pack_pairs"])
@pytest.mark.parametrize("decoder", ["decode_images", "decode_video"])
def test_pack_flat_after_a_decoder_is_refused_before_a_record_is_read(tmp_path, monkeypatch, decoder, packer):
    """decode_images(...).tokenize(...).pack_flat(...) gave batches of the captions' tokens alone:
    every decoded image dropped, with no word. The decoders declare the fields they write media
    to, and pack_flat (and pack_pairs), which carry none, are refused naming them, before the token
    estimate or a lane reads a record."""
    source = StaticMixtureWorkSource([Dataset.from_path("pairs", str(_png_pairs(tmp_path / "pairs")))],
                                     records_per_chunk=4, token_estimation=TokenEstimation())
    decode = {"decode_images": lambda p: p.decode_images(output_field="photo"),
              "decode_video": lambda p: p.decode_video(field="png", output_field="photo")}[decoder]
    pipeline = (getattr(decode(Pipeline(source).options(num_lanes=2, runner="inline"))
                        .tokenize(str(TOKENIZER), field="txt", eos="<|eos|>"), packer)(64).batch(microbatch_size=1))
    reads = []
    monkeypatch.setattr(Dataset, "read_chunk", lambda self, *a, **k: reads.append(a))
    with pytest.raises(ConfigurationError) as refused:
        pipeline.shard(0, 1)
    assert (f"{packer} packs token ids alone, but {decoder} writes 'photo': every record's decoded images and "
            "frames would be dropped from the batches" in str(refused.value)), str(refused.value)
    assert "pack_multimodal(max_length, placeholders)" in str(refused.value)
    assert reads == []
