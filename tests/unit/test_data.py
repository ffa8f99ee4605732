"""Corpus, tokenizer and dataset tests (geomesh_p2p.data)."""

import json
import lzma
import re
import sys

import pytest
import torch

import geomesh_p2p.data.tokenizer as tokmod
from geomesh_p2p.data import (
    DataError,
    HFSpec,
    TokenDataset,
    batch_seed,
    encode_corpus,
    get_tokenizer,
    load_dataset,
    load_text,
    parse_hf_spec,
    tokenizer_key,
    train_tokenizer,
)


@pytest.fixture(scope="module")
def kjv():
    return load_text()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("gmcache")


@pytest.fixture(scope="module")
def ds(cache):
    return load_dataset(None, seq_len=64, cache_dir=cache)


def _no_training(*a, **k):
    raise AssertionError("tokenizer was retrained instead of loaded")


# --- corpus --------------------------------------------------------------------------


def test_shipped_corpus_is_kjv_without_references(kjv):
    assert kjv.startswith("In the beginning God created the heaven and the earth.\n")
    assert kjv.rstrip().endswith("The grace of our Lord Jesus Christ be with you all. Amen.")
    assert len(kjv) == 4_139_037
    assert re.search(r"\d", kjv) is None  # no chapter:verse numbers anywhere
    assert not re.search(r"^(Genesis|Exodus|Revelation) \d", kjv, re.M)
    verses = [l for l in kjv.split("\n") if l.strip()]
    assert len(verses) == 31102
    assert kjv.count("\n\n") == 1188  # chapters separated by one blank line


def test_missing_path_is_dataerror_naming_it(tmp_path):
    missing = tmp_path / "nope" / "corpus.txt"
    with pytest.raises(DataError) as ei:
        load_text(str(missing))
    assert isinstance(ei.value, ValueError)
    assert str(missing) in str(ei.value) and "\n" not in str(ei.value)
    with pytest.raises(DataError, match="not a file"):
        load_text(str(tmp_path))
    bad = tmp_path / "corpus.bin"
    bad.write_text("x")
    with pytest.raises(DataError, match=re.escape(str(bad))):
        load_text(bad)
    with pytest.raises(DataError, match="missing.json"):
        get_tokenizer(tokenizer_file=tmp_path / "missing.json")


