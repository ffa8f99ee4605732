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

from geomesh_p2p.util.atomic import atomic_write
from geomesh_p2p.data.corpus import DataError, cache_dir_default, load_text
from geomesh_p2p.data.tokenizer import encode_corpus, get_tokenizer, tokenizer_fingerprint

__all__ = ["TokenDataset", "load_dataset", "batch_seed"]

log = logging.getLogger(__name__)


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

    Attributes:
        train: int32 CPU tensor ``[N_train]``, the first ``1 - eval_fraction`` of the ids.
        eval: int32 CPU tensor ``[N_eval]``, the last ``eval_fraction`` (default 5%) of
            the ids, contiguous and never sampled for training (train windows end
            inside ``train``).
        vocab_size: the tokenizer's vocabulary size including special tokens; every id is
            below it.
        tokenizer: the ``tokenizers.Tokenizer`` used (``None`` if built from raw ids).
        fingerprint: 24 hex chars identifying (tokenizer, token ids, split), for the
            run-config hash: peers with another fingerprint train on other data.
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
        ids = torch.as_tensor(np.asarray(ids)).to(torch.int32).reshape(-1)
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        n = ids.numel()
        n_eval = max(1, int(math.ceil(n * eval_fraction)))
        if n - n_eval < 2:
            raise DataError(f"corpus too small: {n} tokens")
        self.train = ids[: n - n_eval]
        self.eval = ids[n - n_eval :]
        self.vocab_size = int(vocab_size)
        self.eval_fraction = float(eval_fraction)
        self.tokenizer = tokenizer
        if fingerprint is None:
            h = hashlib.blake2b(ids.numpy().astype("<i4").tobytes(), digest_size=12)
            h.update(f"|{vocab_size}|{n_eval}".encode())
            fingerprint = h.hexdigest()
        self.fingerprint = fingerprint

    def __repr__(self) -> str:
        return (
            f"TokenDataset(train={self.train.numel()}, eval={self.eval.numel()}, "
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
        n = self.train.numel()
        if not 2 <= seq_len <= n:
            raise ValueError(f"seq_len must be in [2, {n}], got {seq_len}")
        g = torch.Generator(device="cpu")
        g.manual_seed(batch_seed(seed, peer_id, round, step))
        offs = torch.randint(0, n - seq_len + 1, (batch_size,), generator=g, dtype=torch.int64)
        idx = offs[:, None] + torch.arange(seq_len, dtype=torch.int64)[None, :]
        return self.train[idx].to(torch.int64)

    def eval_batches(self, seq_len: int, batch_size: int, max_batches: int | None = None) -> Iterator[torch.Tensor]:
        """Fixed held-out batches: int64 CPU tensors ``[b, seq_len]``, ``b <= batch_size``.

        Non-overlapping windows ``eval[k*seq_len:(k+1)*seq_len]`` for k = 0, 1, ... in
        order, grouped ``batch_size`` at a time (the last batch may be smaller), at most
        ``max_batches`` batches. Deterministic: no randomness at all.

        Raises:
            ValueError: the eval split is shorter than ``seq_len``.
        """
        n_win = self.eval.numel() // seq_len
        if n_win < 1:
            raise ValueError(f"eval split ({self.eval.numel()} tokens) shorter than seq_len {seq_len}")
        windows = self.eval[: n_win * seq_len].view(n_win, seq_len)
        count = 0
        for i in range(0, n_win, batch_size):
            if max_batches is not None and count >= max_batches:
                return
            yield windows[i : i + batch_size].to(torch.int64)
            count += 1


def _save_ids(path: Path, ids: np.ndarray) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            np.save(f, ids, allow_pickle=False)

    atomic_write(path, write)


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

    Raises:
        DataError: unreadable data / tokenizer file, or a split shorter than ``seq_len``.
    """
    text = load_text(data)
    tok = get_tokenizer(text, vocab_size=vocab_size, cache_dir=cache_dir, tokenizer_file=tokenizer_file)
    vs = tok.get_vocab_size(with_added_tokens=True)
    tok_fp = tokenizer_fingerprint(tok)
    h = hashlib.blake2b(b"geomesh-ids-v1\0" + tok_fp.encode() + b"\0", digest_size=12)
    h.update(text.encode("utf-8"))
    key = h.hexdigest()
    cdir = Path(cache_dir).expanduser() if cache_dir is not None else cache_dir_default()
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
    name = "shipped KJV corpus" if data is None else str(data)
    if ds.train.numel() < seq_len or ds.eval.numel() < seq_len:
        raise DataError(
            f"{name}: too few tokens for seq_len {seq_len} (train {ds.train.numel()}, eval {ds.eval.numel()})"
        )
    return ds
