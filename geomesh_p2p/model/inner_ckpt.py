"""The inner optimizer's state beside a checkpoint: local to one peer, never sent, never part of the digest.

A peer's inner optimizer (AdamW: ``exp_avg``, ``exp_avg_sq`` and ``step`` per parameter) keeps its state across
rounds (:class:`~geomesh_p2p.model.training.InnerTrainer`, as in DiLoCo). Without it in the checkpoint, every
peer of a resumed swarm restarted AdamW from zero moments: its first steps after the resume are full-size
sign-like updates (bias correction of a one-step average), and the eval perplexity got worse for rounds
(fresh user, session 37: 122.97 before the stop, 129.02 and 128.91 after, 125.2 six rounds later).

Files beside ``ckpt-NNNNNNNN.json`` (same stem, :func:`inner_paths`), written before that JSON commits the
checkpoint (:func:`~geomesh_p2p.model.state.save_checkpoint`'s ``sidecar``) and pruned with it:

* ``ckpt-NNNNNNNN.inner.safetensors`` -- every tensor of the optimizer's state, named ``PARAM:KEY``
  (``transformer.h.0.attn.c_attn.weight:exp_avg``), in its own dtype and shape (AdamW: two fp32 moments per
  parameter and a 0-d fp32 ``step``: ``2P`` fp32 in all, 8 bytes per parameter);
* ``ckpt-NNNNNNNN.inner.json`` -- ``format``, ``round``, ``digest`` and ``run_config_hash`` of the checkpoint it
  goes with, ``optimizer``, ``global_step``, the param groups (parameter names, shapes, hyper-parameters) and
  any non-tensor state values.

:func:`load_inner_state` takes them back only when they match (same optimizer, run config hash, checkpoint digest,
parameter names and shapes); otherwise the optimizer starts fresh and the caller says why in one line.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file

from geomesh_p2p.util.atomic import atomic_write

__all__ = ["INNER_FORMAT", "inner_paths", "save_inner_state", "load_inner_state", "remove_inner_state"]

INNER_FORMAT = "geomesh-inner-v1"


def inner_paths(directory: str | os.PathLike, stem: str) -> tuple[Path, Path]:
    """``(tensors, record)`` paths of the inner state beside checkpoint ``stem`` (``ckpt-NNNNNNNN``)."""
    d = Path(directory)
    return d / f"{stem}.inner.safetensors", d / f"{stem}.inner.json"


def remove_inner_state(directory: str | os.PathLike, stem: str) -> None:
    """Delete the inner state of checkpoint ``stem`` (record first); files already gone are skipped."""
    tensors, record = inner_paths(directory, stem)
    for p in (record, tensors):
        p.unlink(missing_ok=True)


def _named_state(
    trainer, with_tensors: bool = True
) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """(param groups with parameter names and shapes, tensors by ``PARAM:KEY``, non-tensor state by parameter) of
    ``trainer.optimizer``; ``with_tensors=False``: the groups only (no reference to the state is kept). Raises
    ValueError for a multi-rank peer (each rank steps its own optimizer, or shards: rank 0's state alone would set
    the ranks apart) or when a parameter the optimizer steps is not one of ``trainer.model``'s."""
    if getattr(trainer, "channel", None) is not None:  # RankedTrainer (model/ranks.py)
        raise ValueError("a multi-rank peer: each rank holds its own inner optimizer state")
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    groups: list[dict[str, Any]] = []
    tensors: dict[str, torch.Tensor] = {}
    other: dict[str, dict[str, Any]] = {}
    for g in trainer.optimizer.param_groups:
        params = []
        for p in g["params"]:
            n = names.get(id(p))
            if n is None:
                raise ValueError("the inner optimizer steps parameters that are not the model's (sharded?)")
            params.append([n, list(p.shape)])
            if not with_tensors:
                continue
            # list(): taken at once (under --eager the next round's first steps may fill a state meanwhile)
            for k, v in list(trainer.optimizer.state.get(p, {}).items()):
                if isinstance(v, torch.Tensor):
                    tensors[f"{n}:{k}"] = v.detach()
                else:
                    other.setdefault(n, {})[k] = v
        hyper = {k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, str, bool, list, tuple))}
        groups.append({"params": params, **hyper})
    return groups, tensors, other


