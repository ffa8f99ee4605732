"""Data of any size (issue 27): a local file tokenized once, in pieces, into a memory-mapped token file."""

from __future__ import annotations

import json
import logging
import lzma
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import geomesh_p2p.data.tokens as tokens
from geomesh_p2p.data import DataError, encode_corpus, get_tokenizer, load_dataset, load_text
from geomesh_p2p.data.tokens import _pieces, _safe_cut, build_token_file, source_digest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer(None)  # the shipped KJV tokenizer: nothing is trained


def _text(n_lines: int, seed: int = 0) -> str:
    """ASCII text with the cases a cut could break: blank lines, indented lines, runs of spaces, digits."""
    rng = np.random.default_rng(seed)
    words = ["the", "Lord", "said", "unto", "him,", "42", "and", "  spaces", "end.", "x" * 30, "'s", "it's"]
    out = []
    for i in range(n_lines):
        line = " ".join(rng.choice(words, size=int(rng.integers(1, 12))))
        out.append(("   " if i % 7 == 0 else "") + line + ("  " if i % 11 == 0 else ""))
        if i % 5 == 0:
            out.append("")
    return "\n".join(out) + "\n"


def test_a_safe_cut_is_a_line_end_between_two_non_blank_characters():
    assert _safe_cut("a\nb\n\nc") == 2  # "a\n|b": the later "\n\nc" is a run of whitespace
    assert _safe_cut("a\n\nb") == 0 and _safe_cut("abc") == 0 and _safe_cut("a \nb") == 0
    pieces = list(_pieces(iter(["ab\ncd\nef", "\ngh\n"]), 4))
    assert pieces == ["ab\n", "cd\n", "ef\n", "gh\n"]


@pytest.mark.parametrize("suffix", [".txt", ".txt.xz", ".jsonl"])
def test_token_file_ids_equal_the_whole_text_encoded_at_once(tmp_path, tok, monkeypatch, suffix):
    text = _text(3000)
    p = tmp_path / f"corpus{suffix}"
    if suffix == ".txt":
        p.write_text(text)
    elif suffix == ".txt.xz":
        p.write_bytes(lzma.compress(text.encode()))
    else:
        docs = text.split("\n\n")
        p.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    monkeypatch.setattr(tokens, "READ_BYTES", 1000)  # many blocks, and a UTF-8 decoder fed block by block
    size, b2 = source_digest(p)
    tf = build_token_file(p, tok, tmp_path / "cache", size=size, source_b2=b2, piece_bytes=2000)
    whole = np.asarray(encode_corpus(tok, load_text(p)), dtype=np.uint16)
    assert tf.n_tokens == whole.size > 20_000
    assert tf.ids().dtype == np.dtype("<u2") and np.array_equal(tf.ids(), whole)
    assert tf.bin_path.stat().st_size == 2 * whole.size  # raw ids, no header


def test_load_dataset_maps_a_local_file_and_gives_the_in_memory_batches(tmp_path, tok):
    p = tmp_path / "corpus.txt"
    p.write_text(_text(4000, seed=1))
    ds = load_dataset(p, seq_len=32, cache_dir=tmp_path / "cache")
    assert ds.mapped and isinstance(ds.ids, np.memmap)
    ids = np.asarray(encode_corpus(ds.tokenizer, load_text(p)), dtype=np.int32)
    mem = type(ds)(ids, ds.vocab_size, fingerprint=ds.fingerprint)
    assert not mem.mapped and (mem.n_train, mem.n_eval) == (ds.n_train, ds.n_eval)
    for step in range(3):
        a = ds.sample_batch(seed=7, peer_id="p", round=2, step=step, batch_size=5, seq_len=32)
        b = mem.sample_batch(seed=7, peer_id="p", round=2, step=step, batch_size=5, seq_len=32)
        assert a.dtype == torch.int64 and a.shape == (5, 32) and torch.equal(a, b)
    ea, eb = list(ds.eval_batches(32, 4, 3)), list(mem.eval_batches(32, 4, 3))
    assert len(ea) == 3 and all(torch.equal(x, y) for x, y in zip(ea, eb))
    assert torch.equal(ds.train, mem.train) and torch.equal(ds.eval, mem.eval)


