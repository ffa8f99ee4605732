"""Data of any size in bounded memory: a local text file tokenized once, in pieces, into an on-disk token file
that training reads through a memory map (issue 27; the layout is nanoGPT's ``prepare.py`` ``train.bin``: raw
little-endian ids, no header, plus an index next to it).

Files, under the token cache directory (:func:`~geomesh_p2p.data.corpus.cache_dir_default`)::

    tokens-<key>.bin    n_tokens ids, little-endian uint16 (vocabulary <= 65,536) or uint32
    tokens-<key>.json   the index: format, dtype, n_tokens, the source's size and blake2b, the tokenizer's
                        fingerprint, the .bin's blake2b; written after the .bin, so a .bin without its index
                        is never used

``key`` = blake2b("geomesh-tokens-v1", tokenizer fingerprint, source blake2b): the same file and tokenizer give
the same key on every peer and every start. A start re-hashes the source and the .bin (streamed, ~1-2 s per
GB each) and reuses the token file only when the index matches both; anything else (an edited source, a
damaged or truncated .bin, an unreadable index) tokenizes again.

Pieces are cut at a line end between two non-blank characters: no GPT-2 pre-token spans such a cut (a
pre-token holds a newline only inside a run of whitespace), so the ids equal those of the whole text encoded
at once by :func:`~geomesh_p2p.data.tokenizer.encode_corpus` (tests/unit/test_data_tokens.py checks it). Peak
memory while tokenizing: one piece of text (:data:`PIECE_BYTES`) and its ids, whatever the file's size.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import logging
import lzma
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Optional

import numpy as np
from tokenizers import Tokenizer

from geomesh_p2p.data.format import DOC_SEPARATOR, DataError
from geomesh_p2p.data.tokenizer import encode_corpus, tokenizer_fingerprint
from geomesh_p2p.util.atomic import atomic_write, sweep_stale_writes

__all__ = [
    "PIECE_BYTES",
    "STREAMED_SUFFIXES",
    "TokenFile",
    "source_digest",
    "iter_text",
    "read_head_text",
    "build_token_file",
    "open_token_file",
]

log = logging.getLogger(__name__)

#: Text handed to the tokenizer at once (bytes, about; a piece ends at the next safe cut past it).
PIECE_BYTES = 1 << 20
#: Raw bytes read from the source per read call.
READ_BYTES = 8 << 20
#: File name endings read piece by piece (a .parquet file is read whole, as before).
STREAMED_SUFFIXES = (".txt", ".txt.xz", ".xz", ".jsonl")
_FORMAT = "geomesh-tokens-v1"


@dataclass(frozen=True)
class TokenFile:
    """One tokenized source on disk.

    Attributes:
        bin_path: the ids, raw little-endian ``dtype``.
        dtype: ``"uint16"`` or ``"uint32"``.
        n_tokens: ids in ``bin_path`` (its size is ``n_tokens x itemsize`` bytes).
        key: 24 hex chars (source blake2b, tokenizer fingerprint).
    """

    bin_path: Path
    dtype: str
    n_tokens: int
    key: str

    def ids(self) -> np.ndarray:
        """The ids as a read-only ``np.memmap`` of shape ``[n_tokens]``: pages are read when touched and
        can be dropped by the kernel, so the resident set follows what training reads, not the file."""
        return np.memmap(self.bin_path, dtype=np.dtype(self.dtype).newbyteorder("<"), mode="r", shape=(self.n_tokens,))


def _open_raw(path: Path) -> BinaryIO:
    """The source's decompressed bytes as a binary stream (``.xz``: lzma, streamed)."""
    if path.name.lower().endswith(".xz"):
        return lzma.open(path, "rb")  # type: ignore[return-value]
    return open(path, "rb")


def source_digest(path: Path) -> tuple[int, str]:
    """(size in bytes, 24 hex chars of blake2b) of the file as stored (compressed bytes for ``.xz``), read in
    :data:`READ_BYTES` blocks. Raises DataError naming the path when it cannot be read."""
    h = hashlib.blake2b(_FORMAT.encode() + b"\0source\0", digest_size=12)
    n = 0
    try:
        with open(path, "rb") as f:
            while block := f.read(READ_BYTES):
                h.update(block)
                n += len(block)
    except OSError as e:
        raise DataError(f"cannot read data file {path}: {e.strerror or e}") from None
    return n, h.hexdigest()


def _safe_cut(text: str, end: Optional[int] = None) -> int:
    """Index just past the last line end of ``text[:end]`` that sits between two non-blank characters of
    ``text`` (0: none). Cutting there leaves every GPT-2 pre-token whole."""
    i = len(text) - 1 if end is None else min(end, len(text) - 1)
    while True:
        i = text.rfind("\n", 0, i)
        if i <= 0:
            return 0
        if i + 1 < len(text) and not text[i - 1].isspace() and not text[i + 1].isspace():
            return i + 1
        i -= 1


