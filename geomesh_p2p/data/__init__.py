"""Corpus and tokenizer loading (see ``docs/data.md``).

Public API:

* :func:`load_text` — the shipped KJV corpus, a .txt / .txt.xz / .jsonl / .parquet file, or a
  Hugging Face dataset spec ``hf:NAME[:CONFIG][@SPLIT]`` (:func:`parse_hf_spec`).
* :func:`get_tokenizer` — byte-level BPE trained on the corpus (shipped / cached) or a
  user ``tokenizer.json``.
* :class:`TokenDataset` — token ids with a fixed held-out split; deterministic per-peer
  training batches (:meth:`TokenDataset.sample_batch`) and fixed eval batches.
* :func:`load_dataset` — all of the above in one call, with token ids cached on disk.
* :class:`DataError` — a ``ValueError`` with a one-line message naming the bad path.
"""

from geomesh_p2p.data.corpus import DataError, cache_dir_default, load_text
from geomesh_p2p.data.dataset import TokenDataset, batch_seed, load_dataset
from geomesh_p2p.data.hub import HFSpec, is_hf_spec, load_hf_text, parse_hf_spec
from geomesh_p2p.data.tokenizer import (
    EOS_TOKEN,
    encode_corpus,
    get_tokenizer,
    tokenizer_fingerprint,
    tokenizer_key,
    train_tokenizer,
)

__all__ = [
    "DataError",
    "load_text",
    "cache_dir_default",
    "get_tokenizer",
    "train_tokenizer",
    "tokenizer_key",
    "tokenizer_fingerprint",
    "encode_corpus",
    "EOS_TOKEN",
    "TokenDataset",
    "load_dataset",
    "batch_seed",
    "HFSpec",
    "is_hf_spec",
    "parse_hf_spec",
    "load_hf_text",
]
