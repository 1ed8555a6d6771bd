"""Which `DataRecipe` fields a checkpoint refusal's recipe keys stand for.

A `RecipeMismatchError` names the pipeline's recipe keys (`plan.schedule`, `operators[2].shuffle.seed`),
which a TorchTitan user never wrote: a changed mixture read as `plan.schedule`. The keys are those of
the pipeline `DataRecipe.pipeline()` builds; this module words them as the recipe's fields.
"""

from __future__ import annotations

from collections.abc import Iterable

_LOADER_BATCH = "global_batch_size (the loader's)"

# A key of the pipeline's recipe, its operator index dropped, and the DataRecipe field behind it.
_FIELD_OF_KEY = {
    "plan.datasets": "datasets",
    "tokenize.tokenizer": "tokenizer",
    "plan.schedule": "mixture",
    "tokenize.field": "text_field",
    "tokenize.bos": "bos",
    "tokenize.eos": "eos",
    "pack_flat.max_length": "max_length",
    "pack_flat.algorithm": "packing",
    "shuffle.buffer_size": "shuffle_buffer",
    "plan.seed": "seed",
    "shuffle.seed": "seed",
    "num_lanes": "num_lanes",
    "batch.microbatch_size": "microbatch_size",
    "flush_every_chunks": "flush_every_chunks",
    "plan.records_per_chunk": "records_per_chunk",
    "plan.num_epochs": "num_epochs",
    "global_batch_size": _LOADER_BATCH,
}

# Tokens per byte are measured on the datasets' records, tokenized with the tokenizer, text field,
# bos and eos: where one of those changed, the measurement followed it; otherwise it is
# `token_estimation` switched, or the text of a shard rewritten at its size (which the dataset
# digests, of sizes and counts, do not see), whatever else changed beside it.
_MEASURED_RATE = "plan.tokens_per_byte"
_MEASURED_RATE_FIELD = "token_estimation (or the text it measured)"
_MEASURED_THROUGH = {"datasets", "tokenizer", "text_field", "bos", "eos"}

# DataRecipe's field order, then the loader's global batch size.
_ORDER = (
    "datasets", "tokenizer", "mixture", "text_field", "bos", "eos", "max_length", "packing", "shuffle_buffer",
    "seed", "num_lanes", "microbatch_size", "flush_every_chunks", "records_per_chunk", _MEASURED_RATE_FIELD,
    "num_epochs", _LOADER_BATCH,
)


def data_recipe_fields(changed: Iterable[str]) -> list[str]:
    """The DataRecipe fields (and `global_batch_size`) behind the changed recipe keys, each once, in
    the order the recipe lists them; keys no field stands for are left out."""
    keys = [key.split(".", 1)[1] if key.startswith("operators[") else key for key in changed]
    fields = {_FIELD_OF_KEY[key] for key in keys if key in _FIELD_OF_KEY}
    if _MEASURED_RATE in keys and not fields & _MEASURED_THROUGH:
        fields.add(_MEASURED_RATE_FIELD)
    return [field for field in _ORDER if field in fields]
