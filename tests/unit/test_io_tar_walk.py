"""`_tar_walk` reads a tar's members as `tarfile` does: the same TarInfo fields, offsets, file
position, errors and end of walk, on plain headers (read by `_tar_walk` itself) and on every
other kind (handed to tarfile); and a WebDataset shard reads to the same records and bad-record
reasons as through tarfile alone."""

from __future__ import annotations

import io
import random
import tarfile

import pytest

from zephon import BadRecordError
from zephon.io import Dataset, _dataset, _tar_walk

BLOCK = tarfile.BLOCKSIZE
FORMATS = {"ustar": tarfile.USTAR_FORMAT, "gnu": tarfile.GNU_FORMAT, "pax": tarfile.PAX_FORMAT}
LONG_DIR = "d" * 60 + "/" + "e" * 60  # over 100 characters: a ustar prefix, a GNU 'L' header, a PAX path


def member(name: str, payload: bytes | None = b"", fmt: int = tarfile.USTAR_FORMAT, kind: bytes = tarfile.REGTYPE,
           target: str = "", **fields) -> bytes:
    """One member as tarfile writes it in `fmt` (with its extension headers), data padded to blocks."""
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mtime = kind, target, 1_700_000_000
    for field, value in fields.items():
        setattr(info, field, value)
    data = payload or b""
    info.size = len(data)
    padding = -len(data) % BLOCK
    return info.tobuf(fmt, "utf-8", "surrogateescape") + data + b"\0" * padding


END = b"\0" * (2 * BLOCK)


def with_checksum(header: bytes | bytearray, signed: bool = False, shape: bytes = b"%06o\0 ") -> bytes:
    """The header with its checksum recomputed over its bytes as they now are, written in `shape`."""
    block = bytearray(header)
    block[148:156] = b" " * 8
    total = sum(b - 256 if signed and b > 127 else b for b in block)
    block[148:156] = (shape % total)[:8].ljust(8, b"\0")
    return bytes(block)


def patched(header: bytes, at: int, field: bytes, *, checksum: bool = True) -> bytes:
    block = bytearray(header[:BLOCK])
    block[at:at + len(field)] = field
    return (with_checksum(block) if checksum else bytes(block)) + header[BLOCK:]


def mixed_members(fmt: int) -> list[bytes]:
    """Every member kind a shard may hold, as tarfile writes them in `fmt`."""
    return [
        member("plain/0001.txt", b"caption", fmt),
        member(f"{LONG_DIR}/0002.txt", b"long name", fmt),
        member("dir", None, fmt, tarfile.DIRTYPE),  # written with a trailing slash
        member(f"{LONG_DIR}/subdir", None, fmt, tarfile.DIRTYPE),
        member("plain/0003.txt", b"", fmt),
        member("plain/0004.bin", bytes(range(256)) * 2, fmt),  # exactly one block
        member("plain/0005.bin", b"\xff" * 1024, fmt),  # exactly two blocks
        member("plain/0006.bin", b"x" * 513, fmt),
        member("plain/0007.jpg", None, fmt, tarfile.LNKTYPE, target="plain/0004.bin"),
        member("plain/0008.jpg", None, fmt, tarfile.SYMTYPE, target="0004.bin"),
        member("café/ü.txt", "été".encode(), fmt),
        member("plain/0009.txt", b"owned", fmt, uid=1000, gid=100, uname="someone", gname="staff", mode=0o600),
        member("plain/0011.txt", b"fields filled", fmt, uname="u" * 32, gname="g" * 32),  # no NUL ends them
        member("plain/0012.jpg", None, fmt, tarfile.SYMTYPE, target="t" * 100),
        member("plain/0010.fifo", None, fmt, tarfile.FIFOTYPE),
    ]


def first_header_of(tar: bytes) -> bytes:
    return tar[:BLOCK]


PLAIN = member("plain/0000.txt", b"before", tarfile.USTAR_FORMAT)
AFTER = member("plain/9999.txt", b"after", tarfile.USTAR_FORMAT)


def odd(header: bytes) -> bytes:
    """A tar of one ordinary member, the odd header, and one member after it."""
    return PLAIN + header + AFTER + END


