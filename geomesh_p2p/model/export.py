"""Checkpoints a person can use: list them, load one, export it as a Hugging Face folder, generate.

* :func:`list_checkpoint_info` — round, digest, size, time and run config of each checkpoint of a
  directory (``geomesh-peer checkpoints D``);
* :func:`load_checkpoint` — one round's global state, its digest checked;
* :func:`build_exported` — the run's model with those weights and the run's tokenizer, exactly as a
  peer builds them (:func:`geomesh_p2p.model.build.build_model`, :func:`geomesh_p2p.data.get_tokenizer`);
* :func:`export_checkpoint` — ``save_pretrained`` of both (``config.json``, ``model.safetensors``,
  ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``) plus
  ``geomesh_export.json`` (round, digest, run config), so that ``AutoModelForCausalLM`` and
  ``AutoTokenizer.from_pretrained(DIR)`` load it offline (``geomesh-peer export``);
* :func:`generate` — a few sampled tokens from a prompt (``geomesh-peer generate``).

Every failure a person can cause (no checkpoint, a corrupt file, a checkpoint whose weights do not fit
its run config, the tokenizer's data missing) raises :class:`ExportError` with one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from geomesh_p2p.config.models import RunConfig
from geomesh_p2p.data import DataError, get_tokenizer, load_text
from geomesh_p2p.data.hub import parse_hf_spec
from geomesh_p2p.data.tokenizer import EOS_TOKEN
from geomesh_p2p.model.digest import DIGEST_ALGO
from geomesh_p2p.model.state import (
    CKPT_FORMAT,
    CheckpointError,
    list_checkpoints,
    read_checkpoint_files,
    verify_checkpoint_digest,
)
from geomesh_p2p.model.ckpt_files import WeightsNameError, checkpoint_dir_problem, weights_path
from geomesh_p2p.model.build import ConfigError, build_model, load_flat_, num_params
from geomesh_p2p.util.errors import UserFacingError

EXPORT_INFO = "geomesh_export.json"


class ExportError(UserFacingError):
    """A checkpoint cannot be listed, loaded or exported; the message is one line naming the file."""


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


# ------------------------------------------------------------------------------------ listing
def list_checkpoint_info(directory: str | os.PathLike, verify: bool = False) -> list[dict[str, Any]]:
    """One dict per checkpoint of ``directory``, oldest first: ``round``, ``digest``, ``bytes`` (weights
    + metadata), ``time``, ``num_params``, ``has_momentum``, ``run_config_hash``, ``run_config``,
    ``peer_id``, ``path``, and ``problem`` (None, or why the checkpoint is unusable: unreadable
    metadata, missing weights, a digest that does not match when ``verify``).

    Raises ExportError when ``directory`` is not a directory or holds no checkpoint."""

    d = Path(directory).expanduser()
    problem = checkpoint_dir_problem(d)
    if problem is not None:
        raise ExportError(problem)
    found = list_checkpoints(d)
    out = []
    for rnd, meta_path in found:
        row: dict[str, Any] = {
            "round": rnd,
            "path": str(meta_path),
            "digest": None,
            "bytes": None,
            "time": None,
            "num_params": None,
            "has_momentum": None,
            "run_config_hash": None,
            "run_config": None,
            "peer_id": None,
            "problem": None,
        }
        try:
            rec = json.loads(meta_path.read_text(encoding="utf-8"))
            if not isinstance(rec, dict) or rec.get("format") != CKPT_FORMAT:
                raise ValueError("not a geomesh checkpoint record")
        except (OSError, ValueError) as e:
            row["problem"] = f"unreadable metadata ({_one_line(e)})"
            out.append(row)
            continue
        meta: dict = rec["meta"] if isinstance(rec.get("meta"), dict) else {}
        wrong = _wrong_field(rec, meta)
        if wrong is not None:  # parsed, but a field of another type: the table formats them (red team 43)
            row["problem"] = f"unreadable metadata ({wrong})"
            out.append(row)
            continue
        try:
            weights = weights_path(meta_path, rec)  # its own folder only: no stat of a file elsewhere
        except WeightsNameError as e:
            row["problem"] = f"unreadable metadata ({e})"
            out.append(row)
            continue
        row.update(
            round=rec.get("round", rnd),
            digest=rec.get("digest"),
            time=rec.get("time"),
            num_params=rec.get("num_params"),
            has_momentum=rec.get("has_momentum"),
            run_config_hash=rec.get("run_config_hash"),
            run_config=meta.get("run_config"),
            peer_id=meta.get("peer_id"),
        )
        try:
            row["bytes"] = weights.stat().st_size + meta_path.stat().st_size
        except OSError:
            row["problem"] = f"weights file {weights.name} is missing"
        if verify and row["problem"] is None:
            try:
                load_checkpoint(d, row["round"])
            except ExportError as e:
                row["problem"] = str(e)
        out.append(row)
    return out


#: The record's fields :func:`list_checkpoint_info` lists, each None or of these types (bool is no int here).
_RECORD_TYPES: dict[str, tuple[type, ...]] = {
    "round": (int,),
    "digest": (str,),
    "time": (int, float),
    "num_params": (int,),
    "has_momentum": (bool,),
    "run_config_hash": (str,),
    "weights": (str,),
}
_META_TYPES: dict[str, tuple[type, ...]] = {"peer_id": (str,), "run_config": (dict,)}
#: Unix seconds a record's ``time`` may say (to the year 2999: ``time.localtime`` takes it on every platform).
_MAX_TIME = 32503680000.0


def _wrong_field(rec: dict, meta: dict) -> Optional[str]:
    """``"FIELD VALUE is not TYPE"`` for the first field of a checkpoint record (or of its ``meta``) that is
    neither absent, None (but ``round``) nor of its type (a round below 0, a time that is no unix time), else None. A
    hand-edited record parsed as JSON reached int(), slicing and number formatting with these (red team 43)."""
    for fields, where in ((_RECORD_TYPES, rec), (_META_TYPES, meta)):
        for name, types in fields.items():
            if name not in where:
                continue
            v = where[name]
            # a round is the file's, or an int: null is no round (the listing read it with int())
            ok = (v is None and name != "round") or (
                isinstance(v, types) and (bool in types or not isinstance(v, bool))
            )
            if ok and name == "round" and v is not None:
                ok = v >= 0
            if ok and name == "time" and v is not None:
                ok = 0 <= v <= _MAX_TIME  # NaN and the infinities too
            if ok and name == "num_params" and v is not None:
                ok = v >= 0
            if not ok:
                return f"{name} {v!r:.40} is not {' or '.join(t.__name__ for t in types)}"
            if isinstance(v, str) and not _utf8(v):  # JSON's "\ud800": the table's print raised it (red team 44)
                return f"{name} {v!r:.40} is not UTF-8 text"
    return None


def _utf8(text: str) -> bool:
    """Whether ``text`` encodes to UTF-8 (no surrogate: JSON may spell one, no terminal can print it)."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


