"""Stateless record operators: map, filter, tokenize.

Each works on a whole chunk (`ChunkRecords -> ChunkRecords`) so that dispatch costs are paid per
chunk, not per record. They are pure: the same chunk gives the same output on any worker. How a
map's or filter's function enters the recipe is `_fingerprint`'s job.
"""

from __future__ import annotations

import functools
import traceback
import types
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ._dataset_scope import scoped, with_scope
from ._errors import BadRecordError, ConfigurationError, UserFunctionError, check_count
from ._field_names import fields_it_has
from ._fingerprint import _describe_callable, _fingerprint_callable
from ._loss_mask import LOSS_MASK_FIELD, prompt_segments, record_segments, segments_detail, segments_problem
from ._markers import OFFSETS_FIELD, MarkerOffsets, encode_at_markers
from ._records import ChunkRecords
from ._segment_encoding import encode_segments, learned_ids
from ._tokenizer import SPLIT_SPECIAL_TOKENS, TokenizerHandle, load_tokenizer, tokenizers_pool_is_off

__all__ = [
    "RecordOperator", "MapOp", "FilterOp", "TokenizeOp", "RecordFn", "check_parallelism", "check_user_function",
    "estimate_stages",
]

RecordFn = Callable[[ChunkRecords], ChunkRecords]


class RecordOperator:
    """Base of operators that run on workers. Subclasses are frozen dataclasses.

    One that runs on some datasets of a mixture only (vlm's decoders) declares them as
    `dataset_scope` (None or their names), applies that scope itself, and has the names checked
    against the work source's when the pipeline is sharded (`_dataset_scope`).

    An operator that writes decoded media (vlm's `decode_images` and `decode_video` write pixels
    and frames; they follow this shape without subclassing it) names those fields in
    `media_fields`: a packer that says it carries no media (`carries_media = False`, as
    `pack_flat`) is then refused when the loader is built, since every record's media would be
    dropped from the batches and its text packed alone, unsaid."""

    kind = "record"
    name: str
    parallelism: int
    media_fields: tuple[str, ...] = ()

    def build(self, on_error: str) -> RecordFn:
        raise NotImplementedError

    def build_for_estimate(self) -> RecordFn:
        """The function the token estimate runs on its sample: one that skips and counts a bad
        record whatever the policy. The sample is read when `shard()` plans, in an order of its
        own: a fail-fast policy there raised from planning, for whichever bad record the sample
        happened to hold first, not the one training reaches first (see `estimate_stages`)."""
        return self.build("skip")

    def fingerprint(self) -> dict:
        raise NotImplementedError


def estimate_stages(record_ops) -> list[RecordFn]:
    """The functions of `record_ops` for the token estimate: `build_for_estimate()` where an
    operator has it (an operator with an error policy of its own, as VLM's decoders, overrides it),
    else `build("skip")`, so that `on_error="raise"` fails when training reaches a bad record, in
    training order, never inside `shard()` while the sample is measured."""
    return [op.build_for_estimate() if hasattr(op, "build_for_estimate") else op.build("skip") for op in record_ops]


@dataclass(frozen=True)
class _EachRecord(RecordOperator):
    """A user's function run on each record of a chunk (`map`, `filter`), on the records of
    `datasets` only where given; recorded in the recipe by its name and its code."""

    fn: Callable[[dict], object]
    parallelism: int = 1
    datasets: tuple[str, ...] | None = None
    name: str = ""

    @property
    def dataset_scope(self) -> tuple[str, ...] | None:
        return self.datasets

    def build(self, on_error: str) -> RecordFn:
        return scoped(self._build(), self.datasets)

    def _build(self) -> RecordFn:
        raise NotImplementedError

    def fingerprint(self) -> dict:
        return with_scope({"op": self.name, "fn": _fingerprint_callable(self.fn)}, self.datasets)


