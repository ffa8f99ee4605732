"""The README documents the layout of ``geomesh-peer status --json`` (fresh user 48: it was not, and ``["round"]``
raised KeyError: the round is at ``["swarm"]["round"]``): every key the status view writes is named there."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]


def _view_keys() -> set[str]:
    """The string keys of every dict literal of ``SwarmWatcher`` (the rows of /api/swarm and /api/rounds)."""
    tree = ast.parse((ROOT / "geomesh_p2p/status/swarm.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SwarmWatcher"]
    return {
        k.value
        for n in ast.walk(cls)
        if isinstance(n, ast.Dict)
        for k in n.keys
        if isinstance(k, ast.Constant) and isinstance(k.value, str)
    }


def test_the_readme_documents_every_key_of_status_json():
    readme = (ROOT / "README.md").read_text()
    assert '`geomesh-peer status --json` prints one object, `{"swarm": {...}, "rounds": [...]}`' in readme
    assert '`["swarm"]["round"]`' in readme
    keys = _view_keys()
    assert {"round", "peers", "plan", "digests", "eval_ppl"} <= keys  # the parse found the rows
    assert sorted(k for k in keys if f"`{k}`" not in readme) == []
    # and the command prints that object
    assert 'json.dumps({"swarm": view, "rounds": rounds.get("rounds", [])}' in (ROOT / "peer/tools_cli.py").read_text()
