"""How a recipe-mismatch refusal tells which dataset changed, and how, from the dataset summaries a
state carries (`_checkpoint.dataset_summaries`, `_dataset_changes.describe_dataset_changes`).

The summaries are built here from recipes written by hand, as a Dataset's fingerprint writes its
entry ({"name", "format", "text_unit", "shards": [{"url", "num_records", "nbytes"}]}); the tests
of whole loaders are in tests/reliability/test_checkpoint_safety.py.
"""

from __future__ import annotations

import pytest

from zephon._checkpoint import dataset_summaries
from zephon._dataset_changes import MAX_NAMED, describe_dataset_changes, moved_datasets


def entry(name: str | None, sizes: list[int], *, records: int = 4, fmt: str = "jsonl", prefix: str = "") -> dict:
    """A dataset entry of a recipe: one shard of `records` records per size in `sizes`."""
    shards = [
        {"url": f"{prefix}{name}/part-{i:05d}.jsonl", "num_records": records, "nbytes": size}
        for i, size in enumerate(sizes)
    ]
    return {"name": name, "format": fmt, "text_unit": "line", "shards": shards}


def summaries(*entries: dict) -> list[dict]:
    return dataset_summaries({"plan": {"datasets": list(entries)}})


def test_a_dataset_whose_shard_was_renamed_is_told_by_its_shard_list_of_the_same_count_and_size():
    """Renamed where it lies: its root is the same, so no move either."""
    then = summaries(entry("a", [10, 20]))
    renamed = entry("a", [10, 20])
    renamed["shards"][1]["url"] = "a/part-00009.jsonl"
    now = summaries(renamed)
    assert describe_dataset_changes(then, now) == ["dataset 0 ('a'): shard list changed (same count and total size)"]
    assert moved_datasets(then, now) == []


@pytest.mark.parametrize(
    ("before", "after"),
    [("/mnt/a/corpus/", "/scratch/corpus/"), ("/data/", "s3://bucket/corpora/"), ("", "/abs/")],
)
def test_the_same_shards_under_another_root_are_a_move_naming_both_roots(before, after):
    then = summaries(entry("a", [10, 20], prefix=before), entry("b", [30], prefix="/kept/"))
    now = summaries(entry("a", [10, 20], prefix=after), entry("b", [30], prefix="/kept/"))
    assert moved_datasets(then, now) == [f"dataset 0 ('a'): {before}a/ in the checkpoint, {after}a/ now"]


def test_shards_in_several_directories_move_by_the_deepest_directory_they_share():
    then, now = entry("a", [10, 20], prefix="/mnt/x/"), entry("a", [10, 20], prefix="/scratch/y/")
    for side, root in ((then, "/mnt/x/"), (now, "/scratch/y/")):
        side["shards"][0]["url"] = f"{root}2024/part-0.jsonl"
        side["shards"][1]["url"] = f"{root}2025/part-0.jsonl"
    assert summaries(then)[0]["root"] == "/mnt/x/"
    assert moved_datasets(summaries(then), summaries(now)) == ["dataset 0 ('a'): /mnt/x/ in the checkpoint, /scratch/y/ now"]


def _resized(prefix: str) -> dict:
    changed = entry("a", [10, 20], prefix=prefix)
    changed["shards"][1]["nbytes"] = 21
    return changed


@pytest.mark.parametrize(
    "now",
    [
        _resized("/scratch/"),  # moved and a shard rewritten
        entry("a", [10, 20], prefix="/scratch/", fmt="text"),  # moved and read in another format
        entry("a", [10], prefix="/scratch/"),  # moved and a shard left behind
    ],
    ids=["shard_resized", "format_changed", "shard_left_behind"],
)
def test_a_move_with_any_other_change_is_no_move(now):
    assert moved_datasets(summaries(entry("a", [10, 20], prefix="/mnt/")), summaries(now)) == []


def test_a_moved_dataset_whose_shard_changed_is_told_with_both_roots():
    then, now = summaries(entry("a", [10, 20], prefix="/mnt/")), summaries(_resized("/scratch/"))
    assert describe_dataset_changes(then, now) == [
        "dataset 0 ('a'): shard list changed (same count; 30 bytes in the checkpoint, 31 now; "
        "under /mnt/a/ in the checkpoint, /scratch/a/ now)"
    ]


def test_summaries_without_roots_tell_no_move():
    """A state of version 6 holds none: whether its shards only moved cannot be told."""
    then = [{k: v for k, v in s.items() if k not in ("root", "shards_under_root")}
            for s in summaries(entry("a", [10], prefix="/mnt/"))]
    assert moved_datasets(then, summaries(entry("a", [10], prefix="/scratch/"))) == []


def test_a_shard_rewritten_with_other_records_is_told_by_its_bytes_and_records():
    then = summaries(entry("a", [10, 20]), entry("b", [1000, 2000]))
    now = summaries(entry("a", [10, 20]), entry("b", [1000, 2500], records=5))
    assert describe_dataset_changes(then, now) == [
        "dataset 1 ('b'): shard list changed (same count; 3,000 bytes in the checkpoint, 3,500 now; "
        "8 records in the checkpoint, 10 now)"
    ]


def test_a_dataset_read_in_another_format_is_told_by_the_setting_that_changed():
    then = summaries(entry("a", [10]))
    now = summaries(entry("a", [10], fmt="parquet"))
    assert describe_dataset_changes(then, now) == ["dataset 0 ('a'): format changed"]


def test_datasets_listed_in_another_order_are_told_as_an_order_not_as_changed_datasets():
    then = summaries(entry("a", [10]), entry("b", [20]))
    now = summaries(entry("b", [20]), entry("a", [10]))
    assert describe_dataset_changes(then, now) == ["their order: 'a', 'b' in the checkpoint, 'b', 'a' now"]


def test_datasets_without_distinct_names_are_paired_by_index():
    """A WorkPlan of the user's may list entries with no name, or one name twice: pairing by name
    would then pair the wrong entries, so each is compared with the entry at its index."""
    then = summaries(entry(None, [10]), entry(None, [20]))
    now = summaries(entry(None, [10]), entry(None, [20, 30]))
    assert describe_dataset_changes(then, now) == ["dataset 1: 1 shard in the checkpoint, 2 now"]


def test_a_mixture_of_many_changed_datasets_names_the_first_few_and_counts_the_rest():
    names = [f"d{i}" for i in range(MAX_NAMED + 3)]
    then = summaries(*(entry(name, [10]) for name in names))
    now = summaries(*(entry(name, [10, 10]) for name in names))
    described = describe_dataset_changes(then, now)
    assert described[:MAX_NAMED] == [f"dataset {i} ('d{i}'): 1 shard in the checkpoint, 2 now" for i in range(MAX_NAMED)]
    assert described[MAX_NAMED:] == ["and 3 more"]


@pytest.mark.parametrize(
    "recipe",
    [{}, {"plan": {}}, {"plan": {"datasets": "a digest of the user's"}}, {"plan": {"datasets": ["a", "b"]}}],
)
def test_a_plan_without_a_list_of_dataset_entries_has_no_summaries(recipe):
    """A refusal then names `plan.datasets` alone, as before summaries existed."""
    assert dataset_summaries(recipe) is None


def test_entries_without_a_shard_list_are_told_only_that_it_changed():
    then = summaries({"name": "a", "shards": "listing-1"})
    now = summaries({"name": "a", "shards": "listing-2"})
    assert describe_dataset_changes(then, now) == ["dataset 0 ('a'): shard list changed"]