@dataclass(frozen=True)
class MapOp(_EachRecord):
    """`fn(record) -> record` (a new or the same dict). Returning None drops the record as filtered.

    What `fn` returns is copied (shallowly) before later stages see it, because they may set and
    drop its fields (tokenize replaces its text by ids): a result that `fn` keeps and returns again
    (a module-level default, a cache) was changed by the first tokenization, and later records
    holding it were skipped as `missing_field`, which ones depending on the runner and on which
    worker ran which chunk first. The copy costs ~50 ns a record (a few keys), against several
    µs to tokenize one.
    """

    fn: Callable[[dict], dict | None]
    name: str = "map"

    def _build(self) -> RecordFn:
        fn, name = self.fn, self.name

        def apply_map(batch: ChunkRecords) -> ChunkRecords:
            out = []
            for record, address in zip(batch.records, batch.addresses):
                try:
                    result = fn(record)
                except Exception:
                    raise UserFunctionError(address, name, traceback.format_exc()) from None
                if result is not None and not isinstance(result, dict):  # else the next stage fails, unnamed
                    raise UserFunctionError(
                        address, name, f"{_describe_callable(fn)} returned {_a_or_an(type(result).__name__)}, "
                        "not a record (a dict) or None"
                    )
                out.append(None if result is None else result.copy())
            batch.records = out
            batch.keep([r is not None for r in out])
            return batch

        return apply_map


_NOT_A_VERDICT = (types.CoroutineType, types.GeneratorType, types.AsyncGeneratorType)
"""What a filter may return that is true whatever it holds: a coroutine or generator keeps
every record, so the filter did nothing, unsaid."""


@dataclass(frozen=True)
class FilterOp(_EachRecord):
    """Keeps records for which `fn(record)` is true; the others are counted as filtered."""

    fn: Callable[[dict], bool]
    name: str = "filter"

    def _build(self) -> RecordFn:
        fn, name = self.fn, self.name

        def apply_filter(batch: ChunkRecords) -> ChunkRecords:
            mask = []
            for record, address in zip(batch.records, batch.addresses):
                try:
                    verdict = fn(record)
                    if verdict is not True and verdict is not False and isinstance(verdict, _NOT_A_VERDICT):
                        if isinstance(verdict, types.CoroutineType):
                            verdict.close()  # never run: else a "never awaited" warning follows
                        raise UserFunctionError(
                            address, name, f"{_describe_callable(fn)} returned {_a_or_an(type(verdict).__name__)}, "
                            "not a bool (an `async def` or a `yield` in a filter is always true)"
                        )
                    mask.append(bool(verdict))
                except UserFunctionError:
                    raise
                except Exception:
                    raise UserFunctionError(address, name, traceback.format_exc()) from None
            batch.keep(mask)
            return batch

        return apply_filter


