"""`pack_multimodal_pairs`: each record's chosen and rejected documents, each with the record's
images, in one row as documents 2k and 2k+1, never split; deferred images decoded once for both;
the pairs it refuses, once each; the configurations it refuses."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from tests.harness import refusals
from tests.unit.test_vlm_packing import PIXTRAL, SPEC, picture, text
from vlm import PackMultimodalPairs
from vlm._deferred import DecodeDeferred, DeferredImage, decode_row
from vlm._image import probe_image
from zephon import IGNORE_INDEX, ConfigurationError, Pipeline, SegmentContext
from zephon._batch import collate
from zephon._records import RecordAddress
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

IMAGE_TOKENS = {(1, 2): 3, (2, 2): 6}  # Pixtral: a row of [IMG]s and [IMG_BREAK]s, [IMG_END] last


def _pair(index: int, chosen: int, rejected: int, images: list[np.ndarray]) -> tuple[RecordAddress, dict]:
    """A record whose ids say whose they are: 1000·(index+1) + position for the chosen answer, 500
    more for the rejected; its first two ids (a prompt) not learned."""
    base = 1000 * (index + 1)
    return RecordAddress("prefs", "s", index), {
        "chosen_ids": text(chosen, base), "rejected_ids": text(rejected, base + 500),
        "chosen_loss_mask": np.arange(chosen) >= 2, "rejected_loss_mask": np.arange(rejected) >= 2, "pixels": images}


def _packer(max_length: int, **options):
    op = PackMultimodalPairs(max_length, PIXTRAL, SPEC, pixels_field="pixels", max_open_rows=3, **options)
    return op.factory(0)(SegmentContext(lane=0, segment=0))


def _plans(packer, records) -> list:
    plans = [plan for record in records for plan in packer.push(record)]
    return plans + packer.flush()


def test_each_pair_is_one_records_two_documents_side_by_side_each_with_its_images():
    records = [_pair(i, 3 + i % 5, 2 + i % 4, [picture(1 + i % 2, 2, seed=i)] * (i % 3 != 0)) for i in range(12)]
    plans = _plans(_packer(48), records)
    placed = set()
    for plan in plans:
        row = plan.assemble()
        ids, documents = row.tokens["input_ids"], row.tokens["document_ids"]
        patches = np.split(row.ragged["pixel_values"], np.cumsum([r * c for r, c in row.ragged["image_grid"]])[:-1])
        assert len(row.sources) % 2 == 0
        image = 0
        for k in range(0, len(row.sources), 2):
            address = row.sources[k]
            assert row.sources[k + 1] == address and address.index not in placed
            placed.add(address.index)
            _, record = records[address.index]
            for d, side in ((k, "chosen"), (k + 1, "rejected")):
                text_ids = ids[(documents == d) & (ids >= 1000)]
                np.testing.assert_array_equal(text_ids, record[f"{side}_ids"])
                for pixels in record["pixels"]:
                    np.testing.assert_array_equal(patches[image], _patches(pixels))
                    image += 1
        assert image == len(patches), "each pair's images twice, nothing else"
    assert placed == set(range(12))


def _patches(pixels: np.ndarray) -> np.ndarray:
    from vlm import patchify

    return patchify(pixels, SPEC.patch_size)


def test_a_pair_longer_than_a_row_is_skipped_once_and_no_truncation_counted():
    packer = _packer(24)
    image = picture(2, 2, seed=0)  # 6 placeholder tokens in each document
    fits, too_long = _pair(0, 5, 5, [image]), _pair(1, 9, 4, [image])
    assert len(_plans(packer, [fits, too_long])) == 1
    assert packer.drain_truncations() == []
    [(address, reason, detail)] = refusals(packer.drain_skips())
    assert (address.index, reason) == (1, "pair_too_long")
    assert detail == "15 + 10 tokens (text and image placeholders), more than a row's max_length=24"
    longer_than_a_row = _pair(2, 30, 3, [])
    assert _plans(packer, [longer_than_a_row]) == [] and packer.drain_truncations() == []
    assert [reason for _, reason, _ in packer.drain_skips()] == ["pair_too_long"]


def test_a_record_missing_either_document_is_skipped_once_naming_the_first_missing():
    packer = _packer(48)
    address, record = _pair(0, 4, 4, [])
    del record["rejected_ids"], record["chosen_ids"]
    assert _plans(packer, [(address, record)]) == []
    [(_, reason, detail)] = refusals(packer.drain_skips())
    assert reason == "missing_text" and "'chosen_ids'" in detail
    address, record = _pair(1, 4, 4, [])
    record["rejected_loss_mask"] = [True]
    assert _plans(packer, [(address, record)]) == []
    [(_, reason, detail)] = refusals(packer.drain_skips())
    assert reason == "bad_loss_mask" and "'rejected_loss_mask'" in detail


def test_the_rejected_documents_image_offsets_are_its_own():
    packer = _packer(48)
    address, record = _pair(0, 5, 5, [picture(1, 2, seed=3)])
    record.update(chosen_image_offsets=[2], rejected_image_offsets=[4])
    row = _plans(packer, [(address, record)])[0].assemble()
    assert row.ragged["image_token_offset"].tolist() == [2, 4 + 5 + IMAGE_TOKENS[1, 2]]


def test_a_pairs_deferred_images_are_decoded_once_and_a_failure_masks_both_documents():
    data = _png(picture(2, 2, seed=1))
    good = DeferredImage(data, probe_image(data, SPEC), SPEC)
    broken = DeferredImage(b"no image at all", good.grid, SPEC)
    [plan] = _plans(_packer(64), [_pair(0, 4, 4, [good]), _pair(1, 4, 4, [broken])])
    assert DecodeDeferred("skip").order(plan) == (good, broken)
    decoded = decode_row(plan, on_error="skip")
    assert [number for number, *_ in decoded.masked] == [2, 3]
    row = decoded.assemble()
    grid_patches = good.grid[0] * good.grid[1]
    pixels = row.ragged["pixel_values"]
    np.testing.assert_array_equal(pixels[:grid_patches], pixels[grid_patches : 2 * grid_patches])
    assert pixels[:grid_patches].any() and not pixels[2 * grid_patches :].any()
    assert (row.tokens["labels"][row.tokens["document_ids"] >= 2] == IGNORE_INDEX).all()


def _png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def test_the_token_counter_counts_both_documents():
    op = PackMultimodalPairs(48, PIXTRAL, SPEC, pixels_field="pixels")
    count = op.token_counter()
    address, record = _pair(0, 5, 3, [picture(1, 2, seed=0)])
    assert count(address, record) == 5 + 3 + 2 * IMAGE_TOKENS[1, 2]
    assert count.learned(address, record) == 3 + 1, "each answer's ids past its prompt, but for the last"
    assert count(*_pair(1, 30, 30, [])) == 0
    assert [reason for _, reason, _ in count.drain_skips()] == ["pair_too_long"]


@pytest.mark.parametrize("options, says", [
    ({"rejected_field": "chosen_ids"}, "must be fields of their own"),
    ({"rejected_loss_mask_field": "chosen_loss_mask"}, "must be fields of their own"),
    ({"rejected_offsets_field": ""}, "rejected_offsets_field must be a record field's name"),
    ({"document_values": ["rejected_ids"]}, "document_values names 'rejected_ids'"),
])
def test_a_configuration_that_cannot_pack_pairs_is_refused(options, says):
    with pytest.raises(ConfigurationError, match=f"pack_multimodal_pairs: .*{says}"):
        PackMultimodalPairs(48, PIXTRAL, SPEC, **options)


def test_the_fingerprint_names_the_packer_and_both_documents_fields():
    out = PackMultimodalPairs(48, PIXTRAL, SPEC, field="chosen_ids").fingerprint(0)
    assert out["op"] == "pack_multimodal_pairs" and out["fields"][0] == "chosen_ids"
    assert out["rejected_fields"] == ["rejected_ids", "rejected_loss_mask", "rejected_image_offsets"]


def _pipeline(tmp_path, tokenizer, rejected_mask: str = "rejected_loss_mask", rejected_bos: str | None = "<|bos|>"):
    (tmp_path / "p.jsonl").write_text('{"prompt": "What is it?", "chosen": "a lane", "rejected": "a shard"}\n')
    pipe = Pipeline(StaticMixtureWorkSource([Dataset.from_path("p", str(tmp_path / "p.jsonl"))], seed=1))
    for side, mask, bos in (("chosen", "chosen_loss_mask", "<|bos|>"), ("rejected", rejected_mask, rejected_bos)):
        pipe = pipe.tokenize(str(tokenizer), field=side, prompt_field="prompt", keep_field=side == "chosen", bos=bos,
                             output_field=f"{side}_ids", loss_mask_field=mask)
    return pipe


def test_a_tokenize_writing_a_loss_mask_the_packer_does_not_read_is_refused(tmp_path, demo_tokenizer_path):
    pipe = _pipeline(tmp_path, demo_tokenizer_path, rejected_mask="loss_mask")
    with pytest.raises(ConfigurationError, match="pack_multimodal_pairs reads the rejected document's loss mask"):
        pipe.pack_multimodal_pairs(64, PIXTRAL, spec=SPEC)


def test_each_side_is_checked_as_pack_multimodal_checks_its_document(tmp_path, demo_tokenizer_path):
    """Images after BOS need a BOS in the rejected answer's ids too."""
    pipe = _pipeline(tmp_path, demo_tokenizer_path, rejected_bos=None)
    with pytest.raises(ConfigurationError, match="rejected_ids"):
        pipe.pack_multimodal_pairs(64, PIXTRAL, spec=SPEC, image_position="after_bos")
    assert _pipeline(tmp_path, demo_tokenizer_path).pack_multimodal_pairs(64, PIXTRAL, spec=SPEC,
                                                                         image_position="after_bos")


