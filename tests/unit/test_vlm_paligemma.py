"""PaliGemma: a picture, then BOS and a task prompt, trained on the answer alone, the prefix
attending both ways (vlm/_paligemma.py). The oracles are transformers' `PaliGemmaProcessor` (its
ids, labels, token types and pixels) and a tiny `PaliGemmaForConditionalGeneration` (each packed
document's logits those of the document alone)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from tests.conftest import requires_torch
from tests.unit.test_vlm_assets import package_dir
from vlm import ImageSpec, PadPlaceholders, decode_image
from vlm._packing import MultimodalPacker
from zephon import IGNORE_INDEX
from zephon._record_ops import TokenizeOp
from zephon._records import Chunk, ChunkRecords, RecordAddress

TOKENIZER = str(package_dir("zephon") / "data" / "tokenizer.json")
SPEC = ImageSpec.paligemma(size=56)  # 4x4 patches of 14 px: 16 image tokens, as 224 px gives 256
QUESTIONS = [("caption en\n", "a grey gradient"), ("answer en what is on the lane?\n", "a shard"),
             ("detect chunk\n", "<loc0012><loc0100> chunk")]


def _png(seed: int, height: int, width: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


PICTURES = [_png(1, 40, 70), _png(2, 90, 33), _png(3, 56, 56)]


@pytest.fixture(scope="module")
def processor():
    """`PaliGemmaProcessor` over the shipped tokenizer (no Gemma tokenizer ships offline), BOS and
    EOS named as Gemma's tokenizer names its own; it adds `<image>` and its location and
    segmentation tokens itself."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.paligemma.processing_paligemma import PaliGemmaProcessor
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=TOKENIZER, bos_token="<|bos|>", eos_token="<|eos|>",
                                        pad_token="<|pad|>")
    image_processor = SiglipImageProcessorPil(size={"height": 56, "width": 56})
    image_processor.image_seq_length = 16  # the checkpoints' preprocessor_config.json says it
    return PaliGemmaProcessor(image_processor=image_processor, tokenizer=tokenizer)


def records(tokenizer_path: str) -> list[dict]:
    """The questions as `tokenize(prompt_field="prompt")` and `decode_images` leave them. The
    tokenizer here has none of the location tokens, which the processor adds: an answer naming one
    is text to it (`<loc0012>` in characters), so the third record is tokenized by the processor's
    tokenizer's ids instead, as a map would write them."""
    chunk = ChunkRecords(Chunk("d", 0, 0, 2), [{"prompt": p, "text": t} for p, t in QUESTIONS[:2]],
                         [RecordAddress("d", "s", i) for i in range(2)])
    out = TokenizeOp(tokenizer_path, bos="<|bos|>", eos="<|eos|>", prompt_field="prompt").build("raise")(chunk).records
    return [{**record, "pixels": decode_image(data, SPEC)} for record, data in zip(out, PICTURES)]


def processed(processor, k: int) -> dict:
    prompt, answer = QUESTIONS[k]
    return processor(text=["<image>" + prompt[:-1]], images=[[Image.open(io.BytesIO(PICTURES[k]))]],
                     suffix=[answer], return_tensors="np")


def located(processor) -> dict:
    """The third question's record, its ids the processor's own (its location tokens are its
    added ones), its mask from the processor's token types (what `tokenize` would write)."""
    want = processed(processor, 2)
    ids = want["input_ids"][0][16:].astype(np.int32)  # after the picture's 16 tokens: BOS onwards
    return {"input_ids": ids, "loss_mask": want["token_type_ids"][0][16:] == 1,
            "pixels": decode_image(PICTURES[2], SPEC)}


def packed_row(processor, length: int = 160):
    placeholders = PadPlaceholders.paligemma(processor.tokenizer)
    packer = MultimodalPacker(None, max_length=length, placeholders=placeholders, spec=SPEC, pad_id=2,
                              image_position="before_text")
    documents = [*records(TOKENIZER), located(processor)]
    rows = [row for i, record in enumerate(documents)
            for row in packer.push((RecordAddress("d", "s", i), record))]
    [row] = rows + packer.flush()
    return row