@dataclass(frozen=True)
class TokenizeOp(RecordOperator):
    """Tokenizes `record[field]` into `record[output_field]` (int32 numpy array).

    BOS/EOS are given as token strings (looked up in the vocabulary) or None; special tokens'
    strings inside the text are text unless `split_special_tokens` is False. The source field is
    dropped after tokenization unless `keep_field`, so text does not travel further than needed.
    Records whose field is missing, not a string, or blank are skipped with reasons
    `missing_field`, `not_text`, `empty_document`.

    With a `marker` (LLaVA's `<image>`) the text is split at each marker, which is dropped, and
    the offset of each among the ids (BOS counted) is written to `offsets_field` as a
    `MarkerOffsets`, empty for a text without one (`_markers`).

    With a `prompt_field`, that field's text is encoded apart and its ids go between BOS and the
    text's; `loss_mask_field` gets one bool per id, False over BOS and the prompt (`_loss_mask`).
    With `segments`, `field` holds [text, learned] pairs (a chat's turns), joined and encoded as
    one text, each id learned where a character it holds is (`_segment_encoding`); a [text,
    learned, True] triple is a chat template's own text, encoded with the special tokens' strings
    matched.
    """

    tokenizer_id: str
    field: str = "text"
    parallelism: int = 1
    bos: str | None = None
    eos: str | None = None
    output_field: str = "input_ids"
    keep_field: bool = False
    split_special_tokens: bool = SPLIT_SPECIAL_TOKENS
    marker: str | None = None
    offsets_field: str = OFFSETS_FIELD
    prompt_field: str | None = None
    loss_mask_field: str = LOSS_MASK_FIELD
    segments: bool = False
    datasets: tuple[str, ...] | None = None
    name: str = "tokenize"

    @property
    def dataset_scope(self) -> tuple[str, ...] | None:
        return self.datasets

    @property
    def writes_loss_mask(self) -> bool:
        """Whether it writes `loss_mask_field` (with a prompt or segments), for the memory budget."""
        return self.prompt_field is not None or self.segments

    def handle(self) -> TokenizerHandle:
        """The tokenizer this operator encodes with and names in its fingerprint."""
        return self._handle

    @functools.cached_property
    def _handle(self) -> TokenizerHandle:
        """Loaded once (`Pipeline.tokenize` does it) and kept: a tokenizer.json changed on disk
        meanwhile (a loader calls `build` before `fingerprint`) must not make the recipe name another
        tokenizer than the one encoding. A new pipeline reads the new file."""
        return load_tokenizer(self.tokenizer_id, split_special_tokens=self.split_special_tokens)

    @functools.cached_property
    def _template_handle(self) -> TokenizerHandle:
        """The tokenizer of a chat template's own texts (segments flagged as the template's): the
        same one, matching its special tokens' strings. Loaded at the first such text, and refused
        where the file changed since the recipe named the first."""
        if not self.split_special_tokens:
            return self.handle()
        matching = load_tokenizer(self.tokenizer_id, split_special_tokens=False)
        if matching.digest != self.handle().digest:
            raise ConfigurationError(
                f"tokenize: {self.tokenizer_id!r} changed on disk after this pipeline loaded it; "
                "build the pipeline again"
            )
        return matching

    def build(self, on_error: str) -> RecordFn:
        handle = self.handle()
        tokenizer = handle.tokenizer
        bos_id, eos_id = handle.token_id(self.bos), handle.token_id(self.eos)
        prefix = [bos_id] if bos_id is not None else []
        suffix = [eos_id] if eos_id is not None else []
        field_name, out_field = self.field, self.output_field
        # Tokenized into its own field, the source is already replaced: dropping it drops the tokens.
        keep_field = self.keep_field or field_name == out_field
        # Joined segments (`_segment_encoding`) find their learned ids by the characters they hold;
        # other texts need ids alone (`_batch_encoder`).
        joined = self.segments
        marker, offsets_field = self.marker, self.offsets_field
        encode_batch = _batch_encoder(tokenizer, marker, locate=joined)
        shift = len(prefix)

        def template_encoder():  # asked only for a chunk holding a template's text
            return _batch_encoder(self._template_handle.tokenizer, marker, locate=joined)

        prompt_field, loss_mask_field = self.prompt_field, self.loss_mask_field
        # Trained on part of each document: its texts as (text, learned) segments (`_loss_mask`).
        segments_of = (prompt_segments(prompt_field, field_name) if prompt_field is not None
                       else record_segments(field_name) if self.segments else None)

        def tokens_of(encoding) -> tuple[np.ndarray, MarkerOffsets | None, None]:
            # `ids` is a new list at every access, so BOS/EOS go into it in place, and
            # `fromiter` with a count fills the array in one pass: 3.14t, text race corpus,
            # 39-41 -> 31 ns per token against two list concatenations and `np.array`.
            ids = encoding.ids
            ids += suffix
            ids[:0] = prefix
            tokens = np.fromiter(ids, dtype=np.int32, count=len(ids))
            if marker is None:
                return tokens, None, None
            return tokens, MarkerOffsets([at + shift for at in encoding.offsets], marker), None

        def encode(records: list[dict], reasons: list[str | None]) -> list:
            calls = _characters_per_call()
            if segments_of is None:
                return _encode(encode_batch, tokens_of, calls, records, field_name, reasons)
            documents = [segments_of(r) for r, reason in zip(records, reasons) if reason is None]
            runs = functools.partial(_encoded_runs, encode_batch, template_encoder, calls, marker is not None)
            return encode_segments(runs, documents, prefix, suffix, marker, joined)

        def tokenize(batch: ChunkRecords) -> ChunkRecords:
            records = batch.records
            problem = segments_problem if self.segments else _text_problem
            reasons = [problem(record.get(field_name)) for record in records]
            if prompt_field is not None:
                reasons = [reason or _prompt_problem(r.get(prompt_field)) for r, reason in zip(records, reasons)]
            try:
                encoded = encode(records, reasons)
            except TypeError:
                # tokenizers refuses the whole batch (a bare TypeError) for one str without a UTF-8
                # form: a lone surrogate, which a JSON `\ud800` escape makes. Only then is each text
                # checked, so the usual batch pays nothing; such a record is `invalid_utf8`.
                texts = ((lambda r: [r[field_name]]) if segments_of is None
                         else (lambda r: [text for text, *_ in segments_of(r)]))
                reasons = [reason or next(filter(None, map(_unencodable, texts(r))), None)
                           for r, reason in zip(records, reasons)]
                encoded = encode(records, reasons)
            detail = functools.partial(_tokenize_detail, field_name, prompt_field, self.segments)
            if on_error == "raise":
                for reason, address, record in zip(reasons, batch.addresses, records):
                    if reason is not None:
                        raise BadRecordError(address, reason, detail(reason, record))
            batch.skip(reasons, detail)
            for record, (tokens, offsets, mask) in zip(batch.records, encoded):  # the records kept
                record[out_field] = tokens
                if not keep_field:
                    record.pop(field_name, None)
                if offsets is not None:
                    record[offsets_field] = offsets
                if mask is not None:
                    record[loss_mask_field] = mask
                if prompt_field is not None and not self.keep_field:
                    record.pop(prompt_field, None)
            return batch

        return scoped(tokenize, self.datasets)

    def fingerprint(self) -> dict:
        """What decides the ids and what later stages see. `keep_field` only when True: the text it
        leaves may be read by a later map or filter, which then keeps other records (a resume that
        flipped it was accepted); left at its default it adds nothing, so the recipes that never set
        it keep the digests their checkpoints hold; `marker` and `offsets_field` likewise only with
        a marker, `prompt_field` and `loss_mask_field` only with a prompt or segments, `datasets`
        only where it is scoped."""
        return with_scope({
            "op": self.name,
            "tokenizer": self.handle().digest,
            "field": self.field,
            "bos": self.bos,
            "eos": self.eos,
            "output_field": self.output_field,
            "split_special_tokens": self.split_special_tokens,
            **({"keep_field": True} if self.keep_field else {}),
            **({"marker": self.marker, "offsets_field": self.offsets_field} if self.marker is not None else {}),
            **({"prompt_field": self.prompt_field, "loss_mask_field": self.loss_mask_field}
               if self.prompt_field is not None else {}),
            **({"segments": "joined", "loss_mask_field": self.loss_mask_field} if self.segments else {}),
        }, self.datasets)


