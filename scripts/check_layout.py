#!/usr/bin/env python3
"""Check two layout rules that ruff, mypy and import-linter do not: file length and in-function imports.

Run by ``make lint`` (and ``make test``) from the repository root::

    python scripts/check_layout.py                    # geomesh_p2p/, peer/, bootstrap/
    python scripts/check_layout.py --root DIR PATH..  # PATHs (files or folders) relative to DIR

Rules, over every ``*.py`` file under the given paths:

1. **Line cap.** No file over :data:`MAX_LINES` lines (as ``wc -l`` counts them, one per line ending; a last line
   without one counts too). Generated protobuf code (``*_pb2.py``, ``*_pb2_grpc.py``) is excepted, and so are the
   files in :data:`LONG_FILES`, each with the reason it is still long.
2. **Imports at module top.** No import of a project module (:data:`PROJECT_PACKAGES`, or a relative import) inside
   a function or method: a module's dependencies are read from its top, and import-linter's layers are then the
   whole story. Third-party imports inside functions (optional extras such as ``datasets``, ``lion_pytorch``,
   ``matplotlib``) are not project imports and are not checked. The exceptions are :data:`IN_FUNCTION_IMPORTS`,
   keyed by (file, imported module), each with a one-line reason.

An exception that no longer matches anything (a file now under the cap, an import gone from the function) is
reported too, so the lists only shrink. Each finding is printed as ``path:line: message``; the exit status is 1
when there is any, else 0.

Uses the standard library only (``ast``), so it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

#: Most lines a source file may have.
MAX_LINES = 800

#: Top-level packages whose modules count as project imports.
PROJECT_PACKAGES = frozenset({"geomesh_p2p", "peer", "bootstrap"})

#: Folders checked when no path is given (relative to the repository root).
DEFAULT_PATHS = ("geomesh_p2p", "peer", "bootstrap")

#: Files allowed over :data:`MAX_LINES` for now (path relative to the root -> reason). Trim as splits land.
LONG_FILES: dict[str, str] = {}

#: Project imports allowed inside a function: (path relative to the root, imported module) -> one-line reason.
#: The imported module is the absolute dotted name (``from a.b import c`` -> ``a.b``; relative imports resolved).
_CLI = "CLI: each command imports what it needs, so --help and the light commands start fast"
IN_FUNCTION_IMPORTS: dict[tuple[str, str], str] = {
    # the command-line programs
    ("bootstrap/cli.py", "geomesh_p2p.dht"): _CLI,
    ("bootstrap/cli.py", "geomesh_p2p.dht.progress"): _CLI,
    ("bootstrap/cli.py", "geomesh_p2p.net.identity"): _CLI,
    ("bootstrap/cli.py", "geomesh_p2p.net.links"): _CLI,
    ("bootstrap/cli.py", "geomesh_p2p.net.transport"): _CLI,
    ("bootstrap/cli.py", "geomesh_p2p.status.http"): _CLI,
    ("bootstrap/cli.py", "geomesh_p2p.status.swarm"): _CLI,
    ("bootstrap/cli.py", "geomesh_p2p.trust.admission"): _CLI,
    ("peer/cli.py", "peer"): "node_cli/tools_cli are optional (ImportError: the commands say 'not built yet')",
    ("peer/cli.py", "geomesh_p2p.net.identity"): _CLI,
    ("peer/demo.py", "peer.node_cli"): "node_cli and demo import each other: both import late",
    ("peer/node_cli.py", "peer"): "node_cli and demo import each other: both import late",
    ("peer/node_cli.py", "geomesh_p2p.data"): _CLI,
    ("peer/node_cli.py", "geomesh_p2p.data.corpus"): _CLI,
    ("peer/node_cli.py", "geomesh_p2p.data.hub"): _CLI,
    ("peer/node_cli.py", "geomesh_p2p.dht"): _CLI,
    ("peer/node_cli.py", "geomesh_p2p.node.host"): _CLI,
    ("peer/node_cli.py", "geomesh_p2p.node.checkpoints"): _CLI,
    ("peer/node_cli.py", "geomesh_p2p.model.state"): _CLI,
    ("peer/node_cli.py", "geomesh_p2p.net.identity"): _CLI,
    ("peer/node_cli.py", "geomesh_p2p.net.links"): _CLI,
    ("peer/node_cli.py", "geomesh_p2p.net.transport"): _CLI,
    ("peer/node_cli.py", "geomesh_p2p.node.peer"): _CLI,
    ("peer/node_cli.py", "geomesh_p2p.node.ranks"): _CLI,
    ("peer/node_cli.py", "geomesh_p2p.telemetry.events"): _CLI,
    ("peer/node_cli.py", "geomesh_p2p.trust.admission"): _CLI,
    ("peer/tools_cli.py", "geomesh_p2p.dht"): _CLI,
    ("peer/tools_cli.py", "geomesh_p2p.model.export"): _CLI,
    ("peer/tools_cli.py", "geomesh_p2p.net.identity"): _CLI,
    ("peer/tools_cli.py", "geomesh_p2p.net.transport"): _CLI,
    ("peer/tools_cli.py", "geomesh_p2p.status.swarm"): _CLI,
    ("geomesh_p2p/sim/cli.py", "geomesh_p2p.data"): "CLI: torch is loaded only by the commands that train",
    ("geomesh_p2p/sim/cli.py", "geomesh_p2p.sim"): "CLI: torch is loaded only by the commands that train (report)",
    ("geomesh_p2p/sim/cli.py", "geomesh_p2p.sim.engine"): "CLI: torch is loaded only by the commands that train",
    ("bootstrap/cli.py", "geomesh_p2p.net.transport_config"): _CLI,
    ("bootstrap/cli.py", "geomesh_p2p.net.tls"): _CLI,
    ("peer/node_cli.py", "geomesh_p2p.model.build"): _CLI,
    ("peer/node_cli.py", "geomesh_p2p.node.training"): _CLI,
    ("peer/node_cli.py", "geomesh_p2p.model.profile"): _CLI,
    ("peer/node_cli.py", "geomesh_p2p.sync.download"): _CLI,
    ("peer/node_cli.py", "geomesh_p2p.net.transport_config"): _CLI,
    ("peer/tools_cli.py", "geomesh_p2p.net.transport_config"): _CLI,
    ("peer/tools_cli.py", "geomesh_p2p.dht.state"): _CLI,
    ("peer/node_cli.py", "geomesh_p2p.dht.preflight"): _CLI,
    ("peer/node_cli.py", "geomesh_p2p.net.tls"): _CLI,
    ("geomesh_p2p/sim/cli.py", "geomesh_p2p.model.build"): "CLI: torch is loaded only by the commands that train",
    # the library
    ("geomesh_p2p/dht/progress.py", "geomesh_p2p.dht.state"): "hivemind: a --state-file is read before its import",
}


@dataclass(frozen=True)
class Finding:
    """One violation: ``path`` (as given, relative to the root), 1-based ``line``, and what is wrong."""

    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


def count_lines(text: str) -> int:
    """Lines as ``wc -l`` counts them, plus a last line without a line ending."""
    return len(text.splitlines())


def is_generated(path: str) -> bool:
    """Generated protobuf/gRPC code (``*_pb2.py``, ``*_pb2_grpc.py``), excepted from the line cap."""
    name = Path(path).name
    return name.endswith("_pb2.py") or name.endswith("_pb2_grpc.py")


def module_name(path: str) -> str:
    """The dotted module name of a file path relative to the root (``a/b/__init__.py`` -> ``a.b``)."""
    parts = list(Path(path).with_suffix("").parts)
    if parts and parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, path: str) -> str:
    """The absolute module a ``from ... import`` names; relative ones resolved against ``path``'s package."""
    if not node.level:
        return node.module or ""
    package = module_name(path).split(".")
    if Path(path).name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
    return ".".join([*base, node.module] if node.module else base)


