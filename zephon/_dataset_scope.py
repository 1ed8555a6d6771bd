"""Stateless stages scoped to some datasets of a mixture: checking the names they give.

A record operator may declare `dataset_scope`: None (it runs on every chunk) or the names of the
datasets whose chunks it runs on, the others passing it unchanged (vlm's `decode_images(datasets=...)`
and `decode_video(datasets=...)` give theirs, so one pipeline decodes an image dataset's records and
a video dataset's). The operator applies its scope itself; the scope is read under this name alone,
not `datasets`, which an operator of the user's own may hold for anything else (a dict of Hugging
Face datasets, a count). A name that is no dataset of the work source would scope the stage to
nothing, and the dataset meant would reach the packer undecoded, unsaid: such a name is refused
here, naming the datasets there are, before any record is read.
"""

from __future__ import annotations

from typing import Callable, Iterable

from ._errors import ConfigurationError

__all__ = ["check_dataset_names", "check_dataset_scopes", "scoped", "with_scope", "work_source_dataset_names"]


def check_dataset_names(value: object, user: str, setting: str = "datasets") -> tuple[str, ...] | None:
    """`value` (None, a dataset's name, or a non-empty list of them) as None or a sorted tuple of
    distinct names, else ConfigurationError naming `user` (the stage) and `setting` (what it was
    given as). Sorted, so that a stage's fingerprint does not depend on the order its datasets
    were listed in."""
    if value is None:
        return None
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (list, tuple, set, frozenset)) or not all(isinstance(n, str) and n for n in names):
        raise ConfigurationError(
            f"{user}: {setting} must be None (every dataset), a dataset's name or a list of them, got {value!r}"
        )
    if not names:
        raise ConfigurationError(
            f"{user}: {setting}={value!r} names no dataset, so the stage would run on no record; "
            "give the datasets it decodes, or None for every dataset"
        )
    return tuple(sorted(set(names)))


def work_source_dataset_names(source: object) -> tuple[str, ...] | None:
    """The names a work source declares as its `dataset_names` (the mixture sources do); None
    for a source that does not, whose bound plan is asked instead. Not its `datasets`, which a
    source of the user's own may hold for anything else: hub ids had a decoder scoped to a
    dataset of the plan refused as naming none, and a count failed every pipeline with a bare
    TypeError when sharded."""
    names = getattr(source, "dataset_names", None)
    if names is None:
        return None
    return (names,) if isinstance(names, str) else tuple(names)  # one name as a string: not its letters


def check_dataset_scopes(operators: Iterable[object], dataset_names: Iterable[str]) -> None:
    """Refuse an operator whose `dataset_scope` names a dataset not among `dataset_names`. An
    operator of the user's own may give one name as a string: it is read as that name, not as letters."""
    known = list(dataset_names)
    for op in operators:
        user = getattr(op, "name", type(op).__name__)
        scope = check_dataset_names(getattr(op, "dataset_scope", None), user, "dataset_scope")
        if scope is None:
            continue
        for name in scope:
            if name not in known:
                import difflib  # here: only a misnamed dataset is described

                close = difflib.get_close_matches(name, known)
                guess = "; did you mean " + " or ".join(map(repr, close)) + "?" if close else ""
                raise ConfigurationError(
                    f"{user}(datasets={list(scope)}): {name!r} is no dataset of "
                    f"the work source, whose datasets are {known}{guess}"
                )


def scoped(fn: Callable, scope: tuple[str, ...] | None) -> Callable:
    """The stage function `fn` run on the chunks of the datasets in `scope` (None: on every chunk),
    the chunks of the others handed on as they came, neither changed nor counted: a mixture of
    text and chats tokenizes each with the stages scoped to it."""
    if scope is None:
        return fn

    def run_in_scope(batch):
        return fn(batch) if batch.chunk.dataset in scope else batch

    return run_in_scope


def with_scope(fingerprint: dict, scope: tuple[str, ...] | None) -> dict:
    """A stage's fingerprint with its scope, where it has one: a stage on every dataset keeps the
    fingerprint it had before stages could be scoped, and the checkpoints that hold it resume."""
    return fingerprint if scope is None else {**fingerprint, "datasets": list(scope)}
