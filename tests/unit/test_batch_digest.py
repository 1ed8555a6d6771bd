"""The SHA-256 of a microbatch covers every value of every field, and a global batch's SHA-256
depends on its microbatches only, never on the order they are handed in.

A digest that skipped a field (say `position_ids`) would keep every determinism test green while
two runs diverge in that field: the barcode would call them identical.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from zephon import Batch, MicrobatchDigest, PartialGlobalBatchError, StepShape, combine_digests, global_batch_digest


def _batch(lane: int = 0, index: int = 0, step: int = 0) -> Batch:
    rng = np.random.default_rng(lane * 10 + index)
    tokens = {name: rng.integers(0, 1000, (2, 8), dtype=np.int32)
              for name in ("input_ids", "labels", "position_ids", "document_ids")}
    ragged = {"pixel_values": rng.integers(0, 255, (5, 12), dtype=np.uint8),
              "image_grid": np.array([[1, 2], [1, 3]], dtype=np.int32)}
    counts = {"pixel_values": np.array([2, 3], dtype=np.int64), "image_grid": np.array([1, 1], dtype=np.int64)}
    return Batch(lane, step, index, tokens, ragged, counts)


def _fields(batch: Batch):
    for group in ("tokens", "ragged", "ragged_counts"):
        for name in getattr(batch, group):
            yield group, name


@pytest.mark.parametrize("group,name", list(_fields(_batch())))
def test_changing_one_value_of_any_field_changes_the_microbatch_digest(group, name):
    batch = _batch()
    reference = batch.digest()
    changed = _batch()
    array = getattr(changed, group)[name]
    array.flat[-1] += 1
    assert changed.digest() != reference, f"{group}[{name!r}] is not covered by the digest"


def test_the_same_bytes_in_another_shape_give_another_digest():
    batch, reshaped = _batch(), _batch()
    reshaped.tokens["input_ids"] = reshaped.tokens["input_ids"].reshape(4, 4)
    assert reshaped.digest() != batch.digest()


def test_a_global_digest_does_not_depend_on_the_order_its_microbatches_are_given_in():
    """Ranks (or a gather) may hand microbatches in any order; the digest is taken in canonical
    (lane, index) order."""
    batches = [_batch(lane, index) for lane in range(4) for index in range(2)]
    canonical = combine_digests(b.digest() for b in batches)
    assert global_batch_digest(batches) == canonical
    assert global_batch_digest(reversed(batches)) == canonical
    assert global_batch_digest(batches[1::2] + batches[::2]) == canonical


def test_a_global_digest_of_no_microbatch_is_refused():
    """The SHA-256 of nothing is a digest like any other: two steps that delivered nothing would
    compare as identical global batches."""
    from zephon import ZephonError

    with pytest.raises(ZephonError, match="needs at least one microbatch"):
        global_batch_digest([])
    with pytest.raises(ZephonError, match="needs at least one microbatch"):
        global_batch_digest(iter(()))


def test_a_global_digest_of_a_microbatch_given_twice_is_refused():
    """A global batch holds each (lane, index) once: a rank's part gathered twice was hashed twice,
    a digest no run's global batch has."""
    from zephon import ZephonError

    batches = [_batch(lane, index) for lane in range(2) for index in range(2)]
    with pytest.raises(ZephonError, match=r"\(lane, index\) \[\(1, 0\)\] are given more than once"):
        global_batch_digest(batches + [_batch(1, 0)])


def _step(num_lanes: int, per_lane: int, *, finite: bool = False, step: int = 0) -> list[Batch]:
    """A whole step's microbatches as a loader makes them: each says its step's shape."""
    shape = StepShape(num_lanes, per_lane, finite)
    return [dataclasses.replace(_batch(lane, index, step), step_shape=shape)
            for lane in range(num_lanes) for index in range(per_lane)]


def test_a_global_digest_of_a_step_missing_a_lane_is_refused_naming_its_microbatches():
    """A rank's part not gathered: its lanes' microbatches are missing, and the digest of the
    rest is of no run's step, so a determinism check would compare a wrong number unsaid."""
    batches = [b for b in _step(4, 2) if b.lane != 2]
    with pytest.raises(PartialGlobalBatchError, match=r"step 0 lacks microbatches \(lane, index\) \[\(2, 0\), \(2, 1\)\]") as info:
        global_batch_digest(batches)
    assert info.value.missing == [(2, 0), (2, 1)]
    with pytest.raises(PartialGlobalBatchError, match=r"\[\(2, 0\), \(2, 1\)\]"):
        global_batch_digest(b.to_digest() for b in batches)


def test_a_global_digest_of_a_step_missing_a_microbatch_index_is_refused_naming_it():
    batches = [b for b in _step(2, 3) if (b.lane, b.index) != (1, 2)]
    with pytest.raises(PartialGlobalBatchError, match=r"lacks microbatches \(lane, index\) \[\(1, 2\)\] of its 2 lanes of 3"):
        global_batch_digest(batches)


def test_a_finite_plan_s_lane_that_ended_leaves_no_hole_but_one_before_its_end_does():
    """In a finite plan's ragged end a lane stops at its last microbatch and gives none after it:
    such a step is whole. An index missing before that last one is not."""
    batches = _step(2, 3, finite=True)
    ragged = [b for b in batches if (b.lane, b.index) != (1, 2)]
    ragged[-1].ends_lane = True  # lane 1 ended with its index 1
    assert global_batch_digest(ragged) == combine_digests(b.digest() for b in ragged)
    without_lane_0 = [b for b in ragged if b.lane != 0]  # lane 0 ended at an earlier step
    assert global_batch_digest(without_lane_0) == combine_digests(b.digest() for b in without_lane_0)
    with pytest.raises(PartialGlobalBatchError, match=r"\[\(1, 0\)\]"):
        global_batch_digest([b for b in ragged if (b.lane, b.index) != (1, 0)])


def test_gathered_microbatch_digests_give_the_digest_of_the_microbatches():
    """What ranks gather instead of their tensors (`Batch.to_digest()`) combines to the same number."""
    batches = _step(4, 2)
    assert global_batch_digest(b.to_digest() for b in reversed(batches)) == global_batch_digest(batches)
    assert global_batch_digest(batches) == combine_digests(b.digest() for b in batches)


def test_microbatch_digests_written_as_json_and_read_back_are_checked_and_combined_alike():
    """Ranks that hand their results over in JSON files (the elastic demo's processes) wrote
    (lane, index, sha256) and combined them unchecked, so a rank's part missing was compared as a
    whole step. `as_json()` keeps what the check needs, and `from_json` gives the digest back."""
    import json

    batches = _step(4, 2)
    batches[-1].ends_lane = True
    written = json.loads(json.dumps([b.to_digest().as_json() for b in batches]))
    read = [MicrobatchDigest.from_json(d) for d in written]
    assert read == [b.to_digest() for b in batches]
    assert global_batch_digest(read) == global_batch_digest(batches)
    with pytest.raises(PartialGlobalBatchError, match=r"\[\(3, 0\), \(3, 1\)\]"):
        global_batch_digest(d for d in read if d.lane != 3)
