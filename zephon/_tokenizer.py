"""Loading a Hugging Face `tokenizers` tokenizer from a hub id, a directory or a tokenizer.json."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass
from functools import lru_cache

from . import _fork
from ._errors import ConfigurationError, relative_path_note
from ._job_log import config_level
from ._sha256 import sha256

__all__ = ["SPLIT_SPECIAL_TOKENS", "TokenizerHandle", "load_tokenizer", "leave_cores_to_workers", "tokenizers_pool_is_off"]

log = logging.getLogger("zephon")

_PARALLELISM_VARIABLE = "TOKENIZERS_PARALLELISM"

SPLIT_SPECIAL_TOKENS = True
"""The tokenize stage's default, and so `load_tokenizer`'s: a caller that only looks ids up (a
packer's placeholder ids, a pad id) then gets the instance the stage encodes with. Asked for with
the other setting, a tokenizer is parsed a second time: Pixtral's Tekken, another 0.3 s before the
first batch and 33 MiB."""


@dataclass(frozen=True)
class TokenizerHandle:
    """A loaded tokenizer with the facts the recipe depends on.

    `tokenizer` (a `tokenizers.Tokenizer`) is thread-safe for encoding, so one instance is shared
    by every worker thread; worker processes inherit it by fork.
    """

    tokenizer_id: str
    tokenizer: object
    digest: str

    def token_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise ConfigurationError(f"token {token!r} is not in the vocabulary of {self.tokenizer_id!r}")
        return token_id

    def __reduce__(self):
        """Pickled with the split-special-tokens switch, which `tokenizers` leaves out of a
        Tokenizer's own pickle: a pipeline sent to another process (a rank handed rank 0's) encoded
        a special token's string in a text as the control id there and as text here, under the same
        fingerprint."""
        split = self.tokenizer.encode_special_tokens
        return _unpickled_handle, (self.tokenizer_id, self.tokenizer, self.digest, split)


def _unpickled_handle(tokenizer_id: str, tokenizer: object, digest: str, split_special_tokens: bool) -> TokenizerHandle:
    tokenizer.encode_special_tokens = split_special_tokens
    return TokenizerHandle(tokenizer_id, tokenizer, digest)


def load_tokenizer(tokenizer_id: str, *, split_special_tokens: bool = SPLIT_SPECIAL_TOKENS) -> TokenizerHandle:
    """`tokenizer_id` is a path to a tokenizer.json, a directory holding one, or a hub id
    (which needs a reachable or cached hub). With `split_special_tokens` the tokenizer encodes a
    special token's string in a text as ordinary text (one instance per setting: the setting is
    the tokenizer's, and instances are shared).

    A local file is parsed again once it changed: a tokenizer.json rewritten in place, replaced,
    re-linked, or a relative path read from another working directory gives the tokenizer now
    there, with its digest, not the one an earlier call of this process cached under the name."""
    if not isinstance(tokenizer_id, str):
        raise ConfigurationError(f"a tokenizer is named by a str (a path or hub id), got {tokenizer_id!r}")
    # One cache key per setting, whether the caller named it or took the default.
    return _load_tokenizer(tokenizer_id, split_special_tokens, _file_version(tokenizer_id))


def _file_version(tokenizer_id: str) -> tuple[int, int, int, int] | None:
    """What tells this file apart from the one the same name gave before: device, inode, size and
    modification time in ns of the tokenizer.json `tokenizer_id` names (what Python's own bytecode
    cache trusts, size and mtime), or None where no local file is named. A stat, not a digest of
    the bytes: those cost 20 ms for a large vocabulary at every call."""
    path, _ = _tokenizer_json(tokenizer_id)
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


def _tokenizer_json(tokenizer_id: str) -> tuple[str, bool]:
    """The local tokenizer.json `tokenizer_id` would name (inside it, where it is a directory), and
    whether it is a directory."""
    path = os.path.expanduser(tokenizer_id)
    directory = os.path.isdir(path)
    return (os.path.join(path, "tokenizer.json") if directory else path), directory


@lru_cache(maxsize=16)
def _load_tokenizer(tokenizer_id: str, split_special_tokens: bool, version: tuple | None) -> TokenizerHandle:
    """`version` (`_file_version`) is only part of the cache key."""
    from tokenizers import Tokenizer

    path, directory = _tokenizer_json(tokenizer_id)
    if os.path.isfile(path):
        # Read once, parsed and digested from the same bytes: read twice, a file rewritten in
        # between paired one file's tokenizer with another's digest in the recipe. The bytes
        # identify the tokenizer as well as its re-serialisation does, in 20 ms instead of 0.13 s
        # for a 131k-token vocabulary (time to first batch).
        try:
            with open(path, "rb") as file:
                data = file.read()
        except OSError as exc:
            raise ConfigurationError(f"cannot read tokenizer {path!r}: {exc.strerror}") from exc
        try:
            tokenizer = Tokenizer.from_buffer(data)
        except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot parse
            raise ConfigurationError(f"{path!r} is not a tokenizers tokenizer.json: {exc}") from exc
        digest = sha256(data).hexdigest()
    elif _names_a_path(tokenizer_id):
        what = "a directory holding no tokenizer.json" if directory else "no such file or directory"
        raise ConfigurationError(f"cannot load tokenizer {tokenizer_id!r}: {what}{relative_path_note(tokenizer_id)}")
    else:
        try:
            tokenizer = Tokenizer.from_pretrained(tokenizer_id)
        except Exception as exc:  # the hub library raises many types; all mean "not loadable"
            # A local directory without a tokenizer.json is tried as a hub id too (a folder named
            # like the hub id may sit in the working directory), but the message says what it is.
            # A missing one may be a local path mistyped (`tokenizers/gpt2`): say where it was looked for.
            local = "a directory holding no tokenizer.json" if directory else (
                f"not a local tokenizer.json or directory{relative_path_note(tokenizer_id)}"
            )
            # Without a network the hub library retries for ~20 s, logging each try, before this.
            offline = "" if os.environ.get("HF_HUB_OFFLINE") else (
                "; on a machine that cannot reach the hub, give the tokenizer.json's path "
                "(HF_HUB_OFFLINE=1 makes a hub id fail at once instead of after the hub's retries)"
            )
            raise ConfigurationError(
                f"cannot load tokenizer {tokenizer_id!r}: {local}, and the hub could not provide it ({exc}){offline}"
            ) from exc
        digest = sha256(tokenizer.to_str().encode()).hexdigest()
    tokenizer.encode_special_tokens = split_special_tokens
    _encode_whole_documents(tokenizer, tokenizer_id)
    _return_parse_memory()
    return TokenizerHandle(tokenizer_id, tokenizer, digest)


def _encode_whole_documents(tokenizer, tokenizer_id: str) -> None:
    """Turn off the truncation and padding a tokenizer.json may carry (hub files saved for a
    model's inputs often do, e.g. `max_length` 512 and padding to the batch's longest).

    Left on, `encode_batch` cut every document to that length and padded the shorter documents of
    each chunk with pad ids, read as text by the packer, without a word: documents are to be
    tokenized whole, and rows are cut and padded by the packer alone."""
    if tokenizer.truncation is not None or tokenizer.padding is not None:
        log.log(  # every rank loads the same file: said once per job
            config_level(logging.INFO),
            "tokenizer %r: its own truncation and padding are turned off; the packer cuts and pads rows", tokenizer_id,
        )
        tokenizer.no_truncation()
        tokenizer.no_padding()


def _names_a_path(tokenizer_id: str) -> bool:
    """Whether `tokenizer_id` can only be a local path: a file name ending in .json (in any case:
    `tok.JSON` is a file name, never a hub id), or a path absolute, relative to `.` or `~`, or
    deeper than a hub id's `owner/name`. Such a name missing is a typo to report at once, not a hub
    id to look for (offline, the hub's retries take ~20 s before failing)."""
    return (
        tokenizer_id.lower().endswith(".json")
        or tokenizer_id.startswith(("/", ".", "~"))
        or tokenizer_id.count("/") > 1
    )


def _return_parse_memory() -> None:
    """Give the operating system back the heap pages that parsing tokenizer.json freed.

    glibc keeps freed memory inside the heap unless it sits at the very top; parsing a large
    tokenizer.json leaves much of it stranded: loading Pixtral's Tekken (131k tokens, 6 MB of JSON
    as `vlm._assets` writes it) grows a 3.11 process by ~70 MiB, of which `malloc_trim` returns
    ~26 MiB (with merges written as pairs, as `tokenizers` itself writes them: ~145 MiB, ~95 back).
    Elsewhere than glibc there is no such call and nothing to do.
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def leave_cores_to_workers(parallelism: int) -> None:
    """Turn tokenizers' own thread pool off when `parallelism` > 1 Zephon workers tokenize.

    `encode_batch` spreads each batch over a pool as wide as the machine; with several workers
    already busy, the two pools compete for the same cores (race recipe at parallelism 2 on 2 cores:
    text +10 %, VLM +4 % with the pool off). tokenizers offers no switch but the environment
    variable, which it reads (getenv) at every call, and forked workers inherit it. A value the user
    set is left alone.

    Setting a variable while another thread reads the environment is a data race in the C library
    (adding one may move the array getenv walks), and once a tokenize operator is built its
    loader may tokenize at any moment, on any thread: its token estimate encodes at once, its
    workers later. So the variable is decided once per process, by the first tokenize operator
    built, before any of its encoding; later ones never write the environment, and one that would
    have turned the pool off says so once. Every rank decides alike, so both lines are said at INFO
    by the job's rank 0 alone (`config_level`).
    """
    with _pool_decision.lock:
        if _pool_decision.parallelism is None:
            _pool_decision.parallelism = parallelism
            if parallelism > 1 and _PARALLELISM_VARIABLE not in os.environ:
                os.environ[_PARALLELISM_VARIABLE] = "false"
                log.log(config_level(logging.INFO), "tokenize runs on %d workers: %s=false (set it yourself to choose)",
                        parallelism, _PARALLELISM_VARIABLE)
        elif parallelism > 1 and _PARALLELISM_VARIABLE not in os.environ and not _pool_decision.told:
            _pool_decision.told = True
            log.log(
                config_level(logging.INFO),
                "tokenize runs on %d workers with tokenizers' own pool on: %s was left unset by the first "
                "tokenize operator of this process (parallelism %d), and cannot change while tokenizers "
                "may run; set it to false before starting to give the workers the cores",
                parallelism, _PARALLELISM_VARIABLE, _pool_decision.parallelism,
            )


# The values tokenizers reads as "off" (its `parallelism` utilities, lower-cased); anything else is on.
_POOL_OFF_VALUES = frozenset({"", "off", "false", "f", "no", "n", "0"})


def tokenizers_pool_is_off() -> bool:
    """Whether tokenizers' own pool is off now, as tokenizers reads its environment variable."""
    return os.environ.get(_PARALLELISM_VARIABLE, "true").lower() in _POOL_OFF_VALUES


class _PoolDecision:
    """Whether `leave_cores_to_workers` has decided, and for which parallelism; one per process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.parallelism: int | None = None
        self.told = False


_pool_decision = _PoolDecision()


def _renew_pool_decision_lock_in_child() -> None:
    """In a forked child: a new lock for the pool decision, taking none. A fork copies it held when
    another thread of the parent was deciding (building the process's first tokenize operator),
    by a thread the child does not have, and the child's first loader with a tokenize operator
    waited for it for ever. The child keeps the decision and the environment as they were copied:
    forked between deciding and writing the variable, its tokenizers keep their own pool (a
    matter of speed only; the tokens are the same)."""
    _pool_decision.lock = threading.Lock()


_fork.call_in_child(_renew_pool_decision_lock_in_child)
