"""`pack_multimodal(document_values=...)`: a record's number fields in each row holding its
document, one value a document (images alone, and a document whose deferred image fails, too),
as `pack_flat`'s; the records and names it refuses."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from tests.harness import refusals
from tests.unit.test_vlm_packing import PIXTRAL, SPEC, address, packer, picture, run, text
from vlm import PackMultimodal
from vlm._deferred import DeferredImage, decode_row
from vlm._image import probe_image
from zephon._batch import collate
from zephon._errors import ConfigurationError


def _records() -> list[dict]:
    """Captions with and without images, and images alone; each weighed by its index."""
    records = []
    for i in range(9):
        record = {"input_ids": text(3 + i % 4, start=1000 + 10 * i), "weight": i / 4, "label": i % 2 == 0}
        if i % 3 != 1:
            record["pixels"] = picture(1 + i % 2, 2, seed=i)
        if i == 6:
            record["input_ids"] = text(0)
        records.append(record)
    return records


def test_each_document_holds_its_records_values_in_a_batch_of_row_plans():
    records = _records()
    plans = run(packer(40, assemble=False, document_values=("weight", "label")), records)
    batch = collate(plans, lane=0, step=0, index=0)
    arrays = batch.to_numpy()
    documents = [len(sources) for sources in batch.sources]
    assert arrays["weight_counts"].tolist() == arrays["label_counts"].tolist() == documents
    order = [a.index for sources in batch.sources for a in sources]
    assert arrays["weight"].tolist() == [i / 4 for i in order]
    assert arrays["label"].tolist() == [float(i % 2 == 0) for i in order]
    assert arrays["image_grid"].shape[0] == sum("pixels" in r for r in records), "the rows' images as before"
    assembled = [plan.assemble() for plan in plans]
    assert [v for row in assembled for v in row.ragged["weight"].tolist()] == arrays["weight"].tolist()


def test_a_padding_row_holds_none_and_batches_with_the_rows():
    op = PackMultimodal(40, PIXTRAL, SPEC, document_values=["weight"])
    padding = op.padding_row(0)
    assert padding.ragged["weight"].shape == (0,) and padding.ragged["weight"].dtype == np.float64
    [plan, *_] = run(packer(40, assemble=False, document_values=("weight",)), _records())
    batch = collate([plan.assemble(), padding], lane=0, step=0, index=0)
    assert batch.ragged_counts["weight"].tolist() == [len(plan.documents), 0]


def test_a_document_whose_deferred_image_fails_keeps_its_value_and_place():
    """It trains on nothing, but its values stay aligned with `document_ids`."""
    data = _png(picture(2, 2, seed=1))
    good = DeferredImage(data, probe_image(data, SPEC), SPEC)
    broken = DeferredImage(b"no image at all", good.grid, SPEC)
    records = [{"input_ids": text(3), "pixels": good, "weight": 1.0},
               {"input_ids": text(3, 2000), "pixels": broken, "weight": 2.0},
               {"input_ids": text(3, 3000), "weight": 3.0}]
    [plan] = run(packer(64, assemble=False, document_values=("weight",)), records)
    decoded = decode_row(plan, on_error="skip")
    assert [number for number, *_ in decoded.masked] == [1]
    row = decoded.assemble()
    assert row.ragged["weight"].tolist() == [1.0, 2.0, 3.0] and row.tokens["document_ids"].max() == 2


def _png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize("value, reason", [(None, "missing_field"), ("0.5", "bad_document_value"),
                                           (float("inf"), "bad_document_value")])
def test_a_record_with_no_number_is_skipped_by_name_before_it_is_cut(value, reason):
    pack = packer(20, document_values=("weight",))
    record = {"input_ids": text(40), "pixels": picture(1, 2, seed=0), "weight": value}
    assert run(pack, [record]) == [] and pack.drain_truncations() == []
    [(at, skipped, detail)] = refusals(pack.drain_skips())
    assert (at, skipped) == (address(0), reason) and "'weight'" in detail


def test_the_token_counter_refuses_it_alike():
    count = PackMultimodal(40, PIXTRAL, SPEC, document_values=["weight"]).token_counter()
    assert count(address(0), {"input_ids": text(5), "weight": 1}) == 5
    assert count(address(1), {"input_ids": text(5), "weight": [1]}) == 0
    assert [reason for _, reason, _ in count.drain_skips()] == ["bad_document_value"]


@pytest.mark.parametrize("name, says", [
    ("pixel_values", "cannot carry 'pixel_values' into the rows: the rows hold their own"),
    ("mrope_position_ids", "cannot carry 'mrope_position_ids' into the rows"),
    ("video_grid", "cannot carry 'video_grid' into the rows"),
    ("pixels", "names 'pixels', the field of a document's ids, loss mask or images"),
    ("image_offsets", "names 'image_offsets', the field of"),
])
def test_names_that_cannot_stand_in_a_multimodal_row_are_refused(name, says):
    with pytest.raises(ConfigurationError, match=f"pack_multimodal: document_values {says}"):
        PackMultimodal(40, PIXTRAL, SPEC, pixels_field="pixels", document_values=[name])


def test_the_fingerprint_holds_them_only_where_given():
    assert "document_values" not in PackMultimodal(40, PIXTRAL, SPEC).fingerprint(0)
    assert PackMultimodal(40, PIXTRAL, SPEC, document_values=("w",)).fingerprint(0)["document_values"] == ["w"]