def _pieces(chunks: Iterator[str], piece_bytes: int) -> Iterator[str]:
    """Regroup ``chunks`` of text into pieces of at most about ``piece_bytes`` characters, each ending at a
    safe cut (:func:`_safe_cut`; a piece grows past ``piece_bytes`` only when it has none); the last piece
    holds the rest."""
    buf = ""
    for chunk in chunks:
        buf += chunk
        while len(buf) >= piece_bytes:
            cut = _safe_cut(buf, piece_bytes) or _safe_cut(buf)
            if cut == 0:  # no safe cut yet (one long line): keep reading
                break
            yield buf[:cut]
            buf = buf[cut:]
    if buf:
        yield buf


def _decoded(path: Path, raw: BinaryIO, progress: Callable[[int], None]) -> Iterator[str]:
    """UTF-8 text of ``raw`` block by block; DataError naming the byte offset of invalid UTF-8."""
    dec = codecs.getincrementaldecoder("utf-8")("strict")
    offset = 0
    while True:
        try:
            block = raw.read(READ_BYTES)
        except (OSError, lzma.LZMAError, EOFError) as e:
            raise DataError(f"{path}: cannot read ({type(e).__name__}: {e})") from None
        pending = len(dec.getstate()[0])  # bytes of a character the last block ended inside of
        try:
            text = dec.decode(block, final=not block)
        except UnicodeDecodeError as e:  # e.start counts from the pending bytes
            raise DataError(f"{path}: not valid UTF-8 text (byte {offset - pending + e.start})") from None
        offset += len(block)
        progress(len(block))
        if text:
            yield text
        if not block:
            return


def _jsonl_docs(path: Path, raw: BinaryIO, progress: Callable[[int], None]) -> Iterator[str]:
    """The ``"text"`` fields of a .jsonl file joined by :data:`DOC_SEPARATOR` (as ``load_text`` joins them)."""
    first = True
    for lineno, line in enumerate(raw, 1):
        progress(len(line))
        s = line.strip()
        if not s:
            continue
        try:
            rec = json.loads(s)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{path}: line {lineno} is not valid JSON ({type(e).__name__})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
            raise DataError(f'{path}: line {lineno} has no string field "text"')
        yield rec["text"] if first else DOC_SEPARATOR + rec["text"]
        first = False


def iter_text(path: Path, progress: Callable[[int], None] = lambda n: None) -> Iterator[str]:
    """The text of a ``.txt`` / ``.txt.xz`` / ``.xz`` / ``.jsonl`` file in blocks, equal when joined to
    :func:`~geomesh_p2p.data.corpus.load_text` of it. ``progress(n)`` is called with each block's raw size.

    Raises:
        DataError: unreadable file, invalid UTF-8 / xz / JSON, a .jsonl line without a string ``"text"``.
    """
    try:
        raw = _open_raw(path)
    except OSError as e:
        raise DataError(f"cannot read data file {path}: {e.strerror or e}") from None
    with raw:
        if path.name.lower().endswith(".jsonl"):
            yield from _jsonl_docs(path, raw, progress)
        else:
            yield from _decoded(path, raw, progress)


def read_head_text(path: Path, max_chars: int) -> str:
    """The first ``max_chars`` characters of the file's text or less, ending at a safe cut when there is
    more (what the tokenizer of a large file is trained on: :func:`build_token_file`)."""
    out: list[str] = []
    n = 0
    for block in iter_text(path):
        out.append(block)
        n += len(block)
        if n > max_chars:
            break
    text = "".join(out)
    if len(text) <= max_chars:
        return text
    head = text[:max_chars]
    return head[: _safe_cut(head) or max_chars]


def _paths(cache_dir: Path, key: str) -> tuple[Path, Path]:
    return cache_dir / f"tokens-{key}.bin", cache_dir / f"tokens-{key}.json"


def token_key(source_b2: str, tok: Tokenizer) -> str:
    """The token file's key: 24 hex chars of blake2b over the format, the tokenizer's fingerprint and the
    source's blake2b."""
    raw = f"{_FORMAT}\0{tokenizer_fingerprint(tok)}\0{source_b2}".encode()
    return hashlib.blake2b(raw, digest_size=12).hexdigest()


def _bin_digest(path: Path) -> str:
    """24 hex chars of blake2b over a token file's bytes, read in :data:`READ_BYTES` blocks (~1 s per GB)."""
    h = hashlib.blake2b(digest_size=12)
    with open(path, "rb") as f:
        while block := f.read(READ_BYTES):
            h.update(block)
    return h.hexdigest()


