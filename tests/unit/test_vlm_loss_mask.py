"""Image-grounded questions trained on their answers: `tokenize(marker=..., prompt_field=...)` then
`pack_multimodal` learns the answer's tokens only, never the question's nor an image's, wherever
the images stand, a caption cut to fit included (zephon/_loss_mask.py, vlm/_packing.py); and
LLaVA-Instruct's chats rendered by their template (`render_chat`, zephon/_chat.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from tests.unit.test_chat import CHATML_PARTS, reference, tokenizer_dir
from tests.unit.test_vlm_assets import package_dir
from tests.unit.test_vlm_image_markers import write_corpus
from tests.unit.test_vlm_packing import PIXTRAL, address, packer, picture, run, text
from vlm import ImageSpec, PixtralPlaceholders
from zephon import IGNORE_INDEX, Pipeline
from zephon._tokenizer import load_tokenizer
from zephon.io import Dataset
from zephon.work import StaticMixtureWorkSource

TOKENIZER = str(package_dir("zephon") / "data" / "tokenizer.json")
PLACEHOLDERS = PixtralPlaceholders(3, 4, 5)


def learned_labels(ids: list[int], mask: list[bool]) -> list[int]:
    """A document's text's labels as written from the definition: the next text id where the mask
    keeps it; the last id learns nothing."""
    return [ids[k + 1] if k + 1 < len(ids) and mask[k + 1] else IGNORE_INDEX for k in range(len(ids))]


@pytest.mark.parametrize("image_position", ["before_text", "after_bos"])
def test_the_answer_alone_is_learned_around_an_image(image_position):
    ids, mask = text(9), np.array([False] * 4 + [True] * 5)
    [row] = run(packer(40, image_position=image_position),
                [{"input_ids": ids, "loss_mask": mask, "pixels": picture(1, 2, seed=1)}])
    tokens = row.tokens["input_ids"].tolist()
    labels = row.tokens["labels"].tolist()
    placeholder = len(PIXTRAL.tokens_for(1, 2))
    first = 0 if image_position == "before_text" else 1  # where the image's placeholders start
    text_positions = [j for j in range(placeholder + 9) if not first <= j < first + placeholder]
    assert [tokens[j] for j in text_positions] == ids.tolist()
    learned = [labels[j] for j in range(placeholder + 9) if labels[j] != IGNORE_INDEX]
    assert learned == ids[4:].tolist(), "the answer's ids and nothing else, the first one included"
    # The position before each text token learns it only where the mask keeps it.
    for k, j in enumerate(text_positions):
        if j > 0:
            assert labels[j - 1] == (ids[k] if mask[k] else IGNORE_INDEX), (k, j)


def test_a_caption_cut_to_fit_keeps_its_mask_aligned():
    ids = text(30)
    mask = np.arange(30) % 3 != 0
    pack = packer(16)
    [row] = run(pack, [{"input_ids": ids, "loss_mask": mask, "pixels": picture(1, 1, seed=2)}])
    placeholder = len(PIXTRAL.tokens_for(1, 1))
    kept = 16 - placeholder
    assert pack.drain_truncations() == [(address(0), 30 - kept)]
    labels = row.tokens["labels"].tolist()
    assert labels[placeholder - 1 :] == [ids[0] if mask[0] else IGNORE_INDEX] + \
        learned_labels(ids[:kept].tolist(), mask[:kept].tolist())


def test_a_bad_mask_is_skipped_by_name():
    pack = packer(32)
    assert run(pack, [{"input_ids": text(4), "loss_mask": [1, 0, 1], "pixels": picture(1, 1, seed=3)}]) == []
    [(skipped, reason, describe)] = pack.drain_skips()
    assert (skipped, reason) == (address(0), "bad_loss_mask")
    assert describe() == "'loss_mask' holds 3 flags for the 4 ids of 'input_ids'"


def question(k: int) -> tuple[dict, int]:
    """Record k of the `vqa` corpus, its one picture aside: a question with `<image>` and its
    answer, and the same as two turns of a chat."""
    prompt = f"<image>\nWhat is in picture {k}?\n" if k % 2 else f"Picture {k}: <image> Describe it.\n"
    answer = f"A gradient, number {k} of twelve."
    turns = [[prompt, False], [answer, True], ["\nAnd its number?\n", False], [f" {k}.", True]]
    return {"prompt": prompt, "text": answer, "turns": turns}, 1


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("vqa"), question, "vqa")


def pipeline(corpus: Path, runner: str, **texts) -> Pipeline:
    source = StaticMixtureWorkSource([Dataset.from_path("vqa", str(corpus))], seed=5, records_per_chunk=3,
                                     num_epochs=1)
    return (Pipeline(source).options(num_lanes=2, runner=runner)
            .decode_images(field="image", spec=ImageSpec(max_pixels=48 * 48), paths=True, parallelism=2)
            .tokenize(TOKENIZER, bos="<|bos|>", eos="<|eos|>", marker="<image>", parallelism=2,
                      **(texts or {"field": "text", "prompt_field": "prompt"}))
            .pack_multimodal(160, PLACEHOLDERS)
            .batch(2))


@pytest.mark.parametrize("form", ["prompt", "turns"])
def test_an_epoch_learns_every_answer_and_no_question_on_every_runner(corpus, form):
    """A question and its answer (`prompt_field`), or two turns of a chat (`segments=True`)."""
    encoder = load_tokenizer(TOKENIZER).tokenizer
    answers = []
    for shard in sorted(corpus.glob("*.jsonl")):
        for line in shard.read_text().splitlines():
            record = json.loads(line)
            texts = [record["text"]] if form == "prompt" else [text for text, learned in record["turns"] if learned]
            answers += [i for text in texts for i in encoder.encode(text, add_special_tokens=False).ids] + [1]
    texts = {} if form == "prompt" else {"field": "turns", "segments": True}
    digests = {}
    for runner in ("inline", "thread", "process"):
        learned, digests[runner] = [], []
        with pipeline(corpus, runner, **texts).shard(0, 1) as loader:
            for batch in loader:
                digests[runner].append(batch.digest())
                arrays = batch.to_numpy()
                learned += arrays["labels"][arrays["labels"] != IGNORE_INDEX].tolist()
            assert loader.stats()["mixture"]["vqa"]["learned"] == len(answers), runner
        assert sorted(learned) == sorted(answers), runner
    assert digests["thread"] == digests["inline"] == digests["process"]
    assert len(digests["inline"]) > 1


def test_a_mask_field_naming_another_field_of_the_packer_is_refused():
    from vlm._packing import PackMultimodal
    from zephon import ConfigurationError

    for field in ("input_ids", "image_offsets"):
        with pytest.raises(ConfigurationError, match=f"loss_mask_field='{field}' is also the field of the ids"):
            PackMultimodal(64, PIXTRAL, loss_mask_field=field)
    assert "loss_mask_field" not in PackMultimodal(64, PIXTRAL).fingerprint(0)
    assert PackMultimodal(64, PIXTRAL, loss_mask_field="mask").fingerprint(0)["loss_mask_field"] == "mask"


def llava_chat(k: int) -> tuple[dict, int]:
    """Record k of the `vqa` corpus as a chat, stored as LLaVA-Instruct stores it (its picture, then
    the question, with `<image>`, and the answer as ShareGPT's turns) and as TRL's vision datasets
    do (messages whose contents are lists of parts, the picture an image part where `<image>` was)."""
    record, images = question(k)
    turns = [{"from": "human", "value": record["prompt"]}, {"from": "gpt", "value": record["text"]}]
    before, after = record["prompt"].split("<image>")
    parts = [{"type": "text", "text": before}] * bool(before) + [{"type": "image"}, {"type": "text", "text": after}]
    messages = [{"role": "user", "content": parts},
                {"role": "assistant", "content": [{"type": "text", "text": record["text"]}]}]
    return {"conversations": turns, "messages": messages}, images


@pytest.fixture(scope="module")
def chat_corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("llava_chat"), llava_chat, "vqa")


@pytest.mark.parametrize("form", ["conversations", "messages"])
def test_a_llava_instruct_chat_learns_its_answers_around_its_picture_on_every_runner(
    chat_corpus, tmp_path_factory, demo_tokenizer_path, form
):
    """render_chat (ChatML, writing an image part as `<image>`) then tokenize(segments=True,
    marker="<image>") then pack_multimodal: each picture is placed where its question's marker
    was, and an epoch learns exactly what transformers' assistant masks say: every answer and its
    end of turn."""
    chat_dir = tokenizer_dir(tmp_path_factory.mktemp("chatml"), CHATML_PARTS, demo_tokenizer_path)
    roles = {"human": "user", "gpt": "assistant"}
    keys = {"role_key": "from", "content_key": "value", "roles": roles} if form == "conversations" else {}
    expected, before_picture = [], {}
    matching = Tokenizer.from_file(str(chat_dir / "tokenizer.json"))
    for shard in sorted(chat_corpus.glob("*.jsonl")):
        for index, line in enumerate(shard.read_text().splitlines()):
            record = json.loads(line)
            turns = [{"role": roles[t["from"]], "content": t["value"]} for t in record["conversations"]]
            ids, mask = reference(chat_dir, turns if form == "conversations" else record["messages"])
            assert ids == reference(chat_dir, turns)[0], "the two forms are one chat"
            expected += [i for i, learned in zip(ids, mask) if learned]
            question = turns[0]["content"]
            text = "<|bos|><|im_start|>user\n" + question[: question.index("<image>")]
            before_picture[(shard.name, index)] = matching.encode(text, add_special_tokens=False).ids
    source = StaticMixtureWorkSource([Dataset.from_path("vqa", str(chat_corpus))], seed=5, records_per_chunk=3,
                                     num_epochs=1)
    digests = {}
    for runner in ("inline", "thread", "process"):
        pipeline = (Pipeline(source).options(num_lanes=2, runner=runner)
                    .decode_images(field="image", spec=ImageSpec(max_pixels=48 * 48), paths=True, parallelism=2)
                    .render_chat(chat_dir, field=form, **keys)
                    .tokenize(str(chat_dir / "tokenizer.json"), field="segments", segments=True, marker="<image>",
                              parallelism=2)
                    .pack_multimodal(160, PLACEHOLDERS)
                    .batch(2))
        learned, images, digests[runner] = [], 0, []
        with pipeline.shard(0, 1) as loader:
            for batch in loader:
                digests[runner].append(batch.digest())
                labels = batch.tokens["labels"]
                learned += labels[labels != IGNORE_INDEX].tolist()
                images += len(batch.ragged["image_grid"])
                offsets = iter(batch.ragged["image_token_offset"].tolist())
                for row, sources in enumerate(batch.sources):
                    documents = batch.tokens["document_ids"][row]
                    for number, origin in enumerate(sources):  # one picture each, in row order
                        start, offset = int(np.argmax(documents == number)), next(offsets)
                        placed = batch.tokens["input_ids"][row][start:offset].tolist()
                        assert placed == before_picture[(Path(origin.shard).name, origin.index)], origin
                assert next(offsets, None) is None, "one picture a question"
            assert loader.stats()["mixture"]["vqa"]["learned"] == len(expected), runner
        assert sorted(learned) == sorted(expected), runner
        assert images == 12, "every question's picture, at its marker"
    assert digests["thread"] == digests["inline"] == digests["process"]