_CHARACTERS_PER_CALL = 1 << 16
"""With tokenizers' own pool off, the texts of one call to the tokenizer hold at most this many
characters, or are one text (see `_characters_per_call`)."""


def _characters_per_call() -> int | None:
    """How many characters of text one call to the tokenizer encodes (a text longer than that
    alone): `_CHARACTERS_PER_CALL` where tokenizers' own pool is off (Zephon turns it off where
    several workers tokenize: `leave_cores_to_workers`), else a chunk's all (None), a batch the
    pool spreads over the cores. A call's encodings stay alive together, each token with its
    string, offsets and masks (~100 bytes): a chunk of sixteen documents of 400k characters (1.8M
    tokens) grew a worker's peak RSS by 167 MiB encoded at once, 85 MiB one at a time (3.14t),
    in the same time. A call of its own for every text cost ~5 us a call, 1.1-1.5 % more time on
    the race's text chunks (16 documents of 1.6k characters on average), which 64k characters a
    call keeps to one call (alternating runs: within their 1 % noise of one call per chunk).
    Asked at each chunk: the variable is tokenizers' only switch, read at every call."""
    return _CHARACTERS_PER_CALL if tokenizers_pool_is_off() else None


def _encode(encode_batch, tokens_of, per_call: int | None, records: list[dict], field_name: str,
            reasons: list[str | None]) -> list:
    """`tokens_of` each encoding of the records' texts that have no reason to be skipped, in
    order, the texts encoded in consecutive runs of at most `per_call` characters or of one text
    (None: all at once). Each run's encodings are dropped before the next run is encoded, and
    nothing is written into a record until every text is: a TypeError (a text tokenizers
    refuses) leaves the records as they were."""
    texts = [record[field_name] for record, reason in zip(records, reasons) if reason is None]
    return [tokens_of(encoding) for run in _runs(texts, per_call)
            for encoding in encode_batch(run, add_special_tokens=False)]


def _batch_encoder(tokenizer, marker: str | None, locate: bool):
    """The tokenizer's batch encoder `tokenize` calls: where no id is to be found by its
    characters (`locate`), `encode_batch_fast` (tokenizers >= 0.20), which skips the offsets and
    gives the same ids for ~20% less CPU; at a marker, over the pieces between markers of a call's
    texts, in that call."""
    encode = (None if locate else getattr(tokenizer, "encode_batch_fast", None)) or tokenizer.encode_batch
    return encode if marker is None else functools.partial(encode_at_markers, encode, marker, locate=locate)


