"""Which `DataRecipe` fields a checkpoint refusal's recipe keys stand for.

A `RecipeMismatchError` names the pipeline's recipe keys (`plan.schedule`, `operators[2].shuffle.seed`),
which a TorchTitan user never wrote: a changed mixture read as `plan.schedule`. The keys are those of
the pipeline `DataRecipe.pipeline()` builds; this module words them as the recipe's fields.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# A key of the pipeline's recipe, its operator index dropped, and the DataRecipe field behind it
# (or the loader's own global_batch_size).
_FIELD_OF_KEY = {
    "plan.datasets": "datasets",
    "tokenize.tokenizer": "tokenizer",
    "plan.schedule": "mixture",
    "tokenize.field": "text_field",
    "tokenize.prompt_field": "prompt_field",
    "render_chat.field": "chat_field",
    "render_chat.template": "tokenizer",
    "render_chat.special_tokens": "tokenizer",
    "render_chat.tool_use_template": "tokenizer",
    "render_chat.today": "chat_today",
    "render_chat.template_kwargs": "chat_template_kwargs",
    "render_chat.tools_field": "chat_tools_field",
    "render_chat.documents_field": "chat_documents_field",
    "render_chat.template_kwargs_field": "chat_template_kwargs_field",
    "render_chat.template_name": "chat_template_name",
    "render_chat.keys": "chat_keys",
    "render_chat.roles": "chat_roles",
    "render_chat.learned_roles": "chat_learned_roles",
    "render_chat.on_rewrite": "chat_on_rewrite",
    "render_chat.datasets": "chat_datasets",
    "tokenize.datasets": "chat_datasets",
    "render_chat.rendering": "chat_field",
    "tokenize.segments": "chat_field",
    "tokenize.bos": "bos",
    "tokenize.eos": "eos",
    "pack_flat.max_length": "max_length",
    "pack_flat.algorithm": "packing",
    "pack_flat.overlong": "overlong",
    "shuffle.buffer_size": "shuffle_buffer",
    "plan.seed": "seed",
    "shuffle.seed": "seed",
    "num_lanes": "num_lanes",
    "batch.microbatch_size": "microbatch_size",
    "flush_every_chunks": "flush_every_chunks",
    "plan.records_per_chunk": "records_per_chunk",
    "plan.num_epochs": "num_epochs",
    "global_batch_size": "global_batch_size",
}

# The directory's templates, and the keys that pick which of them are rendered with: a template's
# key changes with those, the tokenizer (its directory) unchanged, and is then theirs to name.
_PICKED_BY = {
    "render_chat.template": {"render_chat.template_name"},
    "render_chat.tool_use_template": {"render_chat.tools_field", "render_chat.template_name"},
}

# Tokens per byte are measured on the datasets' records, tokenized with the tokenizer, text and
# prompt fields, bos and eos (and the chat fields), as many as the packer places (max_length,
# overlong): where one of those changed, the measurement followed it; otherwise it is
# `token_estimation` switched, or the text of a shard rewritten at its size (which the dataset
# digests, of sizes and counts, do not see), whatever else changed beside it.
_MEASURED_RATE = "plan.tokens_per_byte"
_LEARNED_RATE = "plan.learned_per_byte"  # in the recipe with mixture_count="learned" alone
_MEASURED_THROUGH = {"datasets", "tokenizer", "text_field", "prompt_field", "chat_field", "chat_today",
                     "chat_template_kwargs", "chat_tools_field", "chat_documents_field", "chat_template_kwargs_field",
                     "chat_template_name", "chat_keys", "chat_roles", "chat_learned_roles", "chat_on_rewrite",
                     "chat_datasets", "bos", "eos", "max_length", "overlong"}

# How a refusal words the fields whose name alone would mislead.
_WORDING = {
    "token_estimation": "token_estimation (or the text it measured)",
    "global_batch_size": "global_batch_size (the loader's)",
}


def data_recipe_fields(changed: Iterable[str], recipe_fields: Sequence[str]) -> list[str]:
    """The DataRecipe fields (and the loader's `global_batch_size`) behind the changed recipe keys,
    each once, in the order `recipe_fields` (DataRecipe's own) lists them, `global_batch_size` last;
    keys no field stands for are left out."""
    changed = list(changed)
    added_or_dropped = _step_added_or_dropped(changed)
    if added_or_dropped is not None:  # each operator after it compares with another: only that is said
        changed = [key for key in changed if not key.startswith("operators[")] + [added_or_dropped]
    keys = [key.split(".", 1)[1] if key.startswith("operators[") else key for key in changed]
    keys = [key for key in keys if _PICKED_BY.get(key, set()).isdisjoint(keys)]
    fields = {_FIELD_OF_KEY[key] for key in keys if key in _FIELD_OF_KEY}
    if _MEASURED_RATE in keys and not fields & _MEASURED_THROUGH:
        fields.add("token_estimation")
    elif _LEARNED_RATE in keys and not fields & _MEASURED_THROUGH:
        fields.add("mixture_count")
    return [_WORDING.get(field, field) for field in (*recipe_fields, "global_batch_size") if field in fields]


def _step_added_or_dropped(changed: list[str]) -> str | None:
    """The key standing for a step one side's pipeline has and the other lacks, or None: the
    `render_chat` step (`chat_field` set or left out), else the `tokenize` of the plain text beside
    the chats (`chat_datasets` set or left out, or naming every dataset). Operators are compared by
    position, so one position then holds two operators' keys."""
    ops_at: dict[str, set[str]] = {}
    for key in changed:
        if key.startswith("operators["):
            at, rest = key.split(".", 1)
            ops_at.setdefault(at, set()).add(rest.split(".", 1)[0])
    shifted = [ops for ops in ops_at.values() if len(ops) > 1]
    if not shifted:
        return None
    return "tokenize.segments" if any("render_chat" in ops for ops in shifted) else "tokenize.datasets"
