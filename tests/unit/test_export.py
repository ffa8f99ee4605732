"""Export (issue 16): a trained checkpoint becomes a Hugging Face folder that transformers loads offline,
with logits bitwise equal to the node's model; ``geomesh-peer generate`` / ``checkpoints``; bad input
(a checkpoint of another run config, a corrupt file, a missing round) fails with one line."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from geomesh_p2p.data import load_dataset
from geomesh_p2p.node.peer import RunConfig
from geomesh_p2p.model.state import save_checkpoint
from geomesh_p2p.model.build import build_model, flat_params, load_flat_
from geomesh_p2p.model.training import InnerTrainer
from peer.cli import main

# one intra-op thread (conftest's one_thread): under make test's load (3 workers on 2 cores) spin-waiting OpenMP
# threads made this file's CPU steps many times slower; nothing asserted depends on the thread count
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_thread")]


def _save(directory, run: RunConfig, round: int, theta, momentum=None, **meta_over):
    meta = {"run_config_hash": run.config_hash(), "peer_id": "test-peer", "run_config": run.model_dump()}
    meta.update(meta_over)
    return save_checkpoint(directory, round=round, theta=theta, momentum=momentum, meta=meta, keep=10)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A demo-config run (tiny GPT-2 on the shipped corpus) trained a few inner steps, as a node holds
    it: the model built as PeerNode builds it, its flat weights checkpointed at rounds 1 and 2."""
    d = tmp_path_factory.mktemp("ckpt")
    run = RunConfig(run_id="export-test", seq_len=32, pow_bits=0)
    ds = load_dataset(None, seq_len=run.seq_len, vocab_size=run.vocab_size)
    model = build_model(run.model, vocab_size=ds.vocab_size, seed=run.seed)
    trainer = InnerTrainer(
        model,
        ds,
        device="cpu",
        seq_len=run.seq_len,
        optimizer=run.inner_optimizer,
        lr=run.inner_lr,
        weight_decay=0.1,
        warmup_steps=2,
        total_steps=100,
        seed=run.seed,
        peer_id="test-peer",
        amp=False,
    )
    first = trainer.run(round=0, inner_steps=4, batch_size=8)
    theta1 = flat_params(model)
    _save(d, run, 1, theta1, torch.zeros_like(theta1))
    trainer.run(round=1, inner_steps=4, batch_size=8)
    theta2 = flat_params(model)
    _save(d, run, 2, theta2, torch.zeros_like(theta2))
    assert first.steps_done == 4
    return {"dir": d, "run": run, "ds": ds, "theta": {1: theta1, 2: theta2}}


def _node_model(trained, round: int):
    """The node's model holding the global weights of ``round`` (PeerNode._set_state: load_flat_)."""
    run, ds = trained["run"], trained["ds"]
    m = build_model(run.model, vocab_size=ds.vocab_size, seed=run.seed)
    load_flat_(m, trained["theta"][round])
    return m.eval()


def _one_line_error(capsys, prefix: str) -> str:
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1, err
    assert err[0].startswith(prefix), err[0]
    return err[0]


def test_export_round_trips_bitwise_and_generates(trained, tmp_path, capsys, monkeypatch):
    out = tmp_path / "hf"
    assert main(["export", "--checkpoint-dir", str(trained["dir"]), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "exported round 2 (the state after round 1; digest " in said  # the round rows' numbering too (user 47)
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "geomesh_export.json"):
        assert (out / f).is_file(), f
    info = json.loads((out / "geomesh_export.json").read_text())
    assert info["round"] == 2 and info["run_config_hash"] == trained["run"].config_hash()

    # offline: nothing may be fetched from a hub
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tok = AutoTokenizer.from_pretrained(str(out))
    text = "In the beginning God created the heaven and the earth."
    assert tok(text)["input_ids"] == trained["ds"].tokenizer.encode(text).ids
    batch = next(trained["ds"].eval_batches(trained["run"].seq_len, 4, 1))
    node = _node_model(trained, 2)
    with torch.no_grad():
        assert torch.equal(hf(input_ids=batch).logits, node(input_ids=batch).logits)
        assert not torch.equal(hf(input_ids=batch).logits, _node_model(trained, 1)(input_ids=batch).logits)
    ids = tok("And God said", return_tensors="pt")["input_ids"]
    gen = hf.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.eos_token_id)
    assert gen.shape[1] == ids.shape[1] + 5
    assert tok.decode(gen[0]).startswith("And God said")

    # an earlier round on request
    old = tmp_path / "hf1"
    assert main(["export", "--checkpoint-dir", str(trained["dir"]), "--round", "1", "--out", str(old)]) == 0
    hf1 = AutoModelForCausalLM.from_pretrained(str(old)).eval()
    with torch.no_grad():
        assert torch.equal(hf1(input_ids=batch).logits, _node_model(trained, 1)(input_ids=batch).logits)


