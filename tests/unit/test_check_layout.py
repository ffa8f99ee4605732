"""scripts/check_layout.py: the line cap and the in-function project imports, on small files in a temp root."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_layout.py"


def _load():
    spec = importlib.util.spec_from_file_location("check_layout", _SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


cl = _load()


def _write(root: Path, rel: str, text: str) -> str:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return rel


def _check(root: Path, *paths: str, long_files=None, allowed=None) -> list[str]:
    return [str(f) for f in cl.check(root, list(paths), long_files or {}, allowed or {})]


def test_801_lines_is_reported_800_is_not(tmp_path):
    _write(tmp_path, "geomesh_p2p/a.py", "x = 1\n" * 800)
    _write(tmp_path, "geomesh_p2p/b.py", "x = 1\n" * 801)
    assert _check(tmp_path, "geomesh_p2p") == [
        "geomesh_p2p/b.py:1: 801 lines, over the cap of 800 (split the file by concern)"
    ]


def test_a_last_line_without_newline_counts(tmp_path):
    _write(tmp_path, "geomesh_p2p/a.py", "x = 1\n" * 800 + "y = 2")
    assert [f.split(":", 2)[2] for f in _check(tmp_path, "geomesh_p2p")] == [
        " 801 lines, over the cap of 800 (split the file by concern)"
    ]


def test_generated_and_listed_long_files_are_excepted(tmp_path):
    _write(tmp_path, "geomesh_p2p/wire/x_pb2.py", "x = 1\n" * 900)
    _write(tmp_path, "geomesh_p2p/wire/x_pb2_grpc.py", "x = 1\n" * 900)
    _write(tmp_path, "geomesh_p2p/big.py", "x = 1\n" * 900)
    assert _check(tmp_path, "geomesh_p2p", long_files={"geomesh_p2p/big.py": "being split"}) == []


def test_a_listed_long_file_now_under_the_cap_is_reported(tmp_path):
    _write(tmp_path, "geomesh_p2p/big.py", "x = 1\n")
    (finding,) = _check(tmp_path, "geomesh_p2p", long_files={"geomesh_p2p/big.py": "being split"})
    assert finding.startswith("geomesh_p2p/big.py:1: 1 lines, now under the cap: remove it from LONG_FILES")


IN_FUNCTION = """\
import os
from geomesh_p2p.util import aio


def f():
    import json
    import datasets
    from lion_pytorch import Lion
    from geomesh_p2p.net.addr import parse_address
    return parse_address


class C:
    async def g(self):
        import peer.cli

        def inner():
            from . import sibling
            from ..dht import node
"""


def test_in_function_project_imports_are_reported_top_level_and_third_party_are_not(tmp_path):
    _write(tmp_path, "geomesh_p2p/pkg/mod.py", IN_FUNCTION)
    assert _check(tmp_path, "geomesh_p2p") == [
        "geomesh_p2p/pkg/mod.py:9: project import of geomesh_p2p.net.addr inside a function (move it to the module top)",
        "geomesh_p2p/pkg/mod.py:15: project import of peer.cli inside a function (move it to the module top)",
        "geomesh_p2p/pkg/mod.py:18: project import of geomesh_p2p.pkg inside a function (move it to the module top)",
        "geomesh_p2p/pkg/mod.py:19: project import of geomesh_p2p.dht inside a function (move it to the module top)",
    ]


def test_allowed_in_function_imports_are_not_reported_and_stale_entries_are(tmp_path):
    _write(tmp_path, "peer/cli.py", "def main():\n    from geomesh_p2p.dht import live_peers\n")
    allowed = {
        ("peer/cli.py", "geomesh_p2p.dht"): "CLI start-up",
        ("peer/cli.py", "geomesh_p2p.net.transport"): "gone",
        ("peer/other.py", "geomesh_p2p.net"): "a file not checked this time",
    }
    assert _check(tmp_path, "peer", allowed=allowed) == [
        "peer/cli.py:1: no in-function import of geomesh_p2p.net.transport left: remove it from IN_FUNCTION_IMPORTS"
    ]


def test_main_prints_findings_and_exits_1(tmp_path, capsys):
    _write(tmp_path, "bootstrap/tool.py", "def main():\n    import geomesh_p2p.dht\n")
    _write(tmp_path, "bootstrap/__init__.py", "")
    assert cl.main(["--root", str(tmp_path), "bootstrap"]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "bootstrap/tool.py:2: project import of geomesh_p2p.dht inside a function (move it to the module top)"
    ]
    _write(tmp_path, "bootstrap/tool.py", "import geomesh_p2p.dht\n\n\ndef main():\n    pass\n")
    assert cl.main(["--root", str(tmp_path), "bootstrap"]) == 0
    assert capsys.readouterr().out == ""


def test_help_and_a_missing_path(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cl.main(["--help"])
    assert e.value.code == 0
    assert "800 lines" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cl.main(["--root", str(tmp_path), "nowhere"])
    assert e.value.code == 2
    assert "no such file or folder" in capsys.readouterr().err