def test_the_token_file_is_reused_on_restart_and_checked_against_its_source(tmp_path, monkeypatch, caplog):
    p = tmp_path / "corpus.txt"
    p.write_text(_text(2000, seed=2))
    cache = tmp_path / "cache"
    first = load_dataset(p, seq_len=32, cache_dir=cache)
    first_ids = np.array(first.ids)  # a copy: the map's file is cut below
    [bin_path] = cache.glob("tokens-*.bin")

    def no_encoding(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(tokens, "encode_corpus", no_encoding)
    again = load_dataset(p, seq_len=32, cache_dir=cache)
    assert again.fingerprint == first.fingerprint and np.array_equal(again.ids, first_ids)
    monkeypatch.undo()
    # a truncated .bin (a crash, a full disk) is not used: the file is tokenized again, with one WARNING
    with open(bin_path, "r+b") as f:
        f.truncate(bin_path.stat().st_size - 2)
    with caplog.at_level(logging.WARNING, logger="geomesh_p2p.data.tokens"):
        fixed = load_dataset(p, seq_len=32, cache_dir=cache)
    assert np.array_equal(fixed.ids, first_ids) and "does not match its source" in caplog.text
    # an edited source of the same size is another source: another key, another fingerprint
    text = p.read_text()
    p.write_text(text.replace("Lord", "lord", 1))
    edited = load_dataset(p, seq_len=32, cache_dir=cache)
    assert edited.fingerprint != first.fingerprint and len(list(cache.glob("tokens-*.json"))) == 2


def test_bad_files_are_refused_with_their_path(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine\n" * 3000 + b"\xff\xfe")
    with pytest.raises(DataError, match=r"bad.txt: not valid UTF-8 text \(byte 15000\)"):
        load_dataset(bad, seq_len=8, cache_dir=tmp_path / "c")
    with pytest.raises(DataError, match="data file not found"):
        load_dataset(tmp_path / "none.txt", seq_len=8, cache_dir=tmp_path / "c")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(DataError, match="data file is empty"):
        load_dataset(empty, seq_len=8, cache_dir=tmp_path / "c")
    jl = tmp_path / "x.jsonl"
    jl.write_text('{"text": "a"}\n{"nope": 1}\n')
    with pytest.raises(DataError, match='line 2 has no string field "text"'):
        load_dataset(jl, seq_len=8, cache_dir=tmp_path / "c")
    assert not list((tmp_path / "c").glob("tokens-*"))  # nothing half-written left under the final names


@pytest.mark.timeout(180)
def test_a_large_file_is_tokenized_in_bounded_memory(tmp_path):
    """The large-data path at a size the suite can afford: 16 MB of text, tokenized in 1 MB pieces, costs
    well under the ~17 bytes of RAM per byte of text the in-memory load took (~270 MB here); peak RSS
    growth is read from the child process's own ru_maxrss."""
    p = tmp_path / "big.txt"
    block = _text(40_000)
    with open(p, "w") as f:
        for _ in range(10):
            f.write(block)
    assert p.stat().st_size > 15 << 20
    code = textwrap.dedent(
        f"""
        import resource, sys
        from pathlib import Path
        from geomesh_p2p.data import get_tokenizer
        from geomesh_p2p.data.tokens import build_token_file, source_digest
        tok = get_tokenizer(None)
        p = Path({str(p)!r})
        size, b2 = source_digest(p)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        tf = build_token_file(p, tok, Path({str(tmp_path / "cache")!r}), size=size, source_b2=b2)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(tf.n_tokens, tf.bin_path.stat().st_size, (after - before) * 1024)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=170, check=True
    ).stdout.split()
    n_tokens, file_bytes, grew = (int(x) for x in out)
    assert file_bytes == 2 * n_tokens and n_tokens > 4_000_000
    assert grew < 120 << 20, f"peak RSS grew {grew >> 20} MiB while tokenizing 16 MB"


def test_a_damaged_cache_is_tokenized_again_never_trained_on(tmp_path, caplog):
    """Red team: an all-zero .bin of the right size was used (perplexity 1.16, the honest fingerprint); an index
    that is a list, n_tokens 0 with an empty .bin, or a dtype other than the tokenizer's crashed or was used."""
    p = tmp_path / "corpus.txt"
    p.write_text(_text(2000, seed=3))
    cache = tmp_path / "cache"
    want = np.array(load_dataset(p, seq_len=32, cache_dir=cache).ids)
    [bin_path] = cache.glob("tokens-*.bin")
    [idx_path] = cache.glob("tokens-*.json")
    good_idx = idx_path.read_text()

    def damaged(bin_bytes=None, index=None):
        if bin_bytes is not None:
            bin_path.write_bytes(bin_bytes)
        idx_path.write_text(good_idx if index is None else index)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="geomesh_p2p.data.tokens"):
            got = np.array(load_dataset(p, seq_len=32, cache_dir=cache).ids)
        assert np.array_equal(got, want) and "tokenizing again" in caplog.text

    size = bin_path.stat().st_size
    damaged(bin_bytes=bytes(size))  # zeros, the right size
    idx = json.loads(good_idx)
    damaged(index=json.dumps([1, 2]))
    damaged(index=json.dumps({**idx, "dtype": "uint32", "n_tokens": idx["n_tokens"] // 2}))
    damaged(bin_bytes=b"", index=json.dumps({**idx, "n_tokens": 0}))
    damaged(index="[" * 100_000)


def test_invalid_utf8_is_named_at_its_byte_across_a_block_boundary(tmp_path, monkeypatch):
    monkeypatch.setattr(tokens, "READ_BYTES", 1000)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"a" * 999 + b"\xc3A" + b"b" * 50)  # a lead byte ends block 1, a non-continuation starts 2
    with pytest.raises(DataError, match=r"not valid UTF-8 text \(byte 999\)"):
        load_dataset(bad, seq_len=8, cache_dir=tmp_path / "c")
