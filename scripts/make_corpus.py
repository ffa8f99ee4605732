#!/usr/bin/env python3
"""Build the shipped training corpus ``geomesh_p2p/data/kjv.txt.xz``.

Source: the King James Version of the Bible as Debian packages it.

* ``bible-kjv-text`` (Debian bookworm, version 4.38) ships the text in the
  "Bible Retrieval System" compressed format (``/usr/lib/bible.data``, magic
  ``EC02``), not as plain text.
* ``bible-kjv`` (same source package, same version) ships ``/usr/bin/bible``, the
  reader for that format. ``bible -p DIR -l100000 Gen1:1-Rev22:21`` prints the whole
  text, one verse per line, with chapter headers ("Genesis 1") and verse numbers.

This script downloads both ``.deb`` files with ``apt-get download`` (or takes them
from ``--deb-dir``), unpacks them with ``dpkg -x`` into a temporary directory, runs the
reader on the whole range and strips every verse reference: chapter header lines are
dropped and the leading verse numbers removed. The result is plain ASCII text, one
verse per line, with one blank line between chapters (no book names, no chapter or
verse numbers). It is then compressed with ``lzma`` (xz container, preset 9|extreme),
which is deterministic for a given input.

Usage::

    python scripts/make_corpus.py                 # downloads the two .debs (needs apt)
    python scripts/make_corpus.py --deb-dir DIR   # uses DIR/bible-kjv-text_*.deb, DIR/bible-kjv_*.deb
    python scripts/make_corpus.py --raw dump.txt  # uses an existing `bible ... Gen1:1-Rev22:21` dump

It also trains the default byte-level BPE tokenizer (vocab 4096) on the result and
writes it next to the corpus as ``tokenizer-<key>.json`` (see
``geomesh_p2p/data/tokenizer.py``), so peers never train it at start-up and all use
byte-identical merges.

Checks done before writing: 66 books, 1189 chapters, 31102 verses, no digit left in
the text. Prints the SHA-256 of the plain text (recorded in docs/data.md).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import lzma
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "geomesh_p2p" / "data" / "kjv.txt.xz"
PACKAGES = ("bible-kjv-text", "bible-kjv")
EXPECTED = {"books": 66, "chapters": 1189, "verses": 31102}

_VERSE = re.compile(r"^ +(\d+) (.*)$")
_HEADER = re.compile(r"^((?:[1-3] )?[A-Za-z][A-Za-z ]*?) (\d+)$")


def _debs(deb_dir: str | None, tmp: Path) -> list[Path]:
    if deb_dir is None:
        subprocess.run(["apt-get", "download", *PACKAGES], cwd=tmp, check=True)
        deb_dir = str(tmp)
    out = []
    for name in PACKAGES:
        hits = sorted(glob.glob(os.path.join(deb_dir, f"{name}_*.deb")))
        if not hits:
            sys.exit(f"make_corpus: no {name}_*.deb in {deb_dir}")
        out.append(Path(hits[-1]))
    return out


def dump_bible(deb_dir: str | None) -> str:
    """Return the raw reader output for Gen1:1-Rev22:21 (one verse per line)."""
    with tempfile.TemporaryDirectory(prefix="kjv-") as t:
        tmp = Path(t)
        root = tmp / "root"
        for deb in _debs(deb_dir, tmp):
            print(f"make_corpus: unpacking {deb.name}", file=sys.stderr)
            subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
        data_dir = root / "usr" / "lib"
        reader = root / "usr" / "bin" / "bible"
        if not (data_dir / "bible.data").is_file() or not reader.is_file():
            sys.exit("make_corpus: bible.data or the bible reader missing from the .debs")
        res = subprocess.run(
            [str(reader), "-p", str(data_dir), "-l100000", "Gen1:1-Rev22:21"],
            check=True,
            capture_output=True,
        )
        return res.stdout.decode("ascii")


def strip_references(raw: str) -> tuple[str, dict]:
    """Drop chapter headers and verse numbers; one verse a line, blank line between chapters."""
    chapters: list[list[str]] = []
    books: list[str] = []
    for line in raw.splitlines():
        if not line.strip():
            continue
        m = _VERSE.match(line)
        if m:
            if not chapters:
                raise ValueError("verse before the first chapter header")
            chapters[-1].append(m.group(2).strip())
            continue
        h = _HEADER.match(line)
        if h:
            if not books or books[-1] != h.group(1):
                books.append(h.group(1))
            chapters.append([])
            continue
        raise ValueError(f"unexpected line in reader output: {line!r}")
    text = "\n\n".join("\n".join(v) for v in chapters) + "\n"
    stats = {"books": len(books), "chapters": len(chapters), "verses": sum(len(c) for c in chapters)}
    return text, stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--deb-dir", default=None, help="directory holding the two .deb files")
    ap.add_argument("--raw", default=None, help="existing reader dump to use instead of the .debs")
    args = ap.parse_args(argv)

    raw = Path(args.raw).read_text("ascii") if args.raw else dump_bible(args.deb_dir)
    text, stats = strip_references(raw)
    if stats != EXPECTED:
        sys.exit(f"make_corpus: unexpected structure {stats}, expected {EXPECTED}")
    if re.search(r"\d", text):
        sys.exit("make_corpus: digits left in the text (verse references not stripped?)")
    data = text.encode("ascii")
    xz = lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=9 | lzma.PRESET_EXTREME)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(xz)
    os.replace(tmp, out)
    sys.path.insert(0, str(REPO))
    from geomesh_p2p.data.tokenizer import tokenizer_key, train_tokenizer

    tok = train_tokenizer(text, 4096)
    tok_path = out.parent / f"tokenizer-{tokenizer_key(text, 4096)}.json"
    tok_path.write_text(tok.to_str(), encoding="utf-8")
    print(f"make_corpus: tokenizer -> {tok_path}")
    print(
        f"make_corpus: {stats}; {len(data)} bytes plain, sha256 {hashlib.sha256(data).hexdigest()}; "
        f"{len(xz)} bytes xz -> {out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
