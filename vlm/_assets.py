"""Real data for the VLM tests, benchmarks and demo, fetched and prepared at run time and cached.

Nothing here is shipped with the project: the image+caption pairs and the wallpapers are GPL-2
Debian packages, fetched with `apt-get download` (the ordinary client of a package registry) and
unpacked with `dpkg-deb`; the Pixtral "Tekken" tokenizer comes from the `mistral-common` wheel.
Each asset is prepared once into a cache directory and reused, so a second run is instant.

- `pair_shards`: WebDataset `.tar` shards of real (PNG, English caption) pairs from Debian's
  `tuxpaint-stamps-default` (each stamp `X.png` with `X.txt`, whose first line is its caption).
  Where apt cannot fetch it, photographs bundled in the scikit-image / scikit-learn wheels, cut
  into crops with generated captions. `PairShards.source` says which one you got.
- `photographs`: a few large real photographs (Debian `mate-backgrounds`, up to 5640x3172), or the
  wheels' photographs, for decode and resize cost; `photograph_shards` packs them with captions.
- `tekken_tokenizer`: a directory with a `tokenizer.json` equivalent to mistral-common's
  Tekkenizer (vocab 131,072; `<s>`=1, `</s>`=2, `[IMG]`=10, `<pad>`=11, `[IMG_BREAK]`=12,
  `[IMG_END]`=13), converted here with `tokenizers` alone, so neither `transformers` nor
  `mistral-common` is imported.

The cache is `$ZEPHON_CACHE_DIR`, else `$XDG_CACHE_HOME/zephon`, else `~/.cache/zephon`. Every asset
is built in a temporary sibling and renamed into place, under a file lock, so concurrent test
processes neither race nor see half-built assets. Delete a directory to rebuild it.

Thread-safety: the functions are safe to call from several threads and processes at once.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import importlib.util
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "TEKKEN_SPECIAL_TOKENS",
    "PairShards",
    "Photographs",
    "cache_root",
    "debian_package",
    "pair_shards",
    "photograph_shards",
    "photographs",
    "tekken_tokenizer",
]

log = logging.getLogger("zephon.vlm.assets")

TUXPAINT = "tuxpaint-stamps-default"
WALLPAPERS = "mate-backgrounds"
MISTRAL_COMMON = "mistral-common==1.13.1"
TEKKEN_FILE = "tekken_240911.json"

# The control tokens of a Tekken file without a "special_tokens" list (versions up to v7), by id;
# ids 20..999 are fillers named <SPECIAL_id>. Facts of the format, as mistral-common reads it.
TEKKEN_SPECIAL_TOKENS = (
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]",
    "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CONTENT]",
)
_CONVERTER_VERSION = 3  # bump when the conversion changes, so cached tokenizers are rebuilt


# -- the cache ------------------------------------------------------------------------------

def cache_root() -> Path:
    """Where assets are cached (created on first use)."""
    explicit = os.environ.get("ZEPHON_CACHE_DIR")
    if explicit:
        root = Path(explicit)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = Path(base) / "zephon"
    root = root / "vlm"
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """`target` if it exists, else `build(tmp)` then rename tmp to target (under a lock)."""
    if target.exists():
        return target
    with _locked(target):
        if target.exists():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
        tmp.chmod(0o755)
        try:
            build(tmp)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _package_dir(name: str) -> Path | None:
    """Where an installed top-level package lives, without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


# -- Debian packages ------------------------------------------------------------------------