def save_inner_state(
    trainer, directory: str | os.PathLike, stem: str, *, round: int, digest: str, config_hash: Optional[str]
) -> Path:
    """Write ``trainer``'s inner optimizer state and ``global_step`` beside checkpoint ``stem`` (each file atomic:
    a temp file fsynced and renamed; the caller's checkpoint JSON, written after, commits them). Worker thread.
    Returns the record's path.

    Raises:
        ValueError: the optimizer steps parameters that are not the model's (a multi-rank peer's shards).
            OSError: the directory cannot be written, the disk is full.
    """
    groups, tensors, other = _named_state(trainer)
    record = {
        "format": INNER_FORMAT,
        "round": int(round),
        "digest": str(digest),
        "run_config_hash": config_hash,
        "optimizer": getattr(trainer, "optimizer_name", type(trainer.optimizer).__name__.lower()),
        "global_step": int(trainer.global_step),
        "param_groups": groups,
        "other_state": other,
        "tensors": stem + ".inner.safetensors",
    }
    text = json.dumps(record, indent=1, sort_keys=True, default=str)
    tpath, rpath = inner_paths(directory, stem)
    meta = {"format": INNER_FORMAT, "round": str(int(round)), "digest": str(digest)}
    # safetensors writes a CPU tensor from its memory (0.8: no second copy of the moments; as save_checkpoint's
    # weights); a GPU peer's state is copied to the host first
    host = {k: (t if t.device.type == "cpu" else t.to("cpu")).contiguous() for k, t in tensors.items()}
    atomic_write(tpath, lambda tmp: save_file(host, tmp, metadata=meta))

    def write_record(tmp: str) -> None:
        Path(tmp).write_text(text, encoding="utf-8")

    atomic_write(rpath, write_record)
    return rpath


def load_inner_state(
    trainer, directory: str | os.PathLike, stem: str, *, round: int, digest: str, config_hash: Optional[str]
) -> tuple[bool, str]:
    """Load the inner state beside checkpoint ``stem`` into ``trainer`` (its optimizer's state and
    ``global_step``; the param groups' hyper-parameters stay this run's). Worker thread.

    Returns ``(True, "step N")`` when loaded, else ``(False, why)`` with the optimizer untouched: ``"missing"`` (no
    file: a checkpoint of an older release) or the first mismatch (another optimizer, run config, checkpoint
    digest, parameter names or shapes; an unreadable or non-finite file). Never raises for a bad file.
    """
    tpath, rpath = inner_paths(directory, stem)
    if not rpath.exists():
        return False, "missing"
    try:
        rec = json.loads(rpath.read_text(encoding="utf-8"))
        if not isinstance(rec, dict) or rec.get("format") != INNER_FORMAT:
            return False, f"{rpath.name}: not a {INNER_FORMAT} record"
        saved = load_file(str(tpath))
    except Exception as e:  # a damaged file costs the moments only, never the resume
        return False, f"unreadable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    try:
        groups = _named_state(trainer, with_tensors=False)[0]
    except ValueError as e:
        return False, str(e)
    mine = getattr(trainer, "optimizer_name", type(trainer.optimizer).__name__.lower())
    checks = [
        (rec.get("optimizer") == mine, f"optimizer {rec.get('optimizer')!r} there, {mine!r} here"),
        (rec.get("run_config_hash") == config_hash, "another run config"),
        (
            rec.get("round") == int(round) and rec.get("digest") == str(digest),
            f"saved with round {rec.get('round')} digest {str(rec.get('digest'))[:8]}, "
            f"the checkpoint is round {round} digest {str(digest)[:8]}",
        ),
        (
            [g.get("params") for g in rec.get("param_groups") or []] == [g["params"] for g in groups],
            "other parameter names or shapes",
        ),
    ]
    for ok, why in checks:
        if not ok:
            return False, why
    sd = trainer.optimizer.state_dict()  # this run's param groups (hyper-parameters), parameters by index
    other = rec.get("other_state") or {}
    state: dict[int, dict[str, Any]] = {}
    index = 0
    for g in groups:
        for name, shape in g["params"]:
            keys = sorted(k.split(":", 1)[1] for k in saved if k.split(":", 1)[0] == name)
            entry: dict[str, Any] = dict(other.get(name) or {})
            for k in keys:
                t = saved[f"{name}:{k}"]
                if k in ("exp_avg", "exp_avg_sq") and list(t.shape) != shape:
                    return False, f"{name}:{k} has shape {list(t.shape)}, the parameter {shape}"
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    return False, f"{name}:{k} holds non-finite values"
                entry[k] = t
            if entry:
                state[index] = entry
            index += 1
    gs = rec.get("global_step")
    if type(gs) is not int or gs < 0:
        return False, f"global_step {gs!r:.20} is not a step count"
    trainer.optimizer.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
    trainer.global_step = gs
    steps = [float(e["step"]) for e in state.values() if isinstance(e.get("step"), torch.Tensor)]
    return True, f"step {int(max(steps)) if steps and math.isfinite(max(steps)) else gs}"
