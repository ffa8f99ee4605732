"""Tokenized corpus with a fixed held-out split and deterministic per-peer batches."""

from __future__ import annotations

import hashlib
import logging
import math
import os
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from tokenizers import Tokenizer

from geomesh_p2p.util.atomic import atomic_write, bounded_write_s
from geomesh_p2p.data.corpus import DataError, cache_dir_default, load_text
from geomesh_p2p.data.format import DataTooShortError
from geomesh_p2p.data.tokenizer import encode_corpus, get_tokenizer, tokenizer_fingerprint
from geomesh_p2p.data.tokens import build_token_file, is_streamed, read_head_text, source_digest

__all__ = ["TokenDataset", "load_dataset", "batch_seed"]

log = logging.getLogger(__name__)


#: A tokenizer trained for a local file learns from at most this many characters of its head (BPE training
#: holds its input in memory; 32 M characters take ~30 s on 2 cores).
TOKENIZER_SAMPLE_CHARS = 32 << 20


def batch_seed(seed: int, peer_id: str, round: int, step: int) -> int:
    """Stable 63-bit seed for one training batch.

    ``blake2b("geomesh-batch-v1\\x1f{seed}\\x1f{peer_id}\\x1f{round}\\x1f{step}", digest_size=8)``
    read little-endian, top bit cleared. Independent of ``PYTHONHASHSEED``, platform and
    process (unlike ``hash()``).
    """
    msg = "\x1f".join(["geomesh-batch-v1", str(int(seed)), str(peer_id), str(int(round)), str(int(step))])
    d = hashlib.blake2b(msg.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(d, "little") & ((1 << 63) - 1)


class TokenDataset:
    """A whole corpus as token ids, split once into train and held-out eval.

    The ids are an in-memory array (the shipped corpus, an ``hf:`` dataset, raw ids) or a read-only memory
    map of an on-disk token file (a local file: :mod:`geomesh_p2p.data.tokens`), kept in their stored dtype
    (int32, uint16 or uint32): batches gather their rows from it, so a memory-mapped corpus costs resident
    memory only for the pages training touches.

    Attributes:
        ids: the whole corpus, 1-D numpy array or ``np.memmap`` ``[N]`` (train then eval).
        n_train / n_eval: tokens in each split (``n_eval = ceil(N x eval_fraction)``, at least 1).
        vocab_size: the tokenizer's vocabulary size including special tokens; every id is
            below it.
        tokenizer: the ``tokenizers.Tokenizer`` used (``None`` if built from raw ids).
        fingerprint: 24 hex chars identifying (tokenizer, token ids, split), for the
            run-config hash: peers with another fingerprint train on other data.
        mapped: whether ``ids`` is a memory map of a token file.
    """

    def __init__(
        self,
        ids: torch.Tensor | np.ndarray,
        vocab_size: int,
        *,
        eval_fraction: float = 0.05,
        tokenizer: Tokenizer | None = None,
        fingerprint: str | None = None,
    ):
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        self.mapped = isinstance(ids, np.memmap)
        arr: np.ndarray
        if isinstance(ids, np.memmap):
            arr = ids.reshape(-1)
        else:
            arr = (ids.numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)).astype(np.int32).reshape(-1)
        n = int(arr.shape[0])
        n_eval = max(1, int(math.ceil(n * eval_fraction)))
        if n - n_eval < 2:
            raise DataError(f"corpus too small: {n} tokens")
        self.ids = arr
        self.n_train, self.n_eval = n - n_eval, n_eval
        self.vocab_size = int(vocab_size)
        self.eval_fraction = float(eval_fraction)
        self.tokenizer = tokenizer
        if fingerprint is None:
            h = hashlib.blake2b(np.asarray(arr, dtype="<i4").tobytes(), digest_size=12)
            h.update(f"|{vocab_size}|{n_eval}".encode())
            fingerprint = h.hexdigest()
        self.fingerprint = fingerprint

    @property
    def train(self) -> torch.Tensor:
        """The train split as an int32 CPU tensor ``[n_train]``: a view of in-memory ids; a copy (all of
        it read into memory) for a memory-mapped corpus, so training code uses :meth:`sample_batch`."""
        return self._tensor(0, self.n_train)

    @property
    def eval(self) -> torch.Tensor:
        """The held-out split as an int32 CPU tensor ``[n_eval]`` (a copy for a memory-mapped corpus)."""
        return self._tensor(self.n_train, self.n_train + self.n_eval)

    def _tensor(self, start: int, end: int) -> torch.Tensor:
        view = self.ids[start:end]
        return torch.from_numpy(view if view.dtype == np.int32 and not self.mapped else view.astype(np.int32))

    def __repr__(self) -> str:
        return (
            f"TokenDataset(train={self.n_train}, eval={self.n_eval}, "
            f"vocab_size={self.vocab_size}, fingerprint={self.fingerprint})"
        )

    def sample_batch(
        self, *, seed: int, peer_id: str, round: int, step: int, batch_size: int, seq_len: int
    ) -> torch.Tensor:
        """One training batch: int64 CPU tensor ``[batch_size, seq_len]`` of token ids.

        Rows are windows of ``seq_len`` consecutive tokens starting at offsets drawn
        uniformly (with replacement) from ``[0, N_train - seq_len]`` by
        ``torch.randint`` on a ``torch.Generator`` seeded with
        :func:`batch_seed` ``(seed, peer_id, round, step)``: the same arguments give the
        same batch in any process; another peer, round or step gives another batch.
        Feed it as ``model(input_ids=x, labels=x)``: Hugging Face causal LMs shift the
        labels internally, so each row gives ``seq_len - 1`` next-token predictions.
        ``seq_len`` must not exceed the model's context (``n_positions``).
        Gradient accumulation should slice this one batch (rows ``i:i+micro``) so the
        data does not depend on the micro-batch size.

        Raises:
            ValueError: ``batch_size < 1``, ``seq_len < 2`` or ``seq_len`` longer than
                the train split.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        n = self.n_train
        if not 2 <= seq_len <= n:
            raise ValueError(f"seq_len must be in [2, {n}], got {seq_len}")
        g = torch.Generator(device="cpu")
        g.manual_seed(batch_seed(seed, peer_id, round, step))
        offs = torch.randint(0, n - seq_len + 1, (batch_size,), generator=g, dtype=torch.int64)
        # Rows gathered window by window: a memory map reads only those pages.
        rows = np.stack([self.ids[o : o + seq_len] for o in offs.tolist()])
        return torch.from_numpy(rows.astype(np.int64))

    def eval_batches(self, seq_len: int, batch_size: int, max_batches: int | None = None) -> Iterator[torch.Tensor]:
        """Fixed held-out batches: int64 CPU tensors ``[b, seq_len]``, ``b <= batch_size``.

        Non-overlapping windows ``eval[k*seq_len:(k+1)*seq_len]`` for k = 0, 1, ... in
        order, grouped ``batch_size`` at a time (the last batch may be smaller), at most
        ``max_batches`` batches. Deterministic: no randomness at all.

        Raises:
            ValueError: the eval split is shorter than ``seq_len``.
        """
        n_win = self.n_eval // seq_len
        if n_win < 1:
            raise ValueError(f"eval split ({self.n_eval} tokens) shorter than seq_len {seq_len}")
        windows = self.ids[self.n_train : self.n_train + n_win * seq_len].reshape(n_win, seq_len)
        count = 0
        for i in range(0, n_win, batch_size):
            if max_batches is not None and count >= max_batches:
                return
            yield torch.from_numpy(windows[i : i + batch_size].astype(np.int64))
            count += 1


def _save_ids(path: Path, ids: np.ndarray) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            np.save(f, ids, allow_pickle=False)

    atomic_write(path, write, timeout_s=bounded_write_s(ids.nbytes))  # a cache: a hung disk is a failed write


def load_dataset(
    data: str | os.PathLike | None,
    seq_len: int,
    vocab_size: int = 4096,
    tokenizer_file: str | os.PathLike | None = None,
    eval_fraction: float = 0.05,
    cache_dir=None,
) -> TokenDataset:
    """Load, tokenize (cached) and split a corpus.

    Args:
        data: a path or ``hf:`` dataset spec accepted by
            :func:`~geomesh_p2p.data.load_text`, or ``None`` for the shipped KJV corpus.
        seq_len: training window length; both splits must hold at least one window.
        vocab_size: BPE vocabulary size when training the tokenizer (ignored with
            ``tokenizer_file``).
        tokenizer_file: optional user ``tokenizer.json``.
        eval_fraction: share of tokens (taken from the end) held out for evaluation.
        cache_dir: cache for tokenizers and token ids (default ``~/.cache/geomesh_p2p``).

    Token ids are cached as ``ids-<key>.npy`` (uint16 when the vocabulary fits, else
    int32; no pickle) under ``cache_dir``, keyed by blake2b of the text and of the
    tokenizer's JSON; a warm start of the shipped corpus takes well under a second.

    A local ``.txt`` / ``.txt.xz`` / ``.xz`` / ``.jsonl`` file is not read into memory: it is tokenized once,
    piece by piece, into an on-disk token file (``tokens-<key>.bin`` plus an index, keyed by the file's
    blake2b and the tokenizer; :mod:`geomesh_p2p.data.tokens`) that batches read through a memory map.
    A tokenizer trained for such a file learns from its first :data:`TOKENIZER_SAMPLE_CHARS` characters
    (all of it when shorter, as before). An unwritable cache falls back to reading the file into memory.

    Raises:
        DataError: unreadable data / tokenizer file, or a split shorter than ``seq_len``.
    """
    cdir = Path(cache_dir).expanduser() if cache_dir is not None else cache_dir_default()
    if isinstance(data, (str, os.PathLike)) and not str(data).startswith("hf:") and is_streamed(data):
        ds = _load_mapped(Path(data).expanduser(), vocab_size, tokenizer_file, eval_fraction, cache_dir, cdir)
        if ds is not None:
            _check_splits(ds, str(data), seq_len)
            return ds
    text = load_text(data)
    tok = get_tokenizer(text, vocab_size=vocab_size, cache_dir=cache_dir, tokenizer_file=tokenizer_file)
    vs = tok.get_vocab_size(with_added_tokens=True)
    tok_fp = tokenizer_fingerprint(tok)
    h = hashlib.blake2b(b"geomesh-ids-v1\0" + tok_fp.encode() + b"\0", digest_size=12)
    h.update(text.encode("utf-8"))
    key = h.hexdigest()
    cached = cdir / f"ids-{key}.npy"
    ids = None
    if cached.is_file():
        try:
            ids = np.load(cached, allow_pickle=False)
        except Exception:
            log.warning("ignoring unreadable token cache %s", cached)
            ids = None
    if ids is None:
        ids = np.asarray(encode_corpus(tok, text), dtype=np.uint16 if vs <= 65535 else np.int32)
        try:
            _save_ids(cached, ids)
        except OSError as e:
            log.warning("cannot cache token ids in %s: %s", cdir, e)
    fp = hashlib.blake2b(f"{key}|{eval_fraction}".encode(), digest_size=12).hexdigest()
    ds = TokenDataset(ids.astype(np.int32), vs, eval_fraction=eval_fraction, tokenizer=tok, fingerprint=fp)
    _check_splits(ds, "shipped KJV corpus" if data is None else str(data), seq_len)
    return ds


def _check_splits(ds: TokenDataset, name: str, seq_len: int) -> None:
    """Raises DataTooShortError naming the data when a split is shorter than ``seq_len``."""
    if ds.n_train < seq_len or ds.n_eval < seq_len:
        raise DataTooShortError(
            f"{name}: too few tokens for seq_len {seq_len} (train {ds.n_train}, eval {ds.n_eval}; each needs "
            f"{seq_len}): use more text or a smaller --seq-len"
        )


def _load_mapped(
    p: Path, vocab_size: int, tokenizer_file, eval_fraction: float, cache_dir, cdir: Path
) -> TokenDataset | None:
    """:func:`load_dataset` of a local file through its token file; None when the cache cannot be written
    (one WARNING; the caller reads the file into memory instead). Raises DataError for a bad file."""
    if not p.exists():
        raise DataError(f"data file not found: {p}")
    if not p.is_file():
        raise DataError(f"data path is not a file: {p}")
    size, b2 = source_digest(p)
    if tokenizer_file is not None:
        tok = get_tokenizer(tokenizer_file=tokenizer_file)
    else:
        tok = _source_tokenizer(p, b2, vocab_size, cache_dir, cdir)
    try:
        tf = build_token_file(p, tok, cdir, size=size, source_b2=b2)
    except OSError as e:
        log.warning("cannot write the token file of %s in %s (%s); reading it into memory instead", p, cdir, e)
        return None
    fp = hashlib.blake2b(f"{tf.key}|{eval_fraction}".encode(), digest_size=12).hexdigest()
    vs = tok.get_vocab_size(with_added_tokens=True)
    return TokenDataset(tf.ids(), vs, eval_fraction=eval_fraction, tokenizer=tok, fingerprint=fp)


def _source_tokenizer(p: Path, source_b2: str, vocab_size: int, cache_dir, cdir: Path) -> Tokenizer:
    """The tokenizer trained for local file ``p``: from the whole text when it is small (the same tokenizer as
    an in-memory load), else its first :data:`TOKENIZER_SAMPLE_CHARS` characters. Cached under the source's
    digest too (``tokenizer-src-<key>.json``), so a restart loads it without reading the text."""
    key = hashlib.blake2b(f"geomesh-bpe-src-v1|{source_b2}|{vocab_size}|{TOKENIZER_SAMPLE_CHARS}".encode())
    by_source = cdir / f"tokenizer-src-{key.hexdigest()[:24]}.json"
    if by_source.is_file():
        try:
            return Tokenizer.from_file(str(by_source))
        except Exception:
            log.warning("ignoring unreadable cached tokenizer %s", by_source)
    sample = read_head_text(p, TOKENIZER_SAMPLE_CHARS)
    if not sample.strip():
        raise DataError(f"data file is empty: {p}")
    tok = get_tokenizer(sample, vocab_size=vocab_size, cache_dir=cache_dir)
    try:
        text = tok.to_str()  # a cache: a hung disk is a failed write
        atomic_write(by_source, lambda tmp: _write_text(tmp, text), timeout_s=bounded_write_s(len(text)))
    except OSError as e:
        log.warning("cannot cache tokenizer in %s: %s", cdir, e)
    return tok


def _write_text(path: str, text: str) -> None:
    Path(path).write_text(text, encoding="utf-8")