@requires_torch
def test_each_document_is_the_processor_s_ids_labels_token_types_and_pixels(processor):
    import torch

    from vlm import paligemma_model_inputs

    row = packed_row(processor)
    tokens = {name: torch.from_numpy(array)[None].long() for name, array in row.tokens.items()}
    inputs = paligemma_model_inputs({**tokens, "pixel_values": torch.from_numpy(row.ragged["pixel_values"]),
                                     "image_grid": torch.from_numpy(row.ragged["image_grid"])})
    documents = row.tokens["document_ids"]
    for k in range(len(QUESTIONS)):
        want = processed(processor, k)
        at = documents == k
        assert row.tokens["input_ids"][at].tolist() == want["input_ids"][0].tolist(), k
        # The rows' labels are shifted: position i holds what the processor labels at i + 1.
        assert row.tokens["labels"][at].tolist() == [*want["labels"][0][1:].tolist(), IGNORE_INDEX], k
        assert inputs["token_type_ids"][0][torch.from_numpy(at)].tolist() == want["token_type_ids"][0].tolist(), k
        assert inputs["position_ids"][0][torch.from_numpy(at)].tolist() == list(range(1, int(at.sum()) + 1))
        np.testing.assert_allclose(inputs["pixel_values"][k].numpy(), want["pixel_values"][0], rtol=0, atol=1e-6)
    assert (inputs["token_type_ids"][0][torch.from_numpy(documents < 0)] == 0).all(), "padding is no suffix"


@requires_torch
# transformers' Gemma 2 takes eager attention alone (its logit soft-capping).
@pytest.mark.parametrize("attention, text_model", [("sdpa", "gemma"), ("eager", "gemma"), ("eager", "gemma2")],
                         ids=["paligemma-sdpa", "paligemma-eager", "paligemma2-eager"])
def test_a_tiny_paligemma_gives_each_packed_document_its_logits_alone(processor, attention, text_model):
    """The packed row through `paligemma_model_inputs` into a tiny randomly initialised
    `PaliGemmaForConditionalGeneration`: every document's logits are those the model gives it
    alone from its processor's inputs, its prefix attending both ways; PaliGemma 2's (Gemma 2's
    text model) with a sliding window of 4 in every other layer, shorter than every document.
    Given causal token types (all suffix) the prefixes' logits differ, so the check sees the
    prefix's attention."""
    import torch
    from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

    from vlm import paligemma_model_inputs

    config = PaliGemmaConfig(
        text_config=dict(model_type=text_model, vocab_size=len(processor.tokenizer), hidden_size=32,
                         intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, **({"sliding_window": 4} if text_model == "gemma2" else {})),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=56, patch_size=14, projection_dim=32),
        image_token_id=processor.image_token_id, projection_dim=32, attn_implementation=attention)
    torch.manual_seed(0)
    model = PaliGemmaForConditionalGeneration(config).eval()
    row = packed_row(processor)
    batch = {**{name: torch.from_numpy(array)[None].long() for name, array in row.tokens.items()},
             "pixel_values": torch.from_numpy(row.ragged["pixel_values"]),
             "image_grid": torch.from_numpy(row.ragged["image_grid"])}

    def logits(**inputs) -> torch.Tensor:
        with torch.no_grad():
            return model(**inputs, use_cache=False).logits[0]

    inputs = paligemma_model_inputs(batch)
    packed = logits(**inputs)
    causal = logits(**{**inputs, "token_type_ids": torch.ones_like(inputs["token_type_ids"])})
    assert torch.isfinite(packed).all()
    documents = torch.from_numpy(row.tokens["document_ids"])
    for k in range(len(QUESTIONS)):
        want = processed(processor, k)
        alone = logits(input_ids=torch.from_numpy(want["input_ids"]).long(),
                       token_type_ids=torch.from_numpy(want["token_type_ids"]).long(),
                       pixel_values=torch.from_numpy(want["pixel_values"]))
        torch.testing.assert_close(packed[documents == k], alone, rtol=0, atol=1e-5, msg=lambda m: f"document {k}: {m}")
        prefix = torch.from_numpy(want["token_type_ids"][0] == 0)
        assert not torch.allclose(causal[documents == k][prefix], alone[prefix], rtol=0, atol=1e-5), k


@requires_torch
def test_the_token_types_of_rows_follow_each_document_s_first_learned_position():
    """Written from the definition on hand-made rows: a document's suffix starts at the token its
    first learned position predicts and runs to its end; a document learning nothing, and padding,
    are all prefix."""
    import torch

    from vlm._paligemma import prefix_token_types

    I = IGNORE_INDEX
    labels = torch.tensor([[I, I, 5, 6, I, I, I, 9, I, I, I, I],
                           [7, 8, I, I, I, I, I, I, I, I, I, I]])
    documents = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, -1],
                              [0, 0, 0, 1, 1, 1, -1, -1, -1, -1, -1, -1]])
    assert prefix_token_types(labels, documents).tolist() == [[0, 0, 0, 1, 1, 0, 0, 0, 1, 0, 0, 0],
                                                               [0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]]