def test_pairs_batch_with_the_padding_row():
    op = PackMultimodalPairs(48, PIXTRAL, SPEC, pixels_field="pixels")
    [plan] = _plans(op.factory(0)(SegmentContext(0, 0)), [_pair(0, 4, 4, [picture(1, 2, seed=0)])])
    batch = collate([plan.assemble(), op.padding_row(0)], lane=0, step=0, index=0)
    assert batch.ragged_counts["image_grid"].tolist() == [2, 0]


def trl_vision_pair(k: int) -> tuple[dict, int]:
    """Record k as TRL's conversational vision preference datasets store it: a `prompt` of
    messages whose content holds an image part, the `chosen` and `rejected` answers as assistant
    messages (the rejected one names another picture), and its one picture aside."""
    from tests.unit.test_vlm_loss_mask import llava_chat

    chat, images = llava_chat(k)
    prompt, answer = chat["messages"]
    wrong = {"role": "assistant", "content": [{"type": "text", "text": f"A photograph, number {k + 1}."}]}
    return {"prompt": [prompt], "chosen": [answer], "rejected": [wrong]}, images


def with_prompt_before_each_answer(record: dict) -> dict:
    return {**record, "chosen": record["prompt"] + record["chosen"], "rejected": record["prompt"] + record["rejected"]}