def test_generate_and_checkpoints_commands(trained, capsys):
    assert (
        main(
            [
                "generate",
                "--checkpoint-dir",
                str(trained["dir"]),
                "--prompt",
                "And God said",
                "--max-new-tokens",
                "6",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out.strip()
    assert out.startswith("And God said") and len(out) > len("And God said")
    assert main(["checkpoints", str(trained["dir"]), "--verify"]) == 0
    table = capsys.readouterr().out
    assert trained["run"].config_hash() in table and "run_id='export-test'" in table
    # a checkpoint's round is the round it starts, one past the round row that evaluated it (fresh user 47)
    assert "round N: the state after round N-1's exchange, which round N starts from" in " ".join(table.split())
    assert main(["checkpoints", str(trained["dir"]), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["round"] for r in rows] == [1, 2]
    assert all(r["bytes"] > 4 * r["num_params"] and len(r["digest"]) == 32 and r["problem"] is None for r in rows)


def test_bad_input_fails_with_one_line(trained, tmp_path, capsys):
    run, theta = trained["run"], trained["theta"][2]
    # a checkpoint whose run config describes another model than its weights
    other = tmp_path / "other"
    _save(other, run.model_copy(update={"model": "small"}), 3, theta)
    assert main(["export", "--checkpoint-dir", str(other), "--out", str(tmp_path / "o1")]) == 1
    assert "another run config" in _one_line_error(capsys, "geomesh-peer export: ")
    assert not (tmp_path / "o1").exists()
    # metadata whose run config does not hash to the recorded hash
    edited = tmp_path / "edited"
    _save(edited, run, 3, theta, run_config_hash="0" * 16)
    assert main(["export", "--checkpoint-dir", str(edited), "--out", str(tmp_path / "o2")]) == 1
    assert "hashes to" in _one_line_error(capsys, "geomesh-peer export: ")
    # another run than asked for
    assert (
        main(
            ["export", "--checkpoint-dir", str(trained["dir"]), "--run-id", "other-run", "--out", str(tmp_path / "o3")]
        )
        == 1
    )
    assert "not 'other-run'" in _one_line_error(capsys, "geomesh-peer export: ")
    # a round that is not there
    assert main(["export", "--checkpoint-dir", str(trained["dir"]), "--round", "7", "--out", str(tmp_path / "o4")]) == 1
    assert "no checkpoint of round 7" in _one_line_error(capsys, "geomesh-peer export: ")
    # corrupt weights: truncated, then one flipped byte
    bad = tmp_path / "corrupt"
    shutil.copytree(trained["dir"], bad)
    w = bad / "ckpt-00000002.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    assert main(["export", "--checkpoint-dir", str(bad), "--out", str(tmp_path / "o5")]) == 1
    assert "corrupt" in _one_line_error(capsys, "geomesh-peer export: ")
    w1 = bad / "ckpt-00000001.safetensors"
    data = bytearray(w1.read_bytes())
    data[-7] ^= 0x40
    w1.write_bytes(bytes(data))
    assert main(["generate", "--checkpoint-dir", str(bad), "--round", "1", "--prompt", "x"]) == 1
    assert "digest" in _one_line_error(capsys, "geomesh-peer generate: ")
    # corrupt metadata, an empty directory, listing a damaged directory
    (bad / "ckpt-00000002.json").write_text("{not json")
    assert main(["export", "--checkpoint-dir", str(bad), "--out", str(tmp_path / "o6")]) == 1
    assert "corrupt checkpoint metadata" in _one_line_error(capsys, "geomesh-peer export: ")
    assert main(["checkpoints", str(bad), "--verify"]) == 1
    table = capsys.readouterr().out
    assert "unreadable metadata" in table and "digest" in table
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (
        main(["checkpoints", str(empty)]) == 2
    )  # a DIR that holds no checkpoint is a bad argument (fresh user 49: exit 2, as a missing one)
    assert "no checkpoint" in _one_line_error(capsys, "geomesh-peer checkpoints: ")
    # another run's data without --data
    hf_run = run.model_copy(update={"data": "corpus.txt:123:abcdef"})
    own = tmp_path / "owndata"
    _save(own, hf_run, 1, theta)
    assert main(["export", "--checkpoint-dir", str(own), "--out", str(tmp_path / "o7")]) == 1
    assert "pass the same --data" in _one_line_error(capsys, "geomesh-peer export: ")
    # a non-empty --out that holds no earlier export is left alone
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "mine.txt").write_text("keep")
    assert main(["export", "--checkpoint-dir", str(trained["dir"]), "--out", str(busy)]) == 1
    assert "not empty" in _one_line_error(capsys, "geomesh-peer export: ")
    assert os.listdir(busy) == ["mine.txt"]