def _encoded_runs(encode_batch, template_encoder, per_call: int | None, marked: bool, texts: list[str],
                  templates: list[bool], spans: list) -> list[tuple[list[int], list | None, list[int] | None]]:
    """(ids, `learned_ids` of the text's character `spans` where they are given, marker offsets
    where `marked`) of each of `texts`, encoded as `_encode` encodes them, in runs whose encodings
    are dropped before the next is encoded; the texts flagged in `templates` (a chat template's
    own) with `template_encoder()`'s batch encoder, which matches the special tokens' strings,
    and in a call of their own."""
    def encoded(encode, chosen: list[int]) -> list:
        out, wanted = [], iter(spans[k] for k in chosen)
        for run in _runs([texts[k] for k in chosen], per_call):
            for encoding in encode(run, add_special_tokens=False):
                ids, learned = encoding.ids, next(wanted)
                out.append((ids, None if learned is None else learned_ids(encoding, len(ids), learned),
                            encoding.offsets if marked else None))
        return out

    if not any(templates):
        return encoded(encode_batch, range(len(texts)))
    plain = iter(encoded(encode_batch, [k for k, template in enumerate(templates) if not template]))
    theirs = iter(encoded(template_encoder(), [k for k, template in enumerate(templates) if template]))
    return [next(theirs) if template else next(plain) for template in templates]


def _runs(texts: list[str], characters: int | None) -> list[list[str]]:
    """`texts` cut into consecutive runs of at most `characters` characters, a longer text alone."""
    if characters is None or sum(map(len, texts)) <= characters:
        return [texts] if texts else []
    runs, run, held = [], [], 0
    for text in texts:
        if run and held + len(text) > characters:
            runs.append(run)
            run, held = [], 0
        run.append(text)
        held += len(text)
    runs.append(run)
    return runs


def _prompt_problem(value) -> str | None:
    """Why a prompt cannot be tokenized, or None: an empty prompt conditions on nothing, but is one."""
    if value is None:
        return "missing_field"
    return None if isinstance(value, str) else "not_text"


def _tokenize_detail(field_name: str, prompt_field: str | None, segments: bool, reason: str, record: dict) -> str:
    """`_field_detail` of the field a record was refused for: its text's, else its prompt's; for
    segments, what they hold."""
    if segments:
        return segments_detail(field_name, reason, record)
    text = record.get(field_name)
    if prompt_field is None or (_text_problem(text) or _unencodable(text)) == reason:
        return _field_detail(field_name, reason, record)
    return _field_detail(prompt_field, reason, record)


def _field_detail(field_name: str, reason: str, record: dict) -> str:
    """The field a refused record was read at and, where it lacks it, the fields it has; where it
    holds no string, what it holds (a caption stored as a number or a list); where its text cannot
    be tokenized, why (empty, only whitespace, a lone surrogate): the field's name alone left the
    reader of `skipped_examples` to open the shard."""
    if reason == "missing_field":
        return f"field {field_name!r}; {fields_it_has(field_name, record)}"
    if reason == "not_text":
        return f"field {field_name!r} holds {_a_or_an(type(record.get(field_name)).__name__)}, not a string"
    if reason == "empty_document":
        text = record.get(field_name)
        held = f"holds only whitespace ({len(text)} characters)" if text else "is empty"
        return f"field {field_name!r} {held}"
    if reason == "invalid_utf8":
        return f"field {field_name!r} holds a lone surrogate (as a JSON \\ud800 escape makes), which has no UTF-8 form"
    return f"field {field_name!r}"


def _a_or_an(type_name: str) -> str:
    """A type named with its article: a JSON number read as `int` was said to be "a int", and a map
    returning one "returned a int"."""
    return f"{'an' if type_name[:1].lower() in 'aeiou' else 'a'} {type_name}"


def _text_problem(value) -> str | None:
    """Why a field's value cannot be tokenized, or None."""
    if value is None:
        return "missing_field"
    if not isinstance(value, str):
        return "not_text"
    if not value.strip():
        return "empty_document"
    return None


def _unencodable(text: str) -> str | None:
    """`invalid_utf8` for a str that has no UTF-8 form (a lone surrogate), else None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "invalid_utf8"
    return None


def check_parallelism(parallelism: int, op: str) -> int:
    return check_count(parallelism, f"{op}: parallelism")


def check_user_function(fn: Callable, op: str) -> Callable:
    """A `map`/`filter` function must be callable: refused when the pipeline is built, not on
    every record once the workers run it."""
    if not callable(fn):
        raise ConfigurationError(f"{op}: fn must be callable, got {fn!r}")
    return fn