def test_trls_conversational_vision_pairs_learn_each_answer_after_the_picture_at_its_marker(
        tmp_path_factory, demo_tokenizer_path):
    """render_chat (ChatML, an image part written `<image>`) and tokenize(segments=True,
    marker="<image>") on each side, each writing its own ids, mask and offsets: every pair in one
    row, each document's picture where its question's marker was, each learning what
    transformers' assistant mask says of its chat; the same on every runner."""
    from tests.unit.test_chat import CHATML_PARTS, reference, tokenizer_dir
    from tests.unit.test_vlm_image_markers import write_corpus
    from tests.unit.test_vlm_loss_mask import PLACEHOLDERS
    from vlm import ImageSpec

    corpus = write_corpus(tmp_path_factory.mktemp("trl_vision"), trl_vision_pair, "prefs")
    chat_dir = tokenizer_dir(tmp_path_factory.mktemp("chatml"), CHATML_PARTS, demo_tokenizer_path)
    expected = {}
    for shard in sorted(corpus.glob("*.jsonl")):
        for index, line in enumerate(shard.read_text().splitlines()):
            record = with_prompt_before_each_answer(json.loads(line))
            expected[shard.name, index] = [[i for i, learned in zip(*reference(chat_dir, record[side])) if learned]
                                           for side in ("chosen", "rejected")]
    source = StaticMixtureWorkSource([Dataset.from_path("prefs", str(corpus))], seed=5, records_per_chunk=3,
                                     num_epochs=1)
    digests = {}
    for runner in ("inline", "thread", "process"):
        pipeline = (Pipeline(source).options(num_lanes=2, runner=runner).map(with_prompt_before_each_answer)
                    .decode_images(field="image", spec=ImageSpec(max_pixels=48 * 48), paths=True, defer=True))
        for side in ("chosen", "rejected"):
            pipeline = (pipeline.render_chat(chat_dir, field=side, output_field=f"{side}_segments")
                        .tokenize(str(chat_dir / "tokenizer.json"), field=f"{side}_segments", segments=True,
                                  marker="<image>", output_field=f"{side}_ids", loss_mask_field=f"{side}_loss_mask",
                                  offsets_field=f"{side}_image_offsets"))
        pipeline = pipeline.pack_multimodal_pairs(320, PLACEHOLDERS).batch(2)
        placed, digests[runner] = {}, []
        with pipeline.shard(0, 1) as loader:
            for batch in loader:
                digests[runner].append(batch.digest())
                offsets = iter(batch.ragged["image_token_offset"].tolist())
                for row, sources in enumerate(batch.sources):
                    ids, labels = batch.tokens["input_ids"][row], batch.tokens["labels"][row]
                    documents = batch.tokens["document_ids"][row]
                    for k in range(0, len(sources), 2):
                        assert sources[k] == sources[k + 1]
                        key = sources[k].shard.rsplit("/", 1)[-1], sources[k].index
                        placed[key] = [labels[(documents == d) & (labels != IGNORE_INDEX)].tolist() for d in (k, k + 1)]
                        marks = [int(np.argmax(documents == d)) for d in (k, k + 1)]
                        before = [ids[start:next(offsets)].tolist() for start in marks]
                        assert before[0] == before[1] and before[0], "the picture where the question's marker was"
            assert loader.stats()["datasets"]["prefs"]["total"].get("skipped", {}) == {}
        assert placed == expected, runner
    assert digests["thread"] == digests["inline"] == digests["process"]


