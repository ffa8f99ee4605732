"""Reading raw training text: the shipped KJV corpus, a user file or a Hugging Face dataset.

The shipped corpus, ``geomesh_p2p/data/kjv.txt.xz``, is the King James Version of the
Bible from Debian's ``bible-kjv-text`` 4.38 with every verse reference removed (one verse
a line, a blank line between chapters; 4,139,037 bytes of ASCII). It is built by
``scripts/make_corpus.py``; provenance and licence (public domain) are in ``docs/data.md``.
"""

from __future__ import annotations

import json
import lzma
import os
from importlib import resources
from pathlib import Path

from geomesh_p2p.data.format import DOC_SEPARATOR, DataError
from geomesh_p2p.data.hub import load_hf_text

__all__ = ["DataError", "load_text", "SHIPPED_CORPUS", "cache_dir_default", "DATA_SUFFIXES", "check_data_suffix"]

#: File name of the shipped corpus inside the ``geomesh_p2p.data`` package.
SHIPPED_CORPUS = "kjv.txt.xz"


#: file name endings :func:`load_text` reads (lower case)
DATA_SUFFIXES = (".txt", ".txt.xz", ".xz", ".jsonl", ".parquet")


def check_data_suffix(path: str | os.PathLike) -> None:
    """Refuse a data file whose name has no reader here, before anything is loaded (the peer checks it
    at start, before its proof of work and DHT join).

    Raises:
        DataError: the suffix is none of :data:`DATA_SUFFIXES`; the message names the path and the kinds.
    """
    if not Path(path).name.lower().endswith(DATA_SUFFIXES):
        raise DataError(
            f'unsupported data file type: {path} (use .txt, .txt.xz, .jsonl with field "text", or .parquet)'
        )


def cache_dir_default() -> Path:
    """Where tokenizers and token ids are cached.

    ``$GEOMESH_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/geomesh_p2p``, else
    ``~/.cache/geomesh_p2p``. The directory is not created here.
    """
    env = os.environ.get("GEOMESH_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "geomesh_p2p"


def _shipped_bytes() -> bytes:
    return resources.files(__package__).joinpath(SHIPPED_CORPUS).read_bytes()


def _read_jsonl(p: Path) -> str:
    docs = []
    with open(p, "r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{p}: line {lineno} is not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                raise DataError(f'{p}: line {lineno} has no string field "text"')
            docs.append(rec["text"])
    return DOC_SEPARATOR.join(docs)


def _read_parquet(p: Path) -> str:
    try:
        import pyarrow.parquet as pq  # optional dependency
    except ImportError:
        raise DataError(f"{p}: reading .parquet needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.read_table(p, columns=["text"])
    except Exception as e:  # pyarrow raises several types (ArrowInvalid, KeyError, ...)
        raise DataError(
            f'{p}: cannot read column "text" from parquet ({type(e).__name__}: '
            f"{str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    return DOC_SEPARATOR.join(str(x) for x in table.column("text").to_pylist() if x is not None)


def load_text(path: str | os.PathLike | None = None) -> str:
    """Return a corpus as one ``str``.

    Args:
        path: ``None`` for the shipped KJV corpus; a Hugging Face dataset spec
            ``hf:NAME[:CONFIG][@SPLIT][?column=COL&max_bytes=N&revision=REV]`` (a string;
            see :mod:`geomesh_p2p.data.hub`); otherwise a file ending in
            ``.txt`` (UTF-8), ``.txt.xz`` / ``.xz`` (lzma-compressed UTF-8), ``.jsonl``
            (one JSON object a line, field ``"text"``; documents joined with a blank
            line) or ``.parquet`` (column ``"text"``, read with pyarrow if installed).
            A file whose name starts with ``hf:`` needs a directory in front (``./hf:x.txt``).

    Raises:
        DataError: the path does not exist, is not a readable file, is not valid UTF-8,
            has an unsupported suffix, lacks the ``text`` field/column, or is empty; for an
            ``hf:`` spec, see :func:`geomesh_p2p.data.hub.load_hf_text`.
    """
    if path is None:
        return lzma.decompress(_shipped_bytes()).decode("ascii")
    if isinstance(path, str) and path.startswith("hf:"):
        return load_hf_text(path)
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"data file not found: {p}")
    if not p.is_file():
        raise DataError(f"data path is not a file: {p}")
    name = p.name.lower()
    try:
        if name.endswith(".jsonl"):
            text = _read_jsonl(p)
        elif name.endswith(".parquet"):
            text = _read_parquet(p)
        elif name.endswith(".xz"):
            text = lzma.decompress(p.read_bytes()).decode("utf-8")
        elif name.endswith(".txt"):
            text = p.read_text(encoding="utf-8")
        else:
            check_data_suffix(p)  # raises: no reader for this suffix
    except DataError:
        raise
    except UnicodeDecodeError as e:
        raise DataError(f"{p}: not valid UTF-8 text (byte {e.start})") from None
    except lzma.LZMAError as e:
        raise DataError(f"{p}: not a valid xz/lzma file ({e})") from None
    except OSError as e:
        raise DataError(f"cannot read data file {p}: {e.strerror or e}") from None
    if not text.strip():
        raise DataError(f"data file is empty: {p}")
    return text