def test_txt_xz_jsonl_inputs(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n", encoding="utf-8")
    assert load_text(tmp_path / "a.txt") == "hello world\n"
    (tmp_path / "a.txt.xz").write_bytes(lzma.compress("héllo\n".encode()))
    assert load_text(str(tmp_path / "a.txt.xz")) == "héllo\n"
    j = tmp_path / "docs.jsonl"
    j.write_text(
        json.dumps({"text": "first doc", "id": 1}) + "\n\n" + json.dumps({"text": "second doc"}) + "\n",
        encoding="utf-8",
    )
    assert load_text(j) == "first doc\n\nsecond doc"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl: line 2"):
        load_text(bad)
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(DataError, match="empty"):
        load_text(tmp_path / "empty.txt")
    (tmp_path / "latin.txt").write_bytes(b"caf\xe9")
    with pytest.raises(DataError, match="UTF-8"):
        load_text(tmp_path / "latin.txt")


def test_parquet_input_or_clear_error(tmp_path):
    p = tmp_path / "d.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        p.write_bytes(b"PAR1")
        with pytest.raises(DataError, match="pyarrow"):
            load_text(p)
        return
    pq.write_table(pa.table({"text": ["a b", "c d"]}), p)
    assert load_text(p) == "a b\n\nc d"


def test_jsonl_dataset_end_to_end(tmp_path, kjv):
    j = tmp_path / "d.jsonl"
    with open(j, "w") as f:
        for i in range(0, 60_000, 3_000):
            f.write(json.dumps({"text": kjv[i : i + 3_000]}) + "\n")
    d = load_dataset(str(j), seq_len=32, vocab_size=300, cache_dir=tmp_path / "c")
    assert d.vocab_size <= 300 and int(d.train.max()) < d.vocab_size
    assert d.sample_batch(seed=0, peer_id="p", round=0, step=0, batch_size=2, seq_len=32).shape == (2, 32)


# --- tokenizer -----------------------------------------------------------------------


def test_tokenizer_deterministic_and_cached(tmp_path, kjv, monkeypatch):
    text = kjv[:150_000]
    t1 = get_tokenizer(text, vocab_size=400, cache_dir=tmp_path)
    cached = tmp_path / f"tokenizer-{tokenizer_key(text, 400)}.json"
    assert cached.is_file()
    assert [p.name for p in tmp_path.iterdir()] == [cached.name]  # no temp files left
    t2 = train_tokenizer(text, 400)  # fresh training gives the same merges
    assert t1.to_str() == t2.to_str()
    monkeypatch.setattr(tokmod, "train_tokenizer", _no_training)
    t3 = get_tokenizer(text, vocab_size=400, cache_dir=tmp_path)
    assert t3.to_str() == t1.to_str()
    assert t3.encode("And God said").ids == t1.encode("And God said").ids
    assert tokenizer_key(text, 400) != tokenizer_key(text, 401)


def test_shipped_tokenizer_needs_no_training(tmp_path, monkeypatch, kjv):
    monkeypatch.setattr(tokmod, "train_tokenizer", _no_training)
    tok = get_tokenizer(None, cache_dir=tmp_path)
    assert tok.get_vocab_size() == 4096
    assert tok.decode(tok.encode(kjv[:500]).ids) == kjv[:500]
    assert list(tmp_path.iterdir()) == []


def test_fast_encoding_equals_tokenizers_encode(kjv):
    tok = get_tokenizer(None)
    odd = (
        "He said, 'Tis  the Lord's  day;\tthey'll go -- 12 men, 3 ye'd\n\n\n  trailing   \n"
        " x  \n\tend's 've 're 'm 'd 'll 't  ?!! ... "
    )
    for text in (kjv[:200_000], kjv[-100_000:], odd, odd * 3 + kjv[5000:9000]):
        assert encode_corpus(tok, text) == tok.encode(text).ids
    # non-ASCII and special tokens take the fallback path
    assert encode_corpus(tok, "Ça va?\nOui.") == tok.encode("Ça va?\nOui.").ids
    assert encode_corpus(tok, "a<|endoftext|>b") == tok.encode("a<|endoftext|>b").ids


def test_user_tokenizer_file(tmp_path, kjv):
    tok = train_tokenizer(kjv[:50_000], 300)
    f = tmp_path / "tokenizer.json"
    tok.save(str(f))
    (tmp_path / "c.txt").write_text(kjv[:50_000])
    d = load_dataset(tmp_path / "c.txt", seq_len=16, tokenizer_file=str(f), cache_dir=tmp_path)
    assert d.vocab_size == 300
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(DataError, match="broken.json"):
        get_tokenizer(tokenizer_file=tmp_path / "broken.json")


# --- dataset -------------------------------------------------------------------------


def test_load_dataset_shapes_and_cache(ds, cache, monkeypatch):
    assert ds.vocab_size == 4096
    assert ds.train.dtype == torch.int32 and ds.train.dim() == 1
    n = ds.train.numel() + ds.eval.numel()
    assert 1_000_000 < n < 1_100_000
    assert abs(ds.eval.numel() - 0.05 * n) <= 1
    assert int(ds.train.max()) < ds.vocab_size and int(ds.train.min()) >= 0
    assert len(list(cache.glob("ids-*.npy"))) == 1
    # warm start: ids come from the cache, no encoding
    monkeypatch.setattr("geomesh_p2p.data.dataset.encode_corpus", _no_training)
    again = load_dataset(None, seq_len=64, cache_dir=cache)
    assert torch.equal(again.train, ds.train) and torch.equal(again.eval, ds.eval)
    assert again.fingerprint == ds.fingerprint


def test_sample_batch_deterministic(ds):
    kw = dict(seed=1, peer_id="peerA", round=3, step=5, batch_size=4, seq_len=64)
    a = ds.sample_batch(**kw)
    b = ds.sample_batch(**kw)
    assert a.shape == (4, 64) and a.dtype == torch.int64
    assert torch.equal(a, b)
    for change in ({"peer_id": "peerB"}, {"step": 6}, {"round": 4}, {"seed": 2}):
        assert not torch.equal(a, ds.sample_batch(**{**kw, **change})), change
    # rows are real windows of the train split
    row = a[0].to(torch.int32)
    starts = (ds.train[:-63] == row[0]).nonzero().flatten()
    assert any(torch.equal(ds.train[s : s + 64], row) for s in starts.tolist())


def test_batch_seed_is_stable():
    # pinned: must not change across Python processes, platforms or PYTHONHASHSEED
    assert batch_seed(0, "peer", 0, 0) == batch_seed(0, "peer", 0, 0)
    assert batch_seed(0, "a", 1, 2) != batch_seed(0, "a", 2, 1)
    import hashlib

    d = hashlib.blake2b("geomesh-batch-v1\x1f0\x1fpeer\x1f0\x1f0".encode(), digest_size=8).digest()
    assert batch_seed(0, "peer", 0, 0) == int.from_bytes(d, "little") & ((1 << 63) - 1)


def test_eval_split_disjoint_from_train():
    d = TokenDataset(torch.arange(1000), vocab_size=1000, eval_fraction=0.1)
    assert torch.equal(d.eval, torch.arange(900, 1000, dtype=torch.int32))
    assert torch.equal(d.train, torch.arange(900, dtype=torch.int32))
    for step in range(200):
        x = d.sample_batch(seed=0, peer_id="p", round=0, step=step, batch_size=8, seq_len=50)
        assert int(x.max()) < 900
    ev = list(d.eval_batches(seq_len=20, batch_size=2))
    assert [tuple(b.shape) for b in ev] == [(2, 20), (2, 20), (1, 20)]
    assert int(torch.cat([b.flatten() for b in ev]).min()) >= 900
    assert len(list(d.eval_batches(20, 2, max_batches=1))) == 1


def test_eval_batches_fixed(ds):
    a = list(ds.eval_batches(64, 8, 3))
    b = list(ds.eval_batches(64, 8, 3))
    assert len(a) == 3 and all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(a[0][0], ds.eval[:64].to(torch.int64))


def test_seq_len_too_long(tmp_path):
    (tmp_path / "t.txt").write_text("In the beginning. " * 40)
    with pytest.raises(DataError, match="too few tokens"):
        load_dataset(tmp_path / "t.txt", seq_len=512, vocab_size=300, cache_dir=tmp_path)


# --- Hugging Face datasets: --data hf:NAME[:CONFIG][@SPLIT] ---------------------------
# Nothing here reaches the network: specs are parsed offline, real loads read a local
# directory through `datasets` in offline mode, and one test fakes the loader.


@pytest.fixture
def hf_offline(monkeypatch, tmp_path):
    """`datasets` in offline mode (env vars for a fresh import, constants if already imported)."""
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-home" / "datasets"))
    import datasets  # a dependency: fail, do not skip, if it is missing
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return datasets


def _write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


HF_ROWS = [
    {"text": "First doc.", "body": "b1"},
    {"text": "", "body": "b2"},  # empty: skipped
    {"text": None, "body": "b3"},  # null: skipped
    {"text": "Café au lait", "body": "b4"},
    {"text": "third", "body": "b5"},
]


def test_hf_spec_parsing_exact_fields():
    s = parse_hf_spec("hf:wikitext:wikitext-2-raw-v1@train")
    assert s == HFSpec(
        name="wikitext", config="wikitext-2-raw-v1", split="train", column="text", max_bytes=50_000_000, revision=None
    )
    assert s.canonical() == "hf:wikitext:wikitext-2-raw-v1@train?column=text&max_bytes=50000000"
    assert parse_hf_spec(s.canonical()) == s and str(s) == s.canonical()
    assert parse_hf_spec("hf:wikitext") == HFSpec(
        name="wikitext", config=None, split="train", column="text", max_bytes=50_000_000
    )
    assert parse_hf_spec("hf:Salesforce/wikitext@validation?column=body&max_bytes=1000&revision=abc123") == HFSpec(
        name="Salesforce/wikitext", config=None, split="validation", column="body", max_bytes=1000, revision="abc123"
    )
    assert (
        parse_hf_spec("hf:org/ds:cfg?revision=v1.0").canonical()
        == "hf:org/ds:cfg@train?column=text&max_bytes=50000000&revision=v1.0"
    )
    # --data-column / --data-max-bytes fill in what the spec leaves out
    assert parse_hf_spec("hf:/data/dir@test", column="content", max_bytes=123) == HFSpec(
        name="/data/dir", config=None, split="test", column="content", max_bytes=123
    )
    assert (
        parse_hf_spec("hf:x?column=c&max_bytes=5", column="c", max_bytes=5).canonical()
        == "hf:x@train?column=c&max_bytes=5"
    )
    # every field is in the identifier: specs that differ in any of them differ
    ids = {
        parse_hf_spec(x).canonical()
        for x in ["hf:a", "hf:b", "hf:a:c1", "hf:a@test", "hf:a?column=body", "hf:a?max_bytes=10", "hf:a?revision=r1"]
    }
    assert len(ids) == 7


@pytest.mark.parametrize(
    "spec, message",
    [
        ("hf:", "no dataset name"),
        ("hf:@train", "no dataset name"),
        ("hf:wikitext:", "empty config"),
        ("hf:wikitext@", "empty split"),
        ("hf:wiki text", "whitespace"),
        ("hf:x?max_bytes=0", "max_bytes must be >= 1, got 0"),
        ("hf:x?max_bytes=lots", "max_bytes must be an integer, got 'lots'"),
        ("hf:x?column=", "empty column name"),
        ("hf:x?revision=", "empty revision"),
        ("hf:x?colum=text", "unknown option 'colum'"),
        ("hf:x?column=a&column=b", "option 'column' given twice"),
        ("wikitext", "starts with 'hf:'"),
    ],
)
def test_hf_bad_spec_is_dataerror_naming_it(spec, message):
    with pytest.raises(DataError) as ei:
        parse_hf_spec(spec)
    msg = str(ei.value)
    assert message in msg and repr(spec) in msg and "\n" not in msg


def test_hf_spec_conflicting_options():
    with pytest.raises(DataError, match=r"column='a' in the spec but 'b' given separately"):
        parse_hf_spec("hf:x?column=a", column="b")
    with pytest.raises(DataError, match=r"max_bytes=10 in the spec but 20 given separately"):
        parse_hf_spec("hf:x?max_bytes=10", max_bytes=20)
    with pytest.raises(DataError, match=r"max_bytes must be >= 1, got -1"):
        parse_hf_spec("hf:x", max_bytes=-1)


@pytest.mark.timeout(60)
def test_hf_local_directory_exact_text_and_truncation(tmp_path, hf_offline):
    d = tmp_path / "corpus"
    _write_jsonl(d / "train.jsonl", HF_ROWS)
    full = "First doc.\n\nCafé au lait\n\nthird"
    assert load_text(f"hf:{d}") == full
    assert load_text(f"hf:{d}@train?column=body") == "b1\n\nb2\n\nb3\n\nb4\n\nb5"
    # max_bytes counts UTF-8 bytes of the joined text and cuts exactly there ...
    assert load_text(f"hf:{d}?max_bytes=12") == "First doc.\n\n"
    assert load_text(f"hf:{d}?max_bytes=15") == "First doc.\n\nCaf"
    # ... except inside a character, which is dropped whole ("é" is bytes 16 and 17)
    assert load_text(f"hf:{d}?max_bytes=16") == "First doc.\n\nCaf"
    assert load_text(f"hf:{d}?max_bytes=17") == "First doc.\n\nCafé"
    assert len(full.encode()) == 32
    assert load_text(f"hf:{d}?max_bytes=31") == full[:-1]
    assert load_text(f"hf:{d}?max_bytes=32") == full == load_text(f"hf:{d}?max_bytes=10000")


@pytest.mark.timeout(60)
def test_hf_errors_name_the_spec(tmp_path, hf_offline, monkeypatch):
    d = tmp_path / "corpus"
    _write_jsonl(d / "train.jsonl", HF_ROWS)
    # column absent
    with pytest.raises(DataError) as ei:
        load_text(f"hf:{d}?column=content")
    assert str(ei.value) == (
        f"data hf:{d}@train?column=content&max_bytes=50000000: no column 'content' "
        "(columns: text, body); choose one with --data-column"
    )
    # split absent
    with pytest.raises(DataError, match=r"@validation\?column=text&max_bytes=50000000: cannot load .*validation"):
        load_text(f"hf:{d}@validation")
    # a hub dataset while offline: says so and suggests a local copy
    with pytest.raises(DataError) as ei:
        load_text("hf:wikitext:wikitext-2-raw-v1@train")
    msg = str(ei.value)
    assert msg.startswith("data hf:wikitext:wikitext-2-raw-v1@train?column=text&max_bytes=50000000: offline mode is on")
    assert "pass a local file" in msg and "\n" not in msg
    # only empty rows
    _write_jsonl(tmp_path / "empty" / "train.jsonl", [{"text": ""}, {"text": None}])
    with pytest.raises(DataError, match="no text in column 'text'"):
        load_text(f"hf:{tmp_path / 'empty'}")
    # the datasets package missing
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(DataError) as ei:
        load_text("hf:wikitext")
    assert str(ei.value) == (
        "data hf:wikitext@train?column=text&max_bytes=50000000: reading a Hugging Face "
        "dataset needs the 'datasets' package (pip install datasets)"
    )


class _FakeStream:
    """Stands in for datasets.IterableDataset; counts the rows consumed."""

    def __init__(self, rows, column_names=None):
        self.rows, self.column_names, self.consumed = rows, column_names, 0

    def __iter__(self):
        for r in self.rows:
            self.consumed += 1
            yield r


@pytest.mark.timeout(60)
def test_hf_streams_only_what_max_bytes_needs(monkeypatch):
    import types

    calls = []
    stream = _FakeStream([{"text": "x" * 10}] * 1000)  # column_names None: checked per row

    def fake_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return stream

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=fake_load_dataset))
    text = load_text("hf:org/big:cfg@train?max_bytes=25&revision=0123abc")
    assert text == "x" * 10 + "\n\n" + "x" * 10 + "\n\n" + "x"
    assert calls == [(("org/big", "cfg"), {"split": "train", "streaming": True, "revision": "0123abc"})]
    assert stream.consumed == 3  # 10 + 2 + 10 + 2 + 10 >= 25: stops reading
    stream.rows = [{"text": "ok"}, {"body": "no text"}]
    with pytest.raises(DataError, match=r"row 1 has no column 'text' \(columns: body\)"):
        load_text("hf:org/big")
    stream.rows = [{"text": ["a", "list"]}]
    with pytest.raises(DataError, match=r"column 'text' is not text \(row 0 holds a list\)"):
        load_text("hf:org/big")

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'org/big' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=unreachable))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    with pytest.raises(DataError) as ei:
        load_text("hf:org/big")
    assert str(ei.value).startswith(
        "data hf:org/big@train?column=text&max_bytes=50000000: this machine "
        "cannot reach the Hugging Face hub (offline?): Couldn't reach"
    )

    class ConnectError(Exception):  # as httpx names it, raised while streaming rows
        pass

    def broken_rows():
        yield {"text": "one"}
        raise ConnectError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setitem(
        sys.modules, "datasets", types.SimpleNamespace(load_dataset=lambda *a, **k: _FakeStream(broken_rows()))
    )
    with pytest.raises(
        DataError,
        match=r"^data hf:org/big@train\?column=text&max_bytes=50000000: this machine "
        r"cannot reach the Hugging Face hub \(offline\?\): \[Errno -3\]",
    ):
        load_text("hf:org/big")
    monkeypatch.setitem(
        sys.modules,
        "datasets",
        types.SimpleNamespace(load_dataset=lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom\nsecond line"))),
    )
    with pytest.raises(DataError) as ei:
        load_text("hf:org/big")
    assert str(ei.value) == "data hf:org/big@train?column=text&max_bytes=50000000: cannot load (RuntimeError: boom)"


@pytest.mark.timeout(60)
def test_hf_dataset_end_to_end(tmp_path, hf_offline, kjv):
    d = tmp_path / "corpus"
    docs = [kjv[i : i + 3_000] for i in range(0, 60_000, 3_000)]
    _write_jsonl(d / "train.jsonl", [{"text": t} for t in docs])
    spec = f"hf:{d}?max_bytes=40000"
    ds1 = load_dataset(spec, seq_len=32, vocab_size=300, cache_dir=tmp_path / "c")
    # 13 whole documents and their separators (39,026 bytes), then 974 bytes of the 14th (ASCII)
    assert load_text(spec) == "\n\n".join(docs[:13]) + "\n\n" + docs[13][:974]
    ds2 = load_dataset(spec, seq_len=32, vocab_size=300, cache_dir=tmp_path / "c")
    assert ds1.fingerprint == ds2.fingerprint and torch.equal(ds1.train, ds2.train)