def _is_project(module: str) -> bool:
    return module.split(".")[0] in PROJECT_PACKAGES


def in_function_imports(tree: ast.AST, path: str) -> list[tuple[int, str]]:
    """(line, imported module) of each project import inside a function or method of ``tree``."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, ast.Import):
                found.extend((child.lineno, a.name) for a in child.names if _is_project(a.name))
            elif in_function and isinstance(child, ast.ImportFrom):
                module = _resolve(child, path)
                if child.level or _is_project(module):
                    found.append((child.lineno, module))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def check_file(
    root: Path,
    path: str,
    long_files: dict[str, str] | None = None,
    allowed: dict[tuple[str, str], str] | None = None,
) -> tuple[list[Finding], set[tuple[str, str]]]:
    """The findings for one file (``path`` relative to ``root``), and the allow-list keys it used.

    ``long_files`` and ``allowed`` default to :data:`LONG_FILES` and :data:`IN_FUNCTION_IMPORTS`.
    """
    long_files = LONG_FILES if long_files is None else long_files
    allowed = IN_FUNCTION_IMPORTS if allowed is None else allowed
    text = (root / path).read_text(encoding="utf-8")
    findings: list[Finding] = []
    used: set[tuple[str, str]] = set()
    n = count_lines(text)
    if n > MAX_LINES and not is_generated(path) and path not in long_files:
        findings.append(Finding(path, 1, f"{n} lines, over the cap of {MAX_LINES} (split the file by concern)"))
    elif n <= MAX_LINES and path in long_files:
        findings.append(Finding(path, 1, f"{n} lines, now under the cap: remove it from LONG_FILES in {_SELF}"))
    try:
        tree = ast.parse(text, filename=path)
    except SyntaxError as e:
        return findings + [Finding(path, e.lineno or 1, f"syntax error: {e.msg}")], used
    for line, module in in_function_imports(tree, path):
        key = (path, module)
        if key in allowed:
            used.add(key)
            continue
        findings.append(
            Finding(path, line, f"project import of {module} inside a function (move it to the module top)")
        )
    return findings, used


def python_files(root: Path, paths: list[str]) -> list[str]:
    """Every ``*.py`` file under ``paths`` (files or folders relative to ``root``), relative to ``root``, sorted."""
    files: set[str] = set()
    for p in paths:
        full = root / p
        if full.is_dir():
            files.update(f.relative_to(root).as_posix() for f in full.rglob("*.py"))
        elif full.is_file():
            files.add(Path(p).as_posix())
        else:
            raise FileNotFoundError(f"no such file or folder: {full}")
    return sorted(files)


def check(
    root: Path,
    paths: list[str],
    long_files: dict[str, str] | None = None,
    allowed: dict[tuple[str, str], str] | None = None,
) -> list[Finding]:
    """All findings for the files under ``paths``, stale allow-list entries of those files included."""
    allowed = IN_FUNCTION_IMPORTS if allowed is None else allowed
    findings: list[Finding] = []
    used: set[tuple[str, str]] = set()
    files = python_files(root, paths)
    for path in files:
        f, u = check_file(root, path, long_files, allowed)
        findings += f
        used |= u
    scanned = set(files)
    for key in sorted(set(allowed) - used):
        if key[0] in scanned:
            findings.append(
                Finding(key[0], 1, f"no in-function import of {key[1]} left: remove it from IN_FUNCTION_IMPORTS")
            )
    return findings


_SELF = "scripts/check_layout.py"


def main(argv: list[str] | None = None) -> int:
    """Command line: print each finding, return 1 if any (else 0)."""
    parser = argparse.ArgumentParser(
        description=(
            f"Layout rules: no Python file over {MAX_LINES} lines (generated *_pb2 files and LONG_FILES excepted); "
            "no import of a project module (geomesh_p2p, peer, bootstrap, or relative) inside a function "
            "(IN_FUNCTION_IMPORTS excepted). Prints path:line: message per finding; exit status 1 if any."
        )
    )
    parser.add_argument(
        "paths", nargs="*", help=f"files or folders relative to --root (default: {' '.join(DEFAULT_PATHS)})"
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(__file__).resolve().parent.parent,
        help="the repository root (default: this script's parent folder's parent)",
    )
    args = parser.parse_args(argv)
    try:
        findings = check(args.root, args.paths or list(DEFAULT_PATHS))
    except FileNotFoundError as e:
        parser.error(str(e))  # exits 2
    for f in findings:
        print(f)
    if findings:
        print(f"{len(findings)} layout finding(s); rules and exceptions: {_SELF}", file=sys.stderr)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
