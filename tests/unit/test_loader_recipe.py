"""A loader fingerprints its recipe once, when it is built, and keeps it for its whole life.

Fingerprinting a map or filter walks its code and writes the values of the globals it reads: a
lookup table of 10**6 entries takes seconds. A loader did it twice at build (the recipe, then the
token counter's key), and one loader is built per rank at every start of a training job.
"""

from __future__ import annotations

import functools
import re
from collections import Counter

import pytest

from tests.reliability.harness import global_batch, jsonl_dataset, text_pipeline
from zephon import RecipeMismatchError, _checkpoint, _fingerprint

LENGTHS = {"river": 5, "stone": 5}  # a module global the map below reads, a lookup table in small


def with_known_length(record: dict) -> dict:
    """A map configured by the lookup table it reads."""
    first = record["text"].split()[0]
    return {**record, "known": LENGTHS.get(first, 0)}


def counting(calls: Counter, method):
    @functools.wraps(method)
    def counted(operator, *args):
        calls[id(operator)] += 1
        return method(operator, *args)

    return counted


def test_a_loader_fingerprints_each_operator_once_over_build_iteration_state_dict_and_load_state_dict(
    tmp_path, monkeypatch
):
    pipeline = text_pipeline(jsonl_dataset(tmp_path / "data"), map_fn=with_known_length, estimate_tokens=True)
    fingerprinted = Counter()
    for kind in {type(op) for op in pipeline.operators}:
        monkeypatch.setattr(kind, "fingerprint", counting(fingerprinted, kind.fingerprint))
    walked = Counter()
    globals_read = _fingerprint.globals_read
    monkeypatch.setattr(_fingerprint, "globals_read", lambda code: walked.update([code]) or globals_read(code))

    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        next(iter(loader))
        loader.load_state_dict(loader.state_dict())

    assert fingerprinted == {id(op): 1 for op in pipeline.operators}, [
        (op.name, fingerprinted[id(op)]) for op in pipeline.operators
    ]
    assert walked[with_known_length.__code__] == 1, walked


def test_a_loader_digests_its_recipe_once_not_at_every_state_dict_and_load_state_dict(tmp_path, monkeypatch):
    """The recipe holds the values the map reads, written whole: hashing it again at every save and
    every load cost each checkpoint as much as hashing the lookup table."""
    pipeline = text_pipeline(jsonl_dataset(tmp_path / "data"), map_fn=with_known_length)
    hashed = []
    canonical_json = _checkpoint.canonical_json
    monkeypatch.setattr(_checkpoint, "canonical_json", lambda value: hashed.append(value) or canonical_json(value))

    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        for _ in range(2):
            next(iter(loader))  # a load ends the iteration it suspended: each round takes up a new one
            loader.load_state_dict(loader.state_dict())
        saved = loader.state_dict()

    the_maps = [value for value in hashed if isinstance(value, str) and "with_known_length" in value]
    assert len(the_maps) == 1, len(the_maps)
    assert saved["recipe"] == _checkpoint.recipe_digests(loader.recipe)


def test_a_global_changed_after_the_loader_was_built_enters_the_recipe_of_loaders_built_after_it(
    tmp_path, monkeypatch
):
    """The recipe describes the operators as they were when the loader was built: a global changed
    later does not change what that loader saves, and it takes its own state back; a loader built
    after the change, as a resumed job builds one, refuses that state, naming the map."""
    pipeline = text_pipeline(jsonl_dataset(tmp_path / "data"), map_fn=with_known_length)
    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as loader:
        next(iter(loader))
        before = loader.state_dict()
        monkeypatch.setitem(LENGTHS, "river", 6)
        after = loader.state_dict()
        loader.load_state_dict(after)
    assert after == before

    with pipeline.shard(0, 1, global_batch_size=global_batch(pipeline)) as rebuilt, pytest.raises(
        RecipeMismatchError
    ) as refusal:
        rebuilt.load_state_dict(after)
    assert re.search(r"changed: operators\[0\]\.map\.fn\. Performance", str(refusal.value)), refusal.value


PLAIN_VALUES = [None, True, False, 0, -7, 10**40, 1.5, -0.0, float("nan"), float("inf"), 2 - 3j, "", "it's \"quoted\"",
                "naïve\n\u200b", b"\x00bytes'", bytes(range(256))]


def test_a_table_of_plain_values_is_written_as_its_repr_without_asking_each_item_what_object_it_is(monkeypatch):
    """A lookup table of 10**6 strings and numbers took 2 s to write: every key and value was asked
    whether it is a dataclass, a namedtuple or an object with settings. Plain values are written as
    `repr` writes them, which is what that path gave, so no recipe's digest changes."""
    table = {f"word{i}": i for i in range(1000)} | {repr(value): value for value in PLAIN_VALUES}
    values = [table, [PLAIN_VALUES, tuple(PLAIN_VALUES)], PLAIN_VALUES[-1]]
    asked = []
    shown_attributes = _fingerprint._shown_attributes
    monkeypatch.setattr(_fingerprint, "_shown_attributes", lambda value: asked.append(value) or shown_attributes(value))

    for value in values:
        assert _fingerprint._describable(value)
        assert _fingerprint._stable_repr(value) == repr(value)
    assert asked == []


def test_a_table_holding_an_integer_too_long_for_repr_is_written_by_value_under_any_digit_limit():
    """`repr` refuses an int of over 4,300 decimal digits (Python's default limit, which
    `sys.set_int_max_str_digits` changes per process), and a table holding one was then written by
    its type's name alone: an edit anywhere in it left the map's fingerprint as it was, and a
    checkpoint of the old table resumed; where the limit was lifted the same table was written by
    value, another recipe. Such an int is written in hex, which no limit applies to."""
    import sys

    def reading(table):
        return lambda record: {**record, "n": len(table)}

    huge = 7**6000  # 5,071 digits
    before = _fingerprint._fingerprint_callable(reading({"modulus": huge, "words": ("river",)}))
    edited = _fingerprint._fingerprint_callable(reading({"modulus": huge, "words": ("stone",)}))
    assert before != edited
    assert "river" in before and "<builtins.dict>" not in before, before
    limit = sys.get_int_max_str_digits()
    try:
        sys.set_int_max_str_digits(0)
        unlimited = _fingerprint._fingerprint_callable(reading({"modulus": huge, "words": ("river",)}))
    finally:
        sys.set_int_max_str_digits(limit)
    assert unlimited == before
    assert _fingerprint._stable_repr([10**4000, -(10**4000)]) == repr([10**4000, -(10**4000)])  # within the limit: as before
