"""Training text from a Hugging Face ``datasets`` dataset: ``--data hf:NAME[:CONFIG][@SPLIT]``.

Spec grammar (the canonical form, what peers compare, always has every field)::

    hf:NAME[:CONFIG][@SPLIT][?column=COL&max_bytes=N&revision=REV]

* ``NAME``: a hub dataset (``wikitext``, ``Salesforce/wikitext``) or a local directory of
  .jsonl / .json / .csv / .parquet / .txt files (``hf:/data/my-corpus``; anything
  ``datasets.load_dataset`` accepts as its first argument).
* ``CONFIG``: the dataset's configuration (``wikitext-2-raw-v1``); default: none.
* ``SPLIT``: default ``train``.
* ``column``: the string column holding the text; default ``text``.
* ``max_bytes``: how much text to take, in UTF-8 bytes; default 50,000,000.
* ``revision``: a hub branch, tag or commit to pin the data to; default: the dataset's
  default branch (which its owners may change: pin a commit for a long run).

The dataset is read with ``streaming=True`` in its stored order (no shuffling), so only the
rows needed are downloaded. Rows whose column is ``None`` or ``""`` are skipped; the others
are joined with a blank line (as for .jsonl files) and the result is cut to its first
``max_bytes`` bytes (back to a whole UTF-8 character). The same spec and revision give the
same text on every peer.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional
from urllib.parse import parse_qsl, urlencode

from geomesh_p2p.data.format import DOC_SEPARATOR, DataError

__all__ = [
    "HF_PREFIX",
    "DEFAULT_HF_SPLIT",
    "DEFAULT_HF_COLUMN",
    "DEFAULT_HF_MAX_BYTES",
    "HFSpec",
    "is_hf_spec",
    "parse_hf_spec",
    "load_hf_text",
]

HF_PREFIX = "hf:"
DEFAULT_HF_SPLIT = "train"
DEFAULT_HF_COLUMN = "text"
DEFAULT_HF_MAX_BYTES = 50_000_000

_QUERY_KEYS = ("column", "max_bytes", "revision")
_OFFLINE_ERRORS = ("OfflineModeIsEnabled", "LocalEntryNotFoundError")
# requests / httpx / aiohttp network errors, matched by class name (none of them is imported here)
_NETWORK_WORDS = ("ConnectionError", "ConnectError", "Timeout", "NetworkError", "ClientConnector")


@dataclass(frozen=True)
class HFSpec:
    """A parsed ``hf:`` spec. ``str(spec)`` is its canonical form."""

    name: str
    config: Optional[str] = None
    split: str = DEFAULT_HF_SPLIT
    column: str = DEFAULT_HF_COLUMN
    max_bytes: int = DEFAULT_HF_MAX_BYTES
    revision: Optional[str] = None

    def canonical(self) -> str:
        """``hf:NAME[:CONFIG]@SPLIT?column=COL&max_bytes=N[&revision=REV]``: every field, fixed order."""
        q = {"column": self.column, "max_bytes": str(self.max_bytes)}
        if self.revision is not None:
            q["revision"] = self.revision
        cfg = f":{self.config}" if self.config is not None else ""
        return f"{HF_PREFIX}{self.name}{cfg}@{self.split}?{urlencode(q)}"

    __str__ = canonical


def is_hf_spec(data) -> bool:
    """True if ``data`` is a string starting with ``hf:`` (a Hugging Face dataset spec)."""
    return isinstance(data, str) and data.startswith(HF_PREFIX)


def _max_bytes(value, spec: str) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise DataError(f"bad data spec {spec!r}: max_bytes must be an integer, got {value!r}") from None
    if n < 1:
        raise DataError(f"bad data spec {spec!r}: max_bytes must be >= 1, got {n}")
    return n


def parse_hf_spec(spec: str, *, column: Optional[str] = None, max_bytes: Optional[int] = None) -> HFSpec:
    """Parse ``hf:NAME[:CONFIG][@SPLIT][?column=COL&max_bytes=N&revision=REV]``.

    ``column`` / ``max_bytes`` (e.g. from ``--data-column`` / ``--data-max-bytes``) fill in
    what the spec's query leaves out; giving a different value in both is an error.

    Raises:
        DataError: not an ``hf:`` spec, empty name / config / split, an unknown or repeated
            query key, or ``max_bytes`` not a positive integer. The message quotes the spec.
    """
    if not is_hf_spec(spec):
        raise DataError(f"bad data spec {spec!r}: a Hugging Face dataset spec starts with {HF_PREFIX!r}")
    body, _, query = spec[len(HF_PREFIX) :].partition("?")
    opts: dict[str, str] = {}
    if query:
        for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
            if key not in _QUERY_KEYS:
                raise DataError(f"bad data spec {spec!r}: unknown option {key!r} (known: {', '.join(_QUERY_KEYS)})")
            if key in opts:
                raise DataError(f"bad data spec {spec!r}: option {key!r} given twice")
            opts[key] = value
    rest, at, split = body.rpartition("@")
    if not at:
        rest, split = body, DEFAULT_HF_SPLIT
    name, colon, config = rest.partition(":")
    if not name:
        raise DataError(f"bad data spec {spec!r}: no dataset name (expected hf:NAME[:CONFIG][@SPLIT])")
    if colon and not config:
        raise DataError(f"bad data spec {spec!r}: empty config after ':'")
    if not split:
        raise DataError(f"bad data spec {spec!r}: empty split after '@'")
    if re.search(r"\s", name + config + split):
        raise DataError(f"bad data spec {spec!r}: whitespace in name, config or split")

    col = opts.get("column")
    if col is not None and column is not None and col != column:
        raise DataError(f"bad data spec {spec!r}: column={col!r} in the spec but {column!r} given separately")
    col = col if col is not None else (column if column is not None else DEFAULT_HF_COLUMN)
    if not col:
        raise DataError(f"bad data spec {spec!r}: empty column name")
    mb = _max_bytes(opts["max_bytes"], spec) if "max_bytes" in opts else None
    if max_bytes is not None:
        given = _max_bytes(max_bytes, spec)
        if mb is not None and mb != given:
            raise DataError(f"bad data spec {spec!r}: max_bytes={mb} in the spec but {given} given separately")
        mb = given
    rev = opts.get("revision")
    if rev == "":
        raise DataError(f"bad data spec {spec!r}: empty revision")
    return HFSpec(
        name=name,
        config=config or None,
        split=split,
        column=col,
        max_bytes=mb if mb is not None else DEFAULT_HF_MAX_BYTES,
        revision=rev,
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    return line if len(line) <= 300 else line[:297] + "..."


def _offline_mode() -> bool:
    return any(
        os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
        for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def _load_error(spec: HFSpec, e: Exception) -> DataError:
    """A one-line DataError naming the spec for an exception raised by ``datasets``."""
    names = {c.__name__ for c in type(e).__mro__}
    detail = _first_line(e)
    if (
        names & set(_OFFLINE_ERRORS)
        or isinstance(e, (ConnectionError, TimeoutError))
        or any(w in n for n in names for w in _NETWORK_WORDS)
    ):
        why = (
            "offline mode is on (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)"
            if _offline_mode()
            else "this machine cannot reach the Hugging Face hub (offline?)"
        )
        return DataError(
            f"data {spec}: {why}: {detail}; download the data where the hub is "
            "reachable and pass a local file (--data FILE.jsonl / .parquet / .txt) "
            "or directory (--data hf:/path/to/dir)"
        )
    if "DatasetNotFoundError" in names or isinstance(e, FileNotFoundError):
        return DataError(
            f"data {spec}: dataset not found ({detail}); check the name, or log in "
            "(`hf auth login`) for a gated or private dataset"
        )
    return DataError(f"data {spec}: cannot load ({type(e).__name__}: {detail})")


def load_hf_text(spec: str | HFSpec) -> str:
    """The text of an ``hf:`` spec (see the module docstring): at most ``max_bytes`` UTF-8 bytes.

    Raises:
        DataError: a bad spec, ``datasets`` not installed, the hub unreachable (or offline
            mode on), the dataset / config / split not found, the column absent or not a
            string column, or no text at all. One line, naming the spec.
    """
    s = spec if isinstance(spec, HFSpec) else parse_hf_spec(spec)
    try:
        import datasets  # optional at import time: only hf: specs need it
    except ImportError:
        raise DataError(
            f"data {s}: reading a Hugging Face dataset needs the 'datasets' package (pip install datasets)"
        ) from None
    kwargs = {"split": s.split, "streaming": True}
    if s.revision is not None:
        kwargs["revision"] = s.revision
    args = (s.name,) if s.config is None else (s.name, s.config)
    sep = DOC_SEPARATOR.encode("utf-8")
    parts: list[bytes] = []
    total = 0
    try:
        ds = datasets.load_dataset(*args, **kwargs)
        cols = getattr(ds, "column_names", None)
        if cols is not None and s.column not in cols:
            raise DataError(
                f"data {s}: no column {s.column!r} (columns: {', '.join(map(str, cols))}); "
                "choose one with --data-column"
            )
        for i, row in enumerate(ds):
            if s.column not in row:
                raise DataError(
                    f"data {s}: row {i} has no column {s.column!r} "
                    f"(columns: {', '.join(map(str, row))}); choose one with --data-column"
                )
            value = row[s.column]
            if value is None or value == "":
                continue
            if not isinstance(value, str):
                raise DataError(f"data {s}: column {s.column!r} is not text (row {i} holds a {type(value).__name__})")
            b = value.encode("utf-8")
            total += len(b) + (len(sep) if parts else 0)
            parts.append(b)
            if total >= s.max_bytes:
                break
    except DataError:
        raise
    except Exception as e:  # datasets / huggingface_hub / fsspec raise many types
        raise _load_error(s, e) from None
    text = sep.join(parts)[: s.max_bytes].decode("utf-8", errors="ignore")
    if not text.strip():
        raise DataError(f"data {s}: no text in column {s.column!r}")
    return text