@pytest.mark.parametrize("position", ["before_text", "after_bos", "after_text"])
def test_each_document_of_a_pair_is_the_row_pack_multimodal_makes_of_that_side_alone(position):
    """With Qwen2-VL's placeholders and rotary positions: a document's ids, labels, positions,
    3-D positions and patches in the pair's row are those of the row `pack_multimodal` makes of the
    record's one side (its fields named as the document's), shifted to where it stands."""
    from tests.unit.test_vlm_mrope import PLACEHOLDERS as QWEN
    from tests.unit.test_vlm_mrope import SPEC as QWEN_SPEC
    from vlm import PackMultimodal

    def image(seed: int) -> np.ndarray:
        return np.random.default_rng(seed).integers(0, 256, (56, 84, 3), dtype=np.uint8)

    records = [_pair(i, 4 + i, 3 + 2 * i, [image(i)] * (1 + i % 2)) for i in range(4)]
    pairs = PackMultimodalPairs(400, QWEN, QWEN_SPEC, pixels_field="pixels", image_position=position, mrope=True)
    [plan] = _plans(pairs.factory(0)(SegmentContext(0, 0)), records)
    row = plan.assemble()
    patches_at, documents = 0, row.tokens["document_ids"]
    for d, address in enumerate(row.sources):
        side = ("chosen", "rejected")[d % 2]
        alone = PackMultimodal(400, QWEN, QWEN_SPEC, field=f"{side}_ids", loss_mask_field=f"{side}_loss_mask",
                               pixels_field="pixels", image_position=position, mrope=True)
        [single] = _plans(alone.factory(0)(SegmentContext(0, 0)), [records[address.index]])
        single = single.assemble()
        at, n = int(np.argmax(documents == d)), int(np.count_nonzero(documents == d))
        assert n == int(np.count_nonzero(single.tokens["document_ids"] == 0))
        for name in ("input_ids", "labels", "position_ids", "mrope_position_ids"):
            np.testing.assert_array_equal(row.tokens[name][..., at : at + n], single.tokens[name][..., :n])
        patches = len(single.ragged["pixel_values"])
        np.testing.assert_array_equal(row.ragged["pixel_values"][patches_at : patches_at + patches],
                                      single.ragged["pixel_values"])
        patches_at += patches
    assert patches_at == len(row.ragged["pixel_values"]) and len(row.sources) == 8