def sparse_member(name: str) -> bytes:
    """A GNU sparse file (PAX format 1.0) of 10 bytes holding b"abc" at offset 5: its stored data
    is a map block and the data's one block, which tarfile expands."""
    info = tarfile.TarInfo("GNUSparseFile.0/" + name.rpartition("/")[2])
    info.size = 2 * BLOCK
    info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": name,
                        "GNU.sparse.realsize": "10"}
    return info.tobuf(tarfile.PAX_FORMAT) + b"1\n5\n3\n".ljust(BLOCK, b"\0") + b"abc".ljust(BLOCK, b"\0")


REGULAR = member("plain/0005.txt", b"hello", tarfile.USTAR_FORMAT)  # a header and one data block
DIRECTORY = member("plain/sub", None, tarfile.USTAR_FORMAT, tarfile.DIRTYPE)
OLD_DIRECTORY = patched(patched(DIRECTORY, 0, b"old/\0\0\0\0\0\0"), 156, tarfile.AREGTYPE)
WHOLE = b"".join(mixed_members(tarfile.USTAR_FORMAT)) + END

CASES = {
    **{f"{name}-mixed": b"".join(mixed_members(fmt)) + END for name, fmt in FORMATS.items()},
    "directory-without-trailing-slash": odd(patched(DIRECTORY, 0, b"plain/sub\0")),
    "v7-directory-aregtype-with-slash": odd(OLD_DIRECTORY),
    "v7-file-aregtype": odd(patched(REGULAR, 156, tarfile.AREGTYPE)),
    "prefix-with-directory-name-empty": odd(patched(patched(DIRECTORY, 0, b"/" + b"\0" * 99), 345, b"pre/fix\0")),
    "global-pax-header-in-the-middle": PLAIN + tarfile.TarInfo.create_pax_global_header(
        {"uname": "global", "mtime": "5", "comment": "patches every later member"}) + REGULAR + AFTER + END,
    "global-pax-header-renaming": PLAIN + tarfile.TarInfo.create_pax_global_header({"path": "renamed/"}) + AFTER + END,
    "corrupted-checksum": odd(patched(REGULAR, 3, b"X", checksum=False)),
    "signed-checksum": odd(with_checksum(patched(REGULAR, 0, "pläin/0005.txt".encode() + b"\0")[:BLOCK], signed=True)
                           + REGULAR[BLOCK:]),
    "size-not-octal": odd(patched(REGULAR, 124, b"0000000000x\0")),
    "size-with-sign": odd(patched(REGULAR, 124, b"+0000000005\0")),
    "size-with-underscore": odd(patched(REGULAR, 124, b"00000_00005\0")),
    "size-with-0o-prefix": odd(patched(REGULAR, 124, b"0o000000005\0")),
    "size-space-padded": odd(patched(REGULAR, 124, b"         5 \0")),
    "size-filling-its-field": odd(patched(REGULAR, 124, b"000000000005")),
    "size-base-256": odd(patched(REGULAR, 124, b"\x80" + (5).to_bytes(11, "big"))),
    "size-negative-base-256": odd(patched(REGULAR, 124, b"\xff" * 12)),
    "size-empty": odd(patched(REGULAR, 124, b"\0" * 12)),
    "mode-with-tab": odd(patched(REGULAR, 100, b"\t000644\0")),
    "mode-bsdtar-shape": odd(patched(REGULAR, 100, b"000644 \0")),
    "mtime-with-digit-8": odd(patched(REGULAR, 136, b"00000000008\0")),
    "devmajor-spaces": odd(patched(REGULAR, 329, b"      \0\0")),
    "devminor-not-octal": odd(patched(REGULAR, 337, b"zzzzzzz\0")),
    "directory-with-a-size": odd(patched(DIRECTORY, 124, b"00000000005\0") + b"\0" * 5),
    "sparse-pax-1.0": odd(sparse_member("plain/0006.bin")),
    "checksum-7-digits": odd(with_checksum(REGULAR[:BLOCK], shape=b"%07o\0") + REGULAR[BLOCK:]),
    "checksum-space-then-nul": odd(with_checksum(REGULAR[:BLOCK], shape=b"%06o \0") + REGULAR[BLOCK:]),
    "checksum-8-digits": odd(with_checksum(REGULAR[:BLOCK], shape=b"%08o") + REGULAR[BLOCK:]),
    "linkname-on-a-regular-file": odd(patched(REGULAR, 157, b"l" * 100)),
    "type-unknown": odd(patched(REGULAR, 156, b"Z")),
    "type-contiguous": odd(patched(REGULAR, 156, tarfile.CONTTYPE)),
    "name-not-utf-8": odd(patched(REGULAR, 0, b"plain/\xff\xfe.txt\0")),
    "name-without-nul": odd(patched(REGULAR, 0, b"n" * 96 + b".txt")),
    "zero-block-in-the-middle": PLAIN + b"\0" * BLOCK + AFTER + END,
    "no-end-of-archive-blocks": b"".join(mixed_members(tarfile.USTAR_FORMAT)),
    "cut-inside-a-header": WHOLE[:len(PLAIN) + 3 * BLOCK + 200],
    "cut-inside-data": PLAIN + REGULAR[:BLOCK + 3],
    "cut-after-a-header-of-a-member-with-data": PLAIN + REGULAR[:BLOCK],
    "cut-inside-end-of-archive": PLAIN + REGULAR + b"\0" * 700,
    "only-end-of-archive": END,
    "first-member-odd": patched(REGULAR, 124, b"+0000000005\0") + AFTER + END,
}


