"""What a plan's recipe key stands for in the arguments a Pipeline user wrote, for a refusal.

A `RecipeMismatchError` names recipe keys (`changed: plan.schedule`). An operator's key carries its
argument's name (`operators[2].pack_flat.max_length`) and so do most of the plan's, but two do not:
a user who changed the work source's `mixture=` was told `plan.schedule`, and one whose data or
tokenizer moved the measured token rates, `plan.tokens_per_byte`. The keys stay (they are the
error's `changed`, which tests and adapters read); the refusal adds what these stand for.
"""

from __future__ import annotations

from typing import Iterable

_MEANING = {
    "plan.schedule": "the work source's weights (StaticMixtureWorkSource's mixture=, "
    "ScheduledMixtureWorkSource's schedule=)",
    "plan.tokens_per_byte": "the tokens per byte TokenEstimation measured on each dataset's sample "
    "(TokenEstimation added or removed, or the sampled text or the tokenizer changed)",
    "plan.learned_per_byte": "the learned tokens per byte TokenEstimation(count='learned') measured on each "
    "dataset's sample (count='learned' set or left out, or the sampled text, the tokenizer or the loss masks changed)",
}


def meaning_of_keys(changed: Iterable[str]) -> str:
    """' KEY is WHAT; …' for each changed key whose name is not its argument's, '' for none."""
    said = [f"{key} is {_MEANING[key]}" for key in changed if key in _MEANING]
    return " " + "; ".join(said) + "." if said else ""
