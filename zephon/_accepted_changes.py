"""Which recipe changes a resume may accept on purpose (`load_state_dict(state, accept_changes=[...])`).

A checkpoint of another recipe is refused (SPEC §3.3), and a user who fixed a bug in a map
function, or changed a setting on purpose, could only start over. Naming the changed recipe keys
lets the lanes go on from their cursors with the new recipe: each lane replays its last segment of
chunks through the new operators and skips as many rows as the trainer took. The batches after
such a resume are the new recipe's, not (in general) bit-identical to an uninterrupted run of
either recipe.

Only what keeps a cursor's meaning can be accepted. A cursor says which segment of a lane's chunks
to replay, how many rows of it to skip and how many rows the lane handed over; the ledger counts
travel with it. The plan (every `plan.*` key: its datasets, seed, mixture, chunk size, epochs,
measured tokens per byte) decides which chunks a segment holds, `flush_every_chunks` where segments
end, `num_lanes` which lane a cursor is, and `global_batch_size` and the microbatch size which step
and which microbatch a row count stands at: accepted, they would put the saved cursors at other
chunks or other steps, reading records twice or never. The operators' settings (a map or filter
function, the tokenizer, max_length, packing, shuffle) change the rows a segment makes, not which
chunks it holds: those can be accepted.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from ._errors import ConfigurationError, RecipeMismatchError

__all__ = ["accepted_keys", "check_accepted", "how_to_accept"]

_MICROBATCH = ".batch.microbatch_size"

_MOVES_THE_CURSORS = {
    "recipe_version": "the checkpoint's recipe was written by a Zephon whose recipe keys mean other things",
    "num_lanes": "a cursor is one lane's, and another lane count deals the data to other lanes",
    "flush_every_chunks": "a cursor's segment counts flushes, which another value puts at other chunks",
    "global_batch_size": "a cursor's row count stands at a step of global_batch_size rows, and another size puts "
    "it at another step",
}
_PLAN = (
    "the plan decides which chunks each segment of a lane holds, and a cursor's segment would point at other "
    "chunks (records read twice or never)"
)


def accepted_keys(accept_changes: Iterable[str]) -> tuple[str, ...]:
    """The keys named, checked to be recipe keys as a refusal names them (a list of str)."""
    if isinstance(accept_changes, (str, bytes)):  # iterated, "plan.seed" would name its characters
        raise ConfigurationError(
            f"accept_changes={accept_changes!r} must be a list of recipe keys, e.g. accept_changes=[{accept_changes!r}]"
        )
    try:
        keys = tuple(accept_changes)
    except TypeError:
        raise ConfigurationError(
            f"accept_changes must be a list of recipe keys (as a refusal names them), got {type(accept_changes).__name__}"
        ) from None
    if not all(isinstance(key, str) for key in keys):
        raise ConfigurationError(f"accept_changes must hold recipe keys as str, got {list(keys)!r}")
    return keys


def check_accepted(
    accepted: tuple[str, ...], changed: list[str], saved: Mapping[str, str], current: Mapping[str, str]
) -> tuple[str, ...]:
    """Refuse the keys of `accept_changes` that are no recipe key of either side (a typo must not
    pass silently) and the changed ones no resume may accept, naming why. Returns the keys named
    that did not change: a job restarted from a checkpoint of the new recipe still has them in its
    configuration, and refusing them would stop it at every restart until someone edits it, so
    they are only said (`read_state` warns)."""
    unknown = [key for key in accepted if key not in saved and key not in current]
    if unknown:
        import difflib  # here: only a misnamed key is described

        close = {key: difflib.get_close_matches(key, [*current, *saved], n=1) for key in unknown}
        raise ConfigurationError(
            "accept_changes names " + ", ".join(
                f"{key}" + (f" (did you mean {close[key][0]}?)" if close[key] else "") for key in unknown
            )
            + ", which is no recipe key of the checkpoint or of this pipeline: name the keys that changed, as a "
            + "refusal names them" + (f" (changed: {', '.join(changed)})" if changed else " (nothing changed)")
        )
    moving = {key: why for key in accepted if key in changed and (why := _why_it_moves_the_cursors(key, saved, current))}
    if moving:
        raise RecipeMismatchError(
            "accept_changes cannot accept " + "; ".join(f"{key}: {why}" for key, why in moving.items())
            + ". Resume with the checkpoint's setting, or start the new recipe from the beginning",
            tuple(moving),
        )
    return tuple(key for key in accepted if key not in changed)


def how_to_accept(changed: list[str], saved: Mapping[str, str], current: Mapping[str, str]) -> str:
    """For a refusal: how to resume with the new recipe on purpose, where every changed key may be
    accepted; '' where one may not (naming it would be refused in turn)."""
    if any(_why_it_moves_the_cursors(key, saved, current) for key in changed):
        return ""
    return (
        " To go on from this checkpoint with the new recipe on purpose, name the changes: "
        f"load_state_dict(state, accept_changes={changed!r}) (ZephonDataLoader: accept_changes=); the batches "
        "after it are then the new recipe's, not bit-identical to an uninterrupted run of either recipe."
    )


def _why_it_moves_the_cursors(key: str, saved: Mapping[str, str], current: Mapping[str, str]) -> str | None:
    """Why accepting `key` would give the saved cursors another meaning, or None. The microbatch
    size is asked of its value, not its key: an operator added before `batch` renumbers the key
    (`operators[3]` to `operators[4]`) without changing the size."""
    if key.startswith("plan."):
        return _PLAN
    if key.endswith(_MICROBATCH) and _microbatch_sizes(saved) != _microbatch_sizes(current):
        return "a lane's place within a step is counted in microbatches of this size"
    return _MOVES_THE_CURSORS.get(key)


def _microbatch_sizes(digests: Mapping[str, str]) -> list[str]:
    return sorted(digest for key, digest in digests.items() if key.endswith(_MICROBATCH))
