"""Byte-level BPE tokenizer: training, caching and fast whole-corpus encoding.

The tokenizer is a GPT-2-style byte-level BPE (``tokenizers`` library: ``models.BPE``,
``pre_tokenizers.ByteLevel(add_prefix_space=False)``, ``decoders.ByteLevel``) trained
on the corpus itself with ``BpeTrainer(min_frequency=2)``; id 0 is the special token
``<|endoftext|>``. Training is deterministic (same text and vocab size give the same
``tokenizer.json``, checked in the tests).

Lookup order for a (text, vocab_size) pair, keyed by :func:`tokenizer_key`:
1. ``geomesh_p2p/data/tokenizer-<key>.json`` shipped with the package (the KJV corpus at
   vocab 4096 is shipped, so every peer uses byte-identical merges whatever its
   ``tokenizers`` version and nobody trains at start-up);
2. ``<cache_dir>/tokenizer-<key>.json``;
3. train (about 4 s for the 4.1 MB KJV text on 2 CPU cores) and write to 2. atomically.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from geomesh_p2p.util.atomic import atomic_write, bounded_write_s
from geomesh_p2p.data.corpus import DataError, cache_dir_default, load_text

__all__ = ["get_tokenizer", "tokenizer_key", "tokenizer_fingerprint", "encode_corpus", "EOS_TOKEN"]

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
_FORMAT = b"geomesh-bpe-v1"


def tokenizer_key(text: str, vocab_size: int) -> str:
    """Cache key of the tokenizer trained on ``text`` at ``vocab_size``: 24 hex chars of blake2b."""
    h = hashlib.blake2b(_FORMAT + b"\0" + str(int(vocab_size)).encode() + b"\0")
    h.update(text.encode("utf-8"))
    return h.hexdigest()[:24]


def tokenizer_fingerprint(tok: Tokenizer) -> str:
    """24 hex chars of blake2b over the tokenizer's canonical JSON (for run-config hashes)."""
    return hashlib.blake2b(tok.to_str().encode("utf-8")).hexdigest()[:24]


def _atomic_write_text(path: Path, data: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(data)

    atomic_write(path, write, timeout_s=bounded_write_s(len(data)))  # a cache: a hung disk is a failed write


def train_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE on ``text`` (no caching). Deterministic."""
    if vocab_size < 257:
        raise ValueError(f"vocab_size must be at least 257 (256 bytes + {EOS_TOKEN}), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOS_TOKEN],
    )
    lines = text.splitlines(keepends=True)
    step = 2000
    tok.train_from_iterator(
        ("".join(lines[i : i + step]) for i in range(0, len(lines), step)),
        trainer,
        length=(len(lines) + step - 1) // step,
    )
    return tok


def get_tokenizer(
    text: str | None = None, vocab_size: int = 4096, cache_dir=None, tokenizer_file: str | os.PathLike | None = None
) -> Tokenizer:
    """Return the tokenizer for a corpus.

    Args:
        text: the corpus (``None`` = the shipped KJV corpus).
        vocab_size: target BPE vocabulary size (the result may be a little smaller when
            the corpus has too few frequent pairs).
        cache_dir: where trained tokenizers are cached (default
            :func:`~geomesh_p2p.data.corpus.cache_dir_default`). An unwritable cache
            only costs a retrain next time.
        tokenizer_file: a user ``tokenizer.json`` (HF ``tokenizers`` format) to load
            instead of training; ``text`` and ``vocab_size`` are then ignored.

    Raises:
        DataError: ``tokenizer_file`` is missing or not a valid tokenizer.json.
    """
    if tokenizer_file is not None:
        p = Path(tokenizer_file).expanduser()
        if not p.is_file():
            raise DataError(f"tokenizer file not found: {p}")
        try:
            return Tokenizer.from_file(str(p))
        except Exception as e:
            raise DataError(f"cannot load tokenizer file {p}: {str(e).splitlines()[0]}") from None
    if text is None:
        text = load_text(None)
    key = tokenizer_key(text, vocab_size)
    name = f"tokenizer-{key}.json"
    shipped = resources.files(__package__).joinpath(name)
    if shipped.is_file():
        return Tokenizer.from_str(shipped.read_text(encoding="utf-8"))
    cdir = Path(cache_dir).expanduser() if cache_dir is not None else cache_dir_default()
    cached = cdir / name
    if cached.is_file():
        try:
            return Tokenizer.from_file(str(cached))
        except Exception:
            log.warning("ignoring unreadable cached tokenizer %s", cached)
    tok = train_tokenizer(text, vocab_size)
    try:
        _atomic_write_text(cached, tok.to_str())
    except OSError as e:
        log.warning("cannot cache tokenizer in %s: %s", cdir, e)
    return tok


# --- fast encoding --------------------------------------------------------------------

# GPT-2's pre-tokenization pattern restricted to ASCII (\p{L} -> [A-Za-z], \p{N} -> [0-9],
# \s -> [ \t\n\r\f\v]); for ASCII text it splits exactly as the ByteLevel pre-tokenizer.
_GPT2_ASCII = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""", re.ASCII)


def _bytes_to_unicode() -> dict[int, str]:
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_ASCII_TABLE = {b: c for b, c in _bytes_to_unicode().items() if b < 128}
_TRANSLATE = str.maketrans({chr(b): c for b, c in _ASCII_TABLE.items()})


def _is_plain_byte_level_bpe(tok: Tokenizer) -> bool:
    try:
        d = json.loads(tok.to_str())
    except Exception:
        return False
    pre = d.get("pre_tokenizer") or {}
    model = d.get("model") or {}
    return (
        d.get("normalizer") is None
        and d.get("post_processor") is None
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space", False)
        and model.get("type") == "BPE"
        and model.get("dropout") is None
        and not model.get("ignore_merges", False)
    )


def encode_corpus(tok: Tokenizer, text: str) -> list[int]:
    """Token ids of a whole corpus, equal to ``tok.encode(text).ids``.

    ``tokenizers``' own pre-tokenizer needs ~6 s for the 4.1 MB KJV text on this class
    of CPU; for ASCII text and a plain byte-level BPE (the ones this module trains) the
    same split is done with Python's ``re`` and each distinct word is run through the
    BPE model once (~1.5 s); the tests check that this equals ``tok.encode``.
    Anything else (non-ASCII text, user tokenizers) falls back to ``tok.encode_batch``
    over chunks of 500 lines, which can differ from one whole-text ``encode`` only in
    how a run of whitespace that spans a chunk boundary is split.
    """
    specials = [t.content for t in tok.get_added_tokens_decoder().values()]
    if text.isascii() and _is_plain_byte_level_bpe(tok) and not any(s in text for s in specials):
        model = tok.model
        memo: dict[str, list[int]] = {}
        out: list[int] = []
        for piece in _GPT2_ASCII.findall(text):
            ids = memo.get(piece)
            if ids is None:
                ids = [t.id for t in model.tokenize(piece.translate(_TRANSLATE))]
                memo[piece] = ids
            out.extend(ids)
        return out
    lines = text.splitlines(keepends=True)
    step = 500
    chunks = ["".join(lines[i : i + step]) for i in range(0, len(lines), step)]
    out = []
    for enc in tok.encode_batch(chunks, add_special_tokens=False):
        out.extend(enc.ids)
    return out