def open_token_file(cache_dir: Path, key: str, size: int, source_b2: str, dtype: str) -> Optional[TokenFile]:
    """The cached token file of ``key`` when its index is a well-formed one of this format that matches the
    source (``size``, ``source_b2``) and the tokenizer's ``dtype``, and its .bin holds at least one id and
    hashes to the indexed blake2b; None otherwise (one WARNING when an index exists but is unreadable or does
    not match: the file is tokenized again). The .bin's hash is checked at every open: a damaged or edited
    cache would otherwise train other ids under the same run-config fingerprint (red team: an all-zero .bin
    of the right size trained to perplexity 1.16 and matched the honest peers' hash)."""
    bin_path, idx_path = _paths(cache_dir, key)
    if not idx_path.is_file():
        return None
    try:
        idx = json.loads(idx_path.read_text(encoding="utf-8"))
        n = idx["n_tokens"] if isinstance(idx, dict) else None
        ok = (
            isinstance(idx, dict)
            and idx.get("format") == _FORMAT
            and idx.get("source_bytes") == size
            and idx.get("source_blake2b") == source_b2
            and idx.get("dtype") == dtype
            and isinstance(n, int)
            and n > 0
            and bin_path.stat().st_size == n * np.dtype(dtype).itemsize
            and idx.get("bin_blake2b") == _bin_digest(bin_path)
        )
    except Exception as e:  # noqa: BLE001  any damage (bad JSON, nesting, types, I/O): tokenize again
        log.warning("token cache %s unreadable (%s); tokenizing again", idx_path, type(e).__name__)
        return None
    if not ok:
        log.warning("token cache %s does not match its source; tokenizing again", idx_path)
        return None
    return TokenFile(bin_path, dtype, int(n or 0), key)


class _Progress:
    """Progress of a tokenization: a tqdm bar on a terminal, else an INFO line every 10% (or 30 s)."""

    def __init__(self, path: Path, total: int):
        self.path, self.total, self.done = path, total, 0
        self.t0 = self.last = time.monotonic()
        self.next_pct = 10
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm  # optional display, third party (installed with transformers)

            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"tokenizing {path.name}", leave=False)

    def __call__(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
            return
        pct = 100 * self.done // self.total if self.total else 0  # an .xz source: its text size is unknown
        now = time.monotonic()
        if (self.total and pct >= self.next_pct) or now - self.last >= 30:
            self.last = now
            self.next_pct = pct // 10 * 10 + 10
            log.info("tokenizing %s: %d%% of %.1f MB (%.0f s)", self.path.name, pct, self.total / 1e6, now - self.t0)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def build_token_file(
    path: Path, tok: Tokenizer, cache_dir: Path, *, size: int, source_b2: str, piece_bytes: int = PIECE_BYTES
) -> TokenFile:
    """Tokenize ``path`` piece by piece into ``tokens-<key>.bin`` plus its index (or reuse a matching one:
    :func:`open_token_file`). The .bin is written to a temporary file and renamed, then the index; a crash
    leaves no index and the next start tokenizes again. Memory: one piece of text and its ids.

    Raises:
        DataError: the source cannot be read or holds no token; OSError: the cache cannot be written (the
            caller says so; nothing half-written is left under the final names).
    """
    key = token_key(source_b2, tok)
    vs = tok.get_vocab_size(with_added_tokens=True)
    dtype = "uint16" if vs <= 65536 else "uint32"
    found = open_token_file(cache_dir, key, size, source_b2, dtype)
    if found is not None:
        log.info("%s: token file reused (%d tokens, %s)", path.name, found.n_tokens, found.bin_path)
        return found
    np_dtype = np.dtype(dtype).newbyteorder("<")
    bin_path, idx_path = _paths(cache_dir, key)
    progress = _Progress(path, size if not path.name.lower().endswith(".xz") else 0)
    counted = [0]
    bin_hash = hashlib.blake2b(digest_size=12)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as out:
            for piece in _pieces(iter_text(path, progress), piece_bytes):
                raw = np.asarray(encode_corpus(tok, piece), dtype=np_dtype).tobytes()
                out.write(raw)
                bin_hash.update(raw)
                counted[0] += len(raw) // np_dtype.itemsize

    t0 = time.monotonic()
    sweep_stale_writes(cache_dir)  # a token file a killed start left half-written (up to 2-4x the corpus' bytes)
    try:
        atomic_write(bin_path, write)
    finally:
        progress.close()
    n = counted[0]
    if n == 0:
        bin_path.unlink(missing_ok=True)
        raise DataError(f"data file is empty: {path}")
    index = {
        "format": _FORMAT,
        "dtype": dtype,
        "n_tokens": n,
        "source": str(path),
        "source_bytes": size,
        "source_blake2b": source_b2,
        "tokenizer": tokenizer_fingerprint(tok),
        "bin_blake2b": bin_hash.hexdigest(),
    }
    atomic_write(idx_path, lambda tmp: _write_json(tmp, index))
    log.info(
        "tokenized %s: %d tokens (%.1f MB of %s) in %.1f s, cached as %s",
        path.name,
        n,
        n * np_dtype.itemsize / 1e6,
        dtype,
        time.monotonic() - t0,
        bin_path,
    )
    return TokenFile(bin_path, dtype, n, key)


def _write_json(path: str, obj: dict) -> None:
    Path(path).write_text(json.dumps(obj, indent=1), encoding="utf-8")


def is_streamed(path: str | os.PathLike) -> bool:
    """Whether :func:`build_token_file` reads ``path`` (by its name's ending)."""
    return Path(path).name.lower().endswith(STREAMED_SUFFIXES)
