"""A `RecipeMismatchError` crosses a process boundary whole.

A process runner's worker pickles the error its stage raised back to the parent, with the worker's
traceback added as a note (`runners/_worker.py`). `RecipeMismatchError` pickled its message and
`changed` keys alone, so the note was lost on the way, where every other Zephon error keeps it.
"""

from __future__ import annotations

import pickle

from zephon import CheckpointError, RecipeMismatchError


def test_a_recipe_mismatch_error_keeps_its_changed_keys_and_notes_through_pickle():
    error = RecipeMismatchError("the checkpoint was taken with a different recipe; changed: plan.seed", ("plan.seed",))
    error.add_note("raised in stage 'load', worker process 7")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is RecipeMismatchError and isinstance(copy, CheckpointError)
    assert str(copy) == str(error)
    assert copy.changed == ("plan.seed",)
    assert copy.__notes__ == ["raised in stage 'load', worker process 7"]


def test_a_recipe_mismatch_error_made_with_its_message_alone_pickles_with_no_changed_keys():
    copy = pickle.loads(pickle.dumps(RecipeMismatchError("num_lanes changed")))
    assert (str(copy), copy.changed) == ("num_lanes changed", ())