# ------------------------------------------------------------------------------------ loading
def load_checkpoint(directory: str | os.PathLike, round: Optional[int] = None):
    """``(round, theta, momentum, record)`` of the checkpoint of ``round`` (default: the newest) in
    ``directory``; the digest of the tensors is checked against the metadata. Raises ExportError."""

    d = Path(directory).expanduser()
    problem = checkpoint_dir_problem(d)
    if problem is not None:
        raise ExportError(problem)
    found = dict(list_checkpoints(d))
    if round is None:
        round = max(found)
    if round not in found:
        raise ExportError(f"{d}: no checkpoint of round {round} (rounds: {', '.join(map(str, sorted(found)))})")
    meta_path = found[round]
    try:
        record, tensors, wpath = read_checkpoint_files(meta_path)
    except CheckpointError as e:
        raise ExportError(str(e).splitlines()[0]) from None
    theta, momentum = tensors.get("theta"), tensors.get("momentum")
    if theta is None or theta.dtype != torch.float32 or theta.dim() != 1 or theta.numel() == 0:
        raise ExportError(f"corrupt checkpoint weights {wpath}: no fp32 'theta' vector")
    if momentum is not None and (momentum.dtype != torch.float32 or momentum.dim() != 1):
        raise ExportError(f"corrupt checkpoint weights {wpath}: malformed 'momentum'")
    try:
        # this release's digest, or blake2b for a checkpoint of a release before 0.3.0 (model/digest.py)
        current = verify_checkpoint_digest(record, theta, momentum, wpath)
    except CheckpointError as e:
        raise ExportError(f"{e} (damaged or altered file)" if "corrupt" in str(e) else str(e)) from None
    if record.get("digest") != current:  # a legacy checkpoint: its state's digest in this release
        record = {**record, "legacy_digest": record.get("digest"), "digest": current, "digest_algo": DIGEST_ALGO}
    got = record.get("round", round)
    if type(got) is not int or got < 0:  # int() of it: a traceback for "x" or null, round 1 for 1.5 (red team 43)
        raise ExportError(f"corrupt checkpoint metadata {meta_path}: round {got!r:.40} is not a round number")
    return got, theta, momentum, record