def walk(data: bytes, fast: bool, encoding: str = "utf-8", errors: str = "surrogateescape") -> list:
    """Every step of a walk: each member's fields, `tar.offset`, the file's position and the members
    kept; then its end (None) or the error raised (at opening or on the way)."""
    steps: list = []
    f = io.BytesIO(data)
    try:
        tar = tarfile.TarFile(fileobj=f, mode="r", encoding=encoding, errors=errors)
        while (info := (_tar_walk.next_member(tar) if fast else tar.next())) is not None:
            fields = {name: getattr(info, name, None) for name in tarfile.TarInfo.__slots__ if name != "tarfile"}
            steps.append((fields, tar.offset, f.tell(), len(tar.members)))
    except Exception as error:  # noqa: BLE001 - the error is part of what must match
        steps.append((type(error).__name__, str(error)))
    else:
        steps.append(None)
    return steps


@pytest.mark.parametrize("encoding, errors", [("utf-8", "surrogateescape"), ("utf-8", "strict"), ("ascii", "strict"),
                                              ("latin-1", "strict")])
@pytest.mark.parametrize("case", list(CASES))
def test_the_walk_gives_tarfiles_members_offsets_and_end(case, encoding, errors):
    fast, through_tarfile = (walk(CASES[case], fast, encoding, errors) for fast in (True, False))
    assert fast == through_tarfile