def test_truncate_keeps_the_images_and_shares_the_rest_of_the_row_between_the_two_texts():
    """Each document is the row `pack_multimodal` makes of its side with its text cut to its share
    (`row_shares`: the shorter whole where it takes at most half); the pair counted once."""
    from vlm import PackMultimodal
    from zephon._preference import row_shares

    image = picture(2, 2, seed=4)  # 6 placeholder tokens in each document: 28 of 40 for the texts
    records = [_pair(0, 30, 5, [image]), _pair(1, 20, 22, [image])]
    packer = _packer(40, overlong="truncate")
    plans = _plans(packer, records)
    assert packer.drain_skips() == []
    assert packer.drain_truncations() == [(records[0][0], 30 + 5 - 28), (records[1][0], 20 + 22 - 28)]
    for plan, (address, record) in zip(plans, records):
        row = plan.assemble()
        shares = row_shares(len(record["chosen_ids"]), len(record["rejected_ids"]), 28)
        at = 0
        for d, (side, share) in enumerate(zip(("chosen", "rejected"), shares)):
            cut = {**record, f"{side}_ids": record[f"{side}_ids"][:share],
                   f"{side}_loss_mask": record[f"{side}_loss_mask"][:share]}
            alone = PackMultimodal(40, PIXTRAL, SPEC, field=f"{side}_ids", loss_mask_field=f"{side}_loss_mask",
                                   pixels_field="pixels")
            [single] = _plans(alone.factory(0)(SegmentContext(0, 0)), [(address, cut)])
            single = single.assemble()
            n = 6 + share
            assert int(np.count_nonzero(row.tokens["document_ids"] == d)) == n
            for name in ("input_ids", "labels", "position_ids"):
                np.testing.assert_array_equal(row.tokens[name][at : at + n], single.tokens[name][:n])
            at += n
        assert at == 40 and len(row.ragged["image_grid"]) == 2


def test_truncate_skips_a_pair_whose_cut_would_leave_an_answer_learning_nothing():
    packer = _packer(24, overlong="truncate")
    too_short = _pair(0, 30, 30, [picture(2, 2, seed=0)])  # 12 ids for the two texts: 6 each, 2 of them prompt
    assert len(_plans(packer, [too_short])) == 1
    packer = _packer(16, overlong="truncate")  # 4 ids: 2 each, both prompt
    assert _plans(packer, [too_short]) == [] and packer.drain_truncations() == []
    [(_, reason, detail)] = refusals(packer.drain_skips())
    assert reason == "pair_too_long" and detail.endswith("cut to fit, one of the two would learn nothing")


def test_keep_end_is_refused_and_truncate_enters_the_fingerprint():
    with pytest.raises(ConfigurationError, match="overlong must be one of .*the start of its prompt"):
        PackMultimodalPairs(48, PIXTRAL, SPEC, overlong="keep_end")
    assert "overlong" not in PackMultimodalPairs(48, PIXTRAL, SPEC).fingerprint(0)
    assert PackMultimodalPairs(48, PIXTRAL, SPEC, overlong="truncate").fingerprint(0)["overlong"] == "truncate"