def run_config_of(record: dict, where: str = "checkpoint"):
    """The :class:`~geomesh_p2p.config.models.RunConfig` a checkpoint was trained with; its hash must be the one
    recorded. Raises ExportError."""
    from pydantic import ValidationError

    meta: dict = record["meta"] if isinstance(record.get("meta"), dict) else {}
    cfg = meta.get("run_config")
    if not isinstance(cfg, dict):
        raise ExportError(f"{where}: its metadata holds no run config (written by an older version?)")
    try:
        run = RunConfig.model_validate(cfg)
    except ValidationError as e:
        first = e.errors()[0] if e.errors() else {"loc": (), "msg": str(e)}
        raise ExportError(
            f"{where}: run config of another version of geomesh-p2p "
            f"({'.'.join(map(str, first['loc']))}: {first['msg']})"
        ) from None
    want = record.get("run_config_hash") or meta.get("run_config_hash")
    if want is not None and run.config_hash() != want:
        raise ExportError(
            f"{where}: its run config hashes to {run.config_hash()}, the checkpoint says {want} "
            f"(edited metadata, or another version's config)"
        )
    return run


def data_identifier(data: str) -> str:
    """The ``RunConfig.data`` value of ``--data`` (as ``geomesh-peer join`` computes it)."""
    if data.startswith("hf:"):
        return parse_hf_spec(data).canonical()
    p = Path(data).expanduser()
    if not p.is_file():
        raise ExportError(f"--data {data}: no such file")
    with p.open("rb") as f:
        head = f.read(1 << 20)
    return f"{p.name}:{p.stat().st_size}:{hashlib.sha256(head).hexdigest()[:16]}"


@dataclass
class Exported:
    """A checkpoint as a ready model: ``model`` (fp32, eval mode), ``tokenizer``
    (``tokenizers.Tokenizer``), the run config, round and digest."""

    model: Any
    tokenizer: Any
    run: Any
    round: int
    digest: str
    record: dict


def build_exported(
    directory: str | os.PathLike, round: Optional[int] = None, data: Optional[str] = None, run_id: Optional[str] = None
) -> Exported:
    """Load a checkpoint into the model its run config describes, with the run's tokenizer.

    ``data``: the run's ``--data`` (needed for any corpus but the shipped one, to rebuild its
    tokenizer); ``run_id``: when given, the checkpoint must be of that run. Raises ExportError."""

    rnd, theta, _momentum, record = load_checkpoint(directory, round)
    where = f"checkpoint of round {rnd} in {Path(directory).expanduser()}"
    run = run_config_of(record, where)
    if run_id is not None and run.run_id != run_id:
        raise ExportError(f"{where}: it is of run {run.run_id!r}, not {run_id!r}")
    try:
        if run.data == "kjv":
            if data is not None:
                raise ExportError(f"{where}: the run trained on the shipped corpus; drop --data {data}")
            tok = get_tokenizer(None, vocab_size=run.vocab_size)
        else:
            if data is None:
                raise ExportError(
                    f"{where}: the run trained on {run.data!r}; pass the same --data to rebuild its tokenizer"
                )
            if data_identifier(data) != run.data:
                raise ExportError(
                    f"{where}: --data {data} is not the run's data ({data_identifier(data)} vs {run.data})"
                )
            tok = get_tokenizer(load_text(data), vocab_size=run.vocab_size)
    except DataError as e:
        raise ExportError(f"{where}: {e}") from None
    vocab = tok.get_vocab_size(with_added_tokens=True)
    try:
        if run.model_config_json:
            with tempfile.TemporaryDirectory() as tmp:
                cfg_file = Path(tmp) / "model_config.json"
                cfg_file.write_text(run.model_config_json)
                model = build_model(None, config_file=cfg_file, vocab_size=vocab, seed=run.seed)
        else:
            model = build_model(run.model, vocab_size=vocab, seed=run.seed)
    except ConfigError as e:
        raise ExportError(f"{where}: {e}") from None
    if num_params(model) != theta.numel():
        raise ExportError(
            f"{where}: it holds {theta.numel():,} weights but its run config's model "
            f"({run.model}, vocabulary {vocab}) has {num_params(model):,}: a checkpoint of another "
            f"run config or model"
        )
    load_flat_(model, theta)
    model.eval()
    return Exported(model, tok, run, rnd, str(record.get("digest")), record)