@pytest.mark.parametrize("tar_format", list(FORMATS))
def test_a_tar_cut_anywhere_walks_as_tarfile_walks_it(tar_format):
    whole = b"".join(mixed_members(FORMATS[tar_format])) + END
    near_blocks = {k * BLOCK + d for k in range(len(whole) // BLOCK) for d in (-1, 0, 1)}
    for cut in sorted({*range(0, len(whole), 97), *near_blocks}):
        assert walk(whole[:cut], fast=True) == walk(whole[:cut], fast=False), cut


NUMBER_FIELDS = ((100, 8), (108, 8), (116, 8), (124, 12), (136, 12), (329, 8), (337, 8))  # all but chksum
CHECKSUM_SHAPES = (b"%06o\0 ", b"%07o\0", b"%06o \0", b"%07o ", b"%08o", b" %06o\0", b"%6o\0 ", b"+%06o\0",
                   b"%06o\0\0", b"%06o\t\0", b"0o%05o\0", b"%05o\0\0\0")


def number_field_value(rng: random.Random, width: int) -> bytes:
    """A number field in one of the shapes writers use or in one near them that `nti` reads
    otherwise or refuses: spaces, digits, a terminator, NUL padding, maybe one byte changed."""
    digits = rng.choice([width - 1, width - 2, width, rng.randrange(width + 1)])
    value = b" " * rng.choice([0, 0, 0, 1, 2]) + bytes(rng.choice(b"01234567") for _ in range(digits))
    value += rng.choice([b"\0", b" ", b" \0", b"\0 ", b"+\0", b"_\0", b"\t", b"", b"8", b"\x1c\0", b"\0x"])
    value = value[:width].ljust(width, b"\0")
    if rng.random() < 0.3:
        at = rng.randrange(width)
        value = value[:at] + bytes([rng.choice(b"0123456789 \0\t+-_xo\x80\xff\x1f")]) + value[at + 1:]
    return value


def test_headers_with_number_fields_of_any_shape_walk_as_tarfile_walks_them():
    """The plain-header path takes exactly the number fields `nti` reads as their digits, and
    leaves every other (read otherwise, or refused) to tarfile."""
    rng = random.Random(41)
    whole = b"".join(mixed_members(tarfile.USTAR_FORMAT)) + END
    headers = [m.offset for m in tarfile.open(fileobj=io.BytesIO(whole)).getmembers()]
    for _ in range(1500):
        data = bytearray(whole)
        at = rng.choice(headers[1:])
        for _ in range(rng.choice([1, 1, 2])):
            start, width = rng.choice(NUMBER_FIELDS)
            data[at + start:at + start + width] = number_field_value(rng, width)
        if rng.random() < 0.9:
            data[at:at + BLOCK] = with_checksum(data[at:at + BLOCK], shape=rng.choice(CHECKSUM_SHAPES))
        assert walk(bytes(data), fast=True) == walk(bytes(data), fast=False), bytes(data[at:at + BLOCK])


@pytest.mark.parametrize("tar_format", list(FORMATS))
def test_plain_headers_are_read_without_tarfiles_parsing(monkeypatch, tar_format):
    """The tests above would pass with every header handed to tarfile: here it reads the first
    (parsed as the TarFile opens), the end, and the members that are no regular file or directory
    or come after an extension header (GNU long names, PAX headers) alone."""
    returned = []
    original = tarfile.TarFile.next
    monkeypatch.setattr(tarfile.TarFile, "next", lambda tar: returned.append(original(tar)) or returned[-1])
    tar = tarfile.TarFile(fileobj=io.BytesIO(b"".join(mixed_members(FORMATS[tar_format])) + END), mode="r")
    walked = []
    while (info := _tar_walk.next_member(tar)) is not None:
        walked.append(info)
    parsed, handed_out, *middle, end = returned  # the first member: parsed at opening, handed out by next()
    assert parsed is handed_out is walked[0] and end is None
    extended = {"ustar": set(), "gnu": {LONG_DIR + "/0002.txt", LONG_DIR + "/subdir", "plain/0012.jpg"},
                "pax": {LONG_DIR + "/0002.txt", LONG_DIR + "/subdir", "café/ü.txt", "plain/0012.jpg"}}[tar_format]
    assert {info.name for info in middle} == extended | {"plain/0007.jpg", "plain/0008.jpg", "plain/0010.fifo",
                                                         "plain/0012.jpg"}
    assert len(walked) == len(mixed_members(FORMATS[tar_format]))


@pytest.mark.parametrize("case", ["ustar-mixed", "gnu-mixed", "pax-mixed", "type-contiguous", "sparse-pax-1.0",
                                  "cut-inside-data"])
def test_payloads_are_extractfiles_bytes_or_its_error(case):
    def payloads(read) -> list:
        out = []
        tar = tarfile.TarFile(fileobj=io.BytesIO(CASES[case]), mode="r")
        try:
            while (info := tar.next()) is not None:
                if info.isreg():
                    out.append(read(tar, info))
        except tarfile.ReadError as error:
            out.append(str(error))
        return out

    assert payloads(_tar_walk.member_payload) == payloads(lambda tar, info: tar.extractfile(info).read())


def record(i: int, fmt: int = tarfile.USTAR_FORMAT, prefix: str = "s") -> bytes:
    """A record of a caption and a JSON member: two headers and two data blocks."""
    return (member(f"{prefix}/{i:04d}.txt", f"caption {i}".encode(), fmt)
            + member(f"{prefix}/{i:04d}.json", b'{"i": %d}' % i, fmt))


def records(numbers, **kwargs) -> bytes:
    return b"".join(record(i, **kwargs) for i in numbers)


RECORD = 4 * BLOCK
PLANNED = records(range(40)) + END


def damaged_shards() -> dict[str, bytes]:
    """PLANNED, damaged: what a shard planned whole may be when it is read."""
    corrupted = bytearray(PLANNED)
    corrupted[30 * RECORD + 5] ^= 1  # a byte of record 30's first name: its checksum no longer matches
    return {
        "corrupted-header": bytes(corrupted),
        "cut-inside-a-header": PLANNED[:25 * RECORD + 100],
        "cut-inside-data": PLANNED[:25 * RECORD + BLOCK + 3],
        "cut-between-members": PLANNED[:25 * RECORD + 2 * BLOCK],
        "cut-between-records": PLANNED[:25 * RECORD],
        "no-end-of-archive-blocks": PLANNED[:-2 * BLOCK],
    }


def shards() -> dict[str, bytes]:
    """WebDataset shards of every kind of header, and damaged ones."""
    out = {f"{name}-long-names": records(range(40), fmt=fmt, prefix=LONG_DIR) + END for name, fmt in FORMATS.items()}
    link = member("s/0003.json", None, kind=tarfile.LNKTYPE, target="s/0002.json")
    out["dirs-links-global-pax"] = (
        member("s", None, kind=tarfile.DIRTYPE) + records(range(3)) + member("s/0003.txt", b"c") + link
        + member("s/.0003.txt", b"hidden") + member("s/0003.__key__", b"k")
        + tarfile.TarInfo.create_pax_global_header({"uname": "global"}) + OLD_DIRECTORY + records(range(4, 40))
        + member("s/0040.txt", b"\xff not utf-8") + member("s/0040.json", b"{}") + member("s/0040.TXT", b"twice")
        + END)
    return {**out, **damaged_shards()}


def outcomes(ds_of, fast: bool) -> list:
    """What planning and reading a shard give, with the plain-header path or through tarfile alone
    (every header through TarFile.next, every payload through extractfile, as before): its count or
    error, each chunk's records and skipped reasons at several chunk sizes, and each record read
    alone with on_error="raise" (so every bad one's detail)."""
    with pytest.MonkeyPatch.context() as patch:
        if not fast:
            patch.setattr(_tar_walk, "next_member", lambda tar: tar.next())
            patch.setattr(_tar_walk, "member_payload", lambda tar, info: tar.extractfile(info).read())
        try:
            ds = ds_of()
        except Exception as error:  # noqa: BLE001 - the error is part of what must match
            return [type(error).__name__, str(error)]
        out: list = [ds.num_records]
        for per_chunk in (1, 7, 16, 100):
            for chunk in ds.chunks(per_chunk):
                read = ds.read_chunk(chunk)
                out.append((read.records, [(address.index, reason) for address, reason in read.skipped]))
        for chunk in ds.chunks(1):
            try:
                out.append(ds.read_chunk(chunk, on_error="raise").records)
            except BadRecordError as error:
                out.append(str(error))
        return out


@pytest.mark.parametrize("shard", list(shards()))
def test_webdataset_reads_the_records_and_reasons_it_read_through_tarfile(tmp_path, shard):
    (tmp_path / "a.tar").write_bytes(shards()[shard])
    plan = lambda: Dataset.from_path("d", str(tmp_path / "a.tar"))  # noqa: E731
    assert outcomes(plan, fast=True) == outcomes(plan, fast=False)


@pytest.mark.parametrize("shard", list(damaged_shards()))
def test_webdataset_damaged_after_planning_reads_as_it_read_through_tarfile(tmp_path, monkeypatch, shard):
    """Planned whole, damaged before reading, on storage that tells no version (a file is known by
    its size, so reading meets the damage)."""
    monkeypatch.setattr(_dataset, "version_of", lambda fs, path: None)
    path = tmp_path / "a.tar"

    def plan_then_damage():
        path.write_bytes(PLANNED)
        ds = Dataset.from_path("d", str(path))
        path.write_bytes(damaged_shards()[shard])
        return ds

    assert outcomes(plan_then_damage, fast=True) == outcomes(plan_then_damage, fast=False)
