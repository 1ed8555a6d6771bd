"""Loading tokenizers: what identifies them in the recipe, and how their own thread pool is set."""

from __future__ import annotations

import os
import shutil

import pytest

from zephon._tokenizer import leave_cores_to_workers, load_tokenizer


def test_digest_is_the_tokenizer_files_content(tmp_path, demo_tokenizer_path):
    copy = tmp_path / "tokenizer.json"
    shutil.copy(demo_tokenizer_path, copy)
    same = load_tokenizer(str(copy))
    assert same.digest == load_tokenizer(str(demo_tokenizer_path)).digest
    changed = tmp_path / "changed" / "tokenizer.json"
    changed.parent.mkdir()
    changed.write_text(copy.read_text().replace('"<|eos|>"', '"<|end|>"'))
    assert load_tokenizer(str(changed.parent)).digest != same.digest


@pytest.mark.parametrize(("parallelism", "before", "after"), [
    (2, None, "false"),
    (1, None, None),
    (4, "true", "true"),
])
def test_tokenizers_pool_is_off_only_when_several_workers_tokenize(monkeypatch, parallelism, before, after):
    if before is None:
        monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    else:
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", before)
    leave_cores_to_workers(parallelism)
    assert os.environ.get("TOKENIZERS_PARALLELISM") == after