def hf_tokenizer(tok, max_length: Optional[int] = None):
    """A ``transformers`` fast tokenizer around the run's ``tokenizers.Tokenizer`` (EOS = BOS =
    ``<|endoftext|>``, id 0)."""
    from transformers import PreTrainedTokenizerFast

    kwargs = {"model_max_length": max_length} if max_length else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, **kwargs)


def _quiet_transformers() -> None:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except Exception:
        pass


def export_checkpoint(
    directory: str | os.PathLike,
    out: str | os.PathLike,
    round: Optional[int] = None,
    data: Optional[str] = None,
    run_id: Optional[str] = None,
    overwrite: bool = False,
) -> dict:
    """Write the checkpoint of ``round`` (default: newest) as a Hugging Face folder ``out``. Returns
    what was written (round, digest, files, parameters). Raises ExportError."""
    _quiet_transformers()
    dest = Path(out).expanduser()
    if dest.exists() and not dest.is_dir():
        raise ExportError(f"--out {dest}: exists and is not a directory")
    if dest.is_dir() and any(dest.iterdir()) and not overwrite and not (dest / EXPORT_INFO).exists():
        raise ExportError(f"--out {dest}: directory is not empty (and holds no earlier export)")
    ex = build_exported(directory, round, data, run_id)
    max_len = getattr(ex.model.config, "n_positions", None) or getattr(ex.model.config, "max_position_embeddings", None)
    tok = hf_tokenizer(ex.tokenizer, max_len)
    ex.model.config.use_cache = True  # faster generate(); the logits do not depend on it
    try:
        dest.mkdir(parents=True, exist_ok=True)
        ex.model.save_pretrained(dest, safe_serialization=True)
        tok.save_pretrained(dest)
        info = {
            "format": "geomesh-export-v1",
            "round": ex.round,
            "digest": ex.digest,
            "run_config_hash": ex.run.config_hash(),
            "run_config": ex.run.model_dump(),
            "checkpoint": str(Path(directory).expanduser().resolve()),
            "num_params": sum(p.numel() for p in ex.model.parameters()),
        }
        (dest / EXPORT_INFO).write_text(json.dumps(info, indent=1, sort_keys=True))
    except OSError as e:
        raise ExportError(f"--out {dest}: cannot write: {e.strerror or e}") from None
    info["files"] = sorted(p.name for p in dest.iterdir())
    info["out"] = str(dest)
    return info


def generate(
    ex: Exported, prompt: str, max_new_tokens: int = 40, temperature: float = 0.8, top_k: int = 40, seed: int = 0
) -> str:
    """Continue ``prompt`` with ``max_new_tokens`` tokens (greedy when ``temperature`` is 0). Returns the
    prompt and its continuation as text."""
    _quiet_transformers()
    ids = ex.tokenizer.encode(prompt).ids or [0]
    cfg = ex.model.config
    max_len = int(getattr(cfg, "n_positions", 0) or getattr(cfg, "max_position_embeddings", 1024))
    ids = ids[-max(1, max_len - max_new_tokens) :]
    x = torch.tensor([ids], dtype=torch.long)
    kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "pad_token_id": 0}
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_k=top_k)
    else:
        kwargs.update(do_sample=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.no_grad():
            out = ex.model.generate(x, **kwargs)
    return ex.tokenizer.decode(out[0].tolist())