def _apt_download(name: str, into: Path) -> Path | None:
    """The .deb of `name` fetched into `into`, or None (no apt, no network, unknown package)."""
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        return None
    for attempt in range(2):
        try:
            done = subprocess.run(["apt-get", "download", name], cwd=into, capture_output=True, text=True,
                                  timeout=900, check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            log.info("apt-get download %s failed: %s", name, exc)
            return None
        debs = sorted(into.glob(f"{name}_*.deb"))
        if done.returncode == 0 and debs:
            return debs[0]
        log.info("apt-get download %s failed: %s", name, done.stderr.strip()[-300:])
        if attempt or not hasattr(os, "geteuid") or os.geteuid() != 0:
            return None
        # A fresh machine may have no package lists, or stale ones; fetch them once and retry.
        try:
            subprocess.run(["apt-get", "update"], capture_output=True, timeout=900, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
    return None


class _Unavailable(Exception):
    pass


def debian_package(name: str, keep: Callable[[str], bool], *, cache: Path | None = None) -> Path | None:
    """Files of Debian package `name` (those whose path `keep` accepts), unpacked once into the
    cache; the directory mirrors the package's tree and holds `PACKAGE.json` (name, version).
    None when the package cannot be fetched. The .deb itself is not kept."""
    target = (cache or cache_root()) / "debian" / name
    target.parent.mkdir(parents=True, exist_ok=True)

    def build(tmp: Path) -> None:
        scratch = tmp / ".download"
        scratch.mkdir()
        deb = _apt_download(name, scratch)
        if deb is None:
            raise _Unavailable(name)
        _extract_deb(deb, tmp, keep)
        version = deb.name.split("_")[1]
        shutil.rmtree(scratch)
        (tmp / "PACKAGE.json").write_text(json.dumps({"package": name, "version": version}))

    try:
        return _build_once(target, build)
    except _Unavailable:
        return None


def _extract_deb(deb: Path, into: Path, keep: Callable[[str], bool]) -> None:
    """Stream the package's data tar through dpkg-deb and write only the kept regular files."""
    proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE)
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            for member in tar:
                name = member.name.lstrip("./")
                if not member.isfile() or not keep(name) or ".." in Path(name).parts:
                    continue
                out = into / name
                out.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(member) as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    finally:
        proc.stdout.close()
        proc.wait()


def _package_version(root: Path) -> str:
    try:
        return json.loads((root / "PACKAGE.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        return "?"


# -- image + caption pairs ------------------------------------------------------------------

@dataclass(frozen=True)
class PairShards:
    """WebDataset shards of image+caption pairs: `directory/pairs-NNNNN.tar`, each record
    {"__key__", "png" or "jpg": bytes, "txt": caption}. `source` names where they came from."""

    directory: Path
    source: str
    num_pairs: int
    num_shards: int

    @property
    def shards(self) -> list[Path]:
        return sorted(self.directory.glob("pairs-*.tar"))

    def describe(self) -> str:
        return f"{self.num_pairs} image+caption pairs in {self.num_shards} shards from {self.source}"


def _stamps(cache: Path) -> Path | None:
    """The unpacked stamps of tuxpaint-stamps-default (PNG and TXT files only), or None."""
    return debian_package(TUXPAINT, lambda n: n.startswith("usr/share/tuxpaint/stamps/")
                          and n.endswith((".png", ".txt")), cache=cache)


def _tuxpaint_pairs(root: Path) -> tuple[list[tuple[str, str, Path, str]], str]:
    """(key, ext, image file, caption) for every stamp with both X.png and X.txt, by path."""
    stamps = root / "usr/share/tuxpaint/stamps"
    pairs = []
    for png in sorted(stamps.rglob("*.png")):
        txt = png.with_suffix(".txt")
        if not txt.is_file():
            continue
        lines = [line.strip() for line in txt.read_text(encoding="utf-8", errors="replace").splitlines()]
        caption = next((line for line in lines if line), "")
        if caption:
            pairs.append((str(png.relative_to(stamps).with_suffix("")).replace(".", "_"), "png", png, caption))
    return pairs, f"Debian {TUXPAINT} {_package_version(root)} (GPL-2, fetched with apt-get download)"


def _wheel_photos() -> list[Path]:
    """Photographs bundled in the scikit-image and scikit-learn wheels (found without importing)."""
    found = []
    skimage = _package_dir("skimage")
    if skimage is not None:
        found += [p for p in sorted((skimage / "data").glob("*")) if p.suffix in (".png", ".jpg")]
    sklearn = _package_dir("sklearn")
    if sklearn is not None:
        found += sorted((sklearn / "datasets" / "images").glob("*.jpg"))
    return found


def _photo_pairs(count: int) -> tuple[list[tuple[str, str, bytes, str]], str] | None:
    """Crops of the wheels' photographs with generated captions: enough for `count` pairs."""
    from PIL import Image

    photos = []
    for path in _wheel_photos():
        try:
            with Image.open(path) as image:
                if min(image.size) >= 64:
                    photos.append((path, image.size))
        except OSError:
            continue
    if not photos:
        return None
    pairs = []
    for i in range(count):
        path, (width, height) = photos[i % len(photos)]
        round_ = i // len(photos)
        name = path.stem.replace("_", " ")
        with Image.open(path) as image:
            if round_ == 0:
                crop, what = image.copy(), f"The {name} photograph."
            else:
                frac = 0.4 + 0.1 * (round_ % 5)
                w, h = max(32, int(width * frac)), max(32, int(height * frac))
                x = (round_ * 37) % max(1, width - w + 1)
                y = (round_ * 53) % max(1, height - h + 1)
                crop = image.crop((x, y, x + w, y + h))
                what = f"A crop of the {name} photograph, {w} by {h} pixels from ({x}, {y})."
            buffer = io.BytesIO()
            crop.save(buffer, "PNG")
        pairs.append((f"{i:05d}-{path.stem}", "png", buffer.getvalue(), what))
    return pairs, "scikit-image / scikit-learn wheel photographs, cropped, with generated captions"


def _spread(items: list, limit: int | None) -> list:
    """`limit` items spread evenly over the list (all of them when limit is None or larger)."""
    if limit is None or limit >= len(items):
        return list(items)
    return [items[i * len(items) // limit] for i in range(limit)]


def _write_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(payload), 0, 0o644
            tar.addfile(info, io.BytesIO(payload))


def pair_shards(num_shards: int = 8, limit: int | None = None, *, origin: str = "auto",
                cache: Path | None = None) -> PairShards:
    """Real image+caption pairs as `num_shards` WebDataset shards (pairs dealt round-robin).

    `limit` keeps that many pairs spread evenly over the collection (None: all ~785 stamps).
    `origin`: "tuxpaint" (fail if apt cannot fetch it), "photos" (the wheels' photographs), or
    "auto" (tuxpaint, else photos). Cached per (origin, num_shards, limit).
    """
    if origin not in ("auto", "tuxpaint", "photos"):
        raise ValueError(f"origin must be 'auto', 'tuxpaint' or 'photos', got {origin!r}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be positive, got {num_shards}")
    if limit is not None and limit < 1:  # it would keep no pair, cached under the name of all of them
        raise ValueError(f"limit must be positive or None (all pairs), got {limit}")
    cache = cache or cache_root()
    stamps = None if origin == "photos" else _stamps(cache)
    if stamps is None and origin == "tuxpaint":
        raise RuntimeError(f"cannot fetch Debian package {TUXPAINT} with apt-get download")
    kind = "photos" if stamps is None else "tuxpaint"
    target = cache / "pairs" / f"{kind}-{num_shards}x{limit or 'all'}"
    meta_file = target / "pairs.meta"
    if not meta_file.exists():
        got = _tuxpaint_pairs(stamps) if stamps is not None else _photo_pairs(limit or 96)
        if got is None:
            raise RuntimeError(f"no image+caption pairs: apt cannot fetch {TUXPAINT} and neither "
                               "scikit-image nor scikit-learn is installed")
        pairs, source = got
        chosen = _spread(pairs, limit)

        def build(tmp: Path) -> None:
            for shard in range(num_shards):
                members = []
                for key, ext, image, caption in chosen[shard::num_shards]:
                    data = image.read_bytes() if isinstance(image, Path) else image
                    members += [(f"{key}.{ext}", data), (f"{key}.txt", caption.encode("utf-8"))]
                _write_tar(tmp / f"pairs-{shard:05d}.tar", members)
            (tmp / "pairs.meta").write_text(json.dumps({"source": source, "num_pairs": len(chosen),
                                                        "num_shards": num_shards}))

        _build_once(target, build)
    meta = json.loads(meta_file.read_text())
    return PairShards(target, meta["source"], meta["num_pairs"], meta["num_shards"])


# -- large photographs ----------------------------------------------------------------------

@dataclass(frozen=True)
class Photographs:
    paths: tuple[Path, ...]
    source: str


def photographs(*, origin: str = "auto", cache: Path | None = None) -> Photographs:
    """Large real photographs (JPEG) for decode and resize cost: Debian `mate-backgrounds`
    (16 JPEGs, 1280x1024 up to 5640x3172), else the wheels' photographs."""
    if origin not in ("auto", "debian", "wheels"):
        raise ValueError(f"origin must be 'auto', 'debian' or 'wheels', got {origin!r}")
    if origin != "wheels":
        root = debian_package(WALLPAPERS, lambda n: n.startswith("usr/share/backgrounds/") and n.endswith(".jpg"),
                              cache=cache)
        if root is not None:
            paths = tuple(sorted((root / "usr/share/backgrounds").rglob("*.jpg")))
            return Photographs(paths, f"Debian {WALLPAPERS} {_package_version(root)} (GPL-2+, apt-get download)")
        if origin == "debian":
            raise RuntimeError(f"cannot fetch Debian package {WALLPAPERS} with apt-get download")
    paths = tuple(_wheel_photos())
    if not paths:
        raise RuntimeError("no photographs: apt cannot fetch mate-backgrounds and scikit-image is not installed")
    return Photographs(paths, "scikit-image / scikit-learn wheel photographs")


def photograph_shards(num_shards: int = 4, *, origin: str = "auto", cache: Path | None = None) -> PairShards:
    """`photographs` as WebDataset shards of {jpg, txt} records, the caption made from the file
    name ("A photograph: Two Wings."), for pipelines whose cost is decoding large JPEGs."""
    found = photographs(origin=origin, cache=cache)
    kind = "debian" if found.source.startswith("Debian") else "wheels"
    target = (cache or cache_root()) / "pairs" / f"photographs-{kind}-{num_shards}"

    def build(tmp: Path) -> None:
        chosen = [p for p in found.paths if p.suffix == ".jpg"]
        for shard in range(num_shards):
            members = []
            for path in chosen[shard::num_shards]:
                words = "".join(f" {c}" if c.isupper() and i else c for i, c in enumerate(path.stem))
                caption = f"A photograph: {words.replace('_', ' ').strip()}."
                key = path.stem.replace(".", "_")
                members += [(f"{key}.jpg", path.read_bytes()), (f"{key}.txt", caption.encode())]
            _write_tar(tmp / f"pairs-{shard:05d}.tar", members)
        (tmp / "pairs.meta").write_text(json.dumps({"source": found.source, "num_pairs": len(chosen),
                                                    "num_shards": num_shards}))

    _build_once(target, build)
    meta = json.loads((target / "pairs.meta").read_text())
    return PairShards(target, meta["source"], meta["num_pairs"], meta["num_shards"])


# -- the Pixtral Tekken tokenizer -----------------------------------------------------------

def _tekken_json(cache: Path) -> bytes:
    """The Tekken file from the installed mistral-common, else from its wheel (pip download)."""
    installed = _package_dir("mistral_common")
    if installed is not None and (installed / "data" / TEKKEN_FILE).is_file():
        return (installed / "data" / TEKKEN_FILE).read_bytes()
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    # Under the lock: another process's download in progress is a half-written wheel in `wheels`.
    with _locked(wheels / "mistral_common"):
        if not list(wheels.glob("mistral_common-*.whl")):
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                            "-d", str(wheels), MISTRAL_COMMON], check=True, capture_output=True, timeout=900)
        wheel = max(wheels.glob("mistral_common-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            return archive.read(f"mistral_common/data/{TEKKEN_FILE}")


def _byte_alphabet() -> list[str]:
    """The byte-level alphabet: byte b -> one printable character (printable Latin-1 bytes stand
    for themselves, the 68 others for code points from 256 up, in byte order)."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def _convert_tekken(data: bytes) -> str:
    """A `tokenizers` JSON equivalent to the Tekken file: a byte-level BPE whose merges are
    recovered from the token ranks (a pair merges with the priority of the token it makes, which
    is how a rank-based BPE chooses), the file's split pattern, and the control tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    model = json.loads(data)
    config = model["config"]
    num_special = int(config["default_num_special_tokens"])
    inner = int(config["default_vocab_size"]) - num_special
    if model.get("special_tokens"):
        specials = [t["token_str"] for t in sorted(model["special_tokens"], key=lambda t: t["rank"])]
    else:
        specials = list(TEKKEN_SPECIAL_TOKENS)
    specials += [f"<SPECIAL_{i}>" for i in range(len(specials), num_special)]

    alphabet = _byte_alphabet()
    ranks: dict[bytes, int] = {}
    for entry in model["vocab"][:inner]:
        ranks[base64.b64decode(entry["token_bytes"])] = int(entry["rank"])
    as_text = {token: "".join(alphabet[b] for b in token) for token in ranks}
    vocab = {as_text[token]: rank + num_special for token, rank in ranks.items()}
    clash = [text for text in specials if text in vocab]
    if clash:
        raise ValueError(f"Tekken control tokens {clash} spell ordinary tokens too; cannot convert")
    # Control tokens sit in the BPE vocabulary at their Tekken ids, not as added tokens: text that
    # spells "[IMG]" then stays ordinary text, as in mistral-common (the split pattern never
    # yields a piece that spells a control token, so the BPE cannot produce one either).
    vocab.update({text: i for i, text in enumerate(specials)})

    candidates = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = ranks.get(token[:cut]), ranks.get(token[cut:])
            if left is not None and right is not None:
                candidates.append((rank, left, right, token[:cut], token[cut:]))
    candidates.sort()
    merges = [(as_text[a], as_text[b]) for _, _, _, a, b in candidates]

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(config["pattern"]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    return _merges_as_strings(tokenizer.to_str())


def _merges_as_strings(tokenizer_json: str) -> str:
    """The same tokenizer with each merge written as one "left right" string, not a [left, right] pair.

    `tokenizers` writes pairs (so that tokens may contain spaces) but reads both; the byte-level
    alphabet has no space, so the forms are equivalent, and the string form loads faster: Tekken's
    269k merges, `Tokenizer.from_file` median 0.48 -> 0.35 s on 3.14t (time to first batch).
    """
    spec = json.loads(tokenizer_json)
    merges = spec["model"]["merges"]
    if any(" " in part for pair in merges for part in pair):
        raise ValueError("a Tekken merge contains a space; it cannot be written as one string")
    spec["model"]["merges"] = [" ".join(pair) for pair in merges]
    return json.dumps(spec, ensure_ascii=False, separators=(",", ":"))


def tekken_tokenizer(*, cache: Path | None = None) -> Path:
    """A directory holding `tokenizer.json` for Pixtral's Tekken tokenizer (`tekken_240911.json`
    of mistral-common 1.13.1), converted once with `tokenizers` and cached; pass the directory as
    `tokenize(tokenizer_id=...)`. Needs mistral-common installed, or pip to download its wheel."""
    cache = cache or cache_root()
    data = _tekken_json(cache)
    digest = hashlib.sha256(data + f"|converter={_CONVERTER_VERSION}".encode()).hexdigest()[:16]
    target = cache / "tokenizers" / f"tekken-{digest}"

    def build(tmp: Path) -> None:
        (tmp / "tokenizer.json").write_text(_convert_tekken(data), encoding="utf-8")
        (tmp / "SOURCE.json").write_text(json.dumps({"from": f"{MISTRAL_COMMON} mistral_common/data/{TEKKEN_FILE}",
                                                     "licence": "Apache-2.0"}))

    return _build_once(target, build)
