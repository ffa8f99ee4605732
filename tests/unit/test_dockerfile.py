"""The Dockerfile's invariants, checked without a Docker engine (none runs in CI): a multi-stage build
whose torch comes from PyTorch's CPU index by default, a non-editable install without test extras, a
non-root user, the ``geomesh-peer`` entry point, the ports and volumes the docs use, a ``.dockerignore``
that sends only what the image installs; and every ``docker run`` example of docs/docker.md and the
README goes through the real argument parsers (so each flag it shows exists and takes that value)."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "docs" / "docker.md", ROOT / "README.md"]
IMAGE = "geomesh-p2p"  # the tag the docs build and run


def _instructions(path: Path) -> list[tuple[str, str]]:
    """``[(INSTRUCTION, arguments)]`` of a Dockerfile: comments dropped, ``\\`` continuations joined."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in path.read_text().splitlines():
        s = line.strip()
        if not buf and (not s or s.startswith("#")):
            continue
        if s.startswith("#"):  # a comment inside a continued instruction
            continue
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        buf += s
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, "Dockerfile ends inside a continued line"
    return out


def _stages(ins: list[tuple[str, str]]) -> tuple[dict[str, str], list[list[tuple[str, str]]]]:
    """Global ARG defaults (before the first FROM) and the instructions of each stage (FROM first)."""
    args: dict[str, str] = {}
    stages: list[list[tuple[str, str]]] = []
    for word, rest in ins:
        if word == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((word, rest))
        elif word == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
    return args, stages


def _arg_defaults(stage: list[tuple[str, str]]) -> dict[str, str]:
    return {name: default for word, rest in stage if word == "ARG" for name, _, default in [rest.partition("=")]}


@pytest.fixture(scope="module")
def dockerfile():
    ins = _instructions(ROOT / "Dockerfile")
    global_args, stages = _stages(ins)
    return global_args, stages


@pytest.fixture(scope="module")
def project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _base_image(from_args: str, global_args: dict[str, str]) -> str:
    image = from_args.split()[0]
    return re.sub(r"\$\{?(\w+)\}?", lambda m: global_args[m.group(1)], image)


def test_multi_stage_on_a_python_slim_base_the_project_supports(dockerfile, project):
    global_args, stages = dockerfile
    assert len(stages) >= 2, "multi-stage: a build stage and a runtime stage"
    bases = [_base_image(st[0][1], global_args) for st in stages]
    assert bases[-1] == "python:3.11-slim"
    assert all(b == bases[-1] for b in bases), "the venv is copied between stages: same Python in both"
    # the base's Python satisfies requires-python (">=3.10")
    minimum = project["project"]["requires-python"].removeprefix(">=")
    assert tuple(map(int, "3.11".split("."))) >= tuple(map(int, minimum.split(".")))
    runtime = stages[-1]
    assert ("COPY", "--from=build /opt/venv /opt/venv") in runtime
    assert not any(w == "RUN" and "pip install" in r for w, r in runtime), "nothing is built in the runtime stage"


def test_torch_from_the_cpu_index_by_default(dockerfile):
    _, stages = dockerfile
    build = stages[0]
    args = _arg_defaults(build)
    assert args["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    assert args["TORCH"] == "torch==2.13.0"
    runs = [r for w, r in build if w == "RUN"]
    torch_runs = [r for r in runs if '"$TORCH"' in r]
    assert torch_runs == ['pip install --index-url "$TORCH_INDEX" "$TORCH"']
    # torch goes in before the project, so the project's "torch>=2.1,<3" is already satisfied
    project_run = next(i for i, r in enumerate(runs) if "/src" in r and "pip install" in r)
    assert runs.index(torch_runs[0]) < project_run


def test_non_editable_install_without_test_extras(dockerfile):
    _, stages = dockerfile
    runs = [r for st in stages for w, r in st if w == "RUN"]
    installs = [r for r in runs if "pip install" in r]
    assert len(installs) == 2
    for r in installs:
        assert not re.search(r"(^|\s)(-e|--editable)(\s|$)", r), r
        assert "test" not in r and "pytest" not in r, r
    assert _arg_defaults(stages[0])["EXTRAS"] == "", "no extras unless asked for"
    assert not any("make" in r.split() for r in runs), "make setup installs the test extras"


def test_runs_as_a_non_root_user(dockerfile):
    _, stages = dockerfile
    runtime = stages[-1]
    users = [(i, r) for i, (w, r) in enumerate(runtime) if w == "USER"]
    assert users, "the runtime stage sets a USER"
    i, user = users[-1]
    assert user not in ("root", "0") and not user.startswith("0:")
    assert any(w == "RUN" and "useradd" in r and r.split("&&")[0].split()[-1] == user for w, r in runtime)
    # nothing after USER runs as root again, and the entry point comes after it
    assert all(w != "USER" for w, _ in runtime[i + 1 :])
    assert any(w == "ENTRYPOINT" for w, _ in runtime[i + 1 :])


def test_entry_point_is_the_peer_cli(dockerfile, project):
    _, stages = dockerfile
    runtime = dict((w, r) for w, r in stages[-1] if w in ("ENTRYPOINT", "CMD"))
    assert json.loads(runtime["ENTRYPOINT"]) == ["geomesh-peer"]  # exec form: signals reach the peer
    assert json.loads(runtime["CMD"]) == ["--help"]
    scripts = project["project"]["scripts"]
    assert scripts["geomesh-peer"] == "peer.cli:main" and scripts["geomesh-bootstrap"] == "bootstrap.cli:main"


def test_ports_and_volumes(dockerfile):
    from bootstrap.cli import build_parser as bootstrap_parser
    from peer.cli import build_parser

    _, stages = dockerfile
    runtime = stages[-1]
    exposed = {p for w, r in runtime if w == "EXPOSE" for p in r.split()}
    assert exposed == {"31337", "9100"}
    assert bootstrap_parser().get_default("port") == 31337  # the bootstrap's default port is the exposed one
    volumes = {v for w, r in runtime if w == "VOLUME" for v in json.loads(r)}
    assert volumes == {"/home/geomesh/.geomesh", "/data", "/checkpoints"}
    user = [r for w, r in runtime if w == "USER"][-1]
    assert ("WORKDIR", f"/home/{user}") in runtime
    # the default identity files live in the identity volume (HOME of the user)
    for default in (build_parser().parse_args(["join"]).identity, bootstrap_parser().get_default("identity")):
        assert default.startswith("~/.geomesh/"), default
        assert str(Path(f"/home/{user}") / default[2:]).startswith("/home/geomesh/.geomesh/")


def _ignored(name: str, patterns: list[str]) -> bool:
    """Whether a top-level context entry is excluded by .dockerignore patterns (last match wins)."""
    ignored = False
    for p in patterns:
        neg = p.startswith("!")
        pat = p[1:] if neg else p
        if fnmatch.fnmatchcase(name, pat) or fnmatch.fnmatchcase(name, pat.removeprefix("**/")):
            ignored = not neg
    return ignored


def test_dockerignore_sends_only_what_the_image_installs(dockerfile, project):
    patterns = [s for s in ((ROOT / ".dockerignore").read_text().splitlines()) if s.strip() and not s.startswith("#")]
    for heavy in (".venv", ".git", "runs", "checkpoints", "tests", "benchmarks", "docs", ".hypothesis"):
        assert _ignored(heavy, patterns), heavy
    _, stages = dockerfile
    sources = [
        src for st in stages for w, r in st if w == "COPY" and not r.startswith("--from") for src in r.split()[:-1]
    ]
    assert sources == ["pyproject.toml", "README.md", "geomesh_p2p", "peer", "bootstrap"]
    for src in sources:
        assert (ROOT / src).exists(), src
        assert not _ignored(src, patterns), f"{src} is copied but .dockerignore leaves it out"
    # what the build needs: the readme pyproject names and every package it installs
    assert project["project"]["readme"] in sources
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= set(sources)


# ------------------------------------------------------------------------------ the docs' examples


def _shell_lines(path: Path) -> list[str]:
    """The commands of the fenced ``bash`` blocks of a Markdown file, continuation lines joined."""
    lines, buf, inside = [], "", False
    for raw in path.read_text().splitlines():
        s = raw.strip()
        if s.startswith("```"):
            inside = s == "```bash" if not inside else False
            continue
        if not inside:
            continue
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        lines.append(buf + s)
        buf = ""
    return lines


def _docker_commands(kind: str) -> list[list[str]]:
    out = []
    for path in DOCS:
        for line in _shell_lines(path):
            if line.startswith(f"docker {kind} "):
                out.append(shlex.split(line, comments=True))
    return out


def _split_run(words: list[str]) -> tuple[list[str], str, list[str]]:
    """``docker run OPTIONS IMAGE ARGS`` -> (options, image, args); the image is the first word naming ours."""
    i = next(k for k, w in enumerate(words) if w.split(":")[0] == IMAGE)
    return words[2:i], words[i], words[i + 1 :]


def _option(opts: list[str], name: str) -> list[str]:
    return [opts[k + 1] for k, w in enumerate(opts) if w == name]


def test_every_docker_run_example_parses():
    from bootstrap.cli import build_parser as bootstrap_parser
    from peer.cli import build_parser as peer_parser

    runs = _docker_commands("run")
    assert len(runs) >= 8
    kinds = set()
    for words in runs:
        opts, _, args = _split_run(words)
        entry = _option(opts, "--entrypoint") or ["geomesh-peer"]
        assert entry[0] in ("geomesh-peer", "geomesh-bootstrap"), entry
        parser = peer_parser() if entry[0] == "geomesh-peer" else bootstrap_parser()
        try:
            ns = parser.parse_args(args)
        except SystemExit as e:  # argparse's way of refusing a flag
            pytest.fail(f"{' '.join(words)}: the CLI refuses it (exit {e.code})")
        for vol in _option(opts, "-v"):
            target = vol.split(":")[1]
            if target.startswith("/run/secrets/"):  # a key mounted read-only as a secret, named by --identity
                assert vol.endswith(":ro") and ns.identity == target, vol
                continue
            assert target in ("/home/geomesh/.geomesh", "/data", "/checkpoints"), vol
        published = [p.split(":") for p in _option(opts, "-p")]
        for host_port, container_port in published:
            assert host_port == container_port, "peers announce the container's port: publish it unchanged"
        if getattr(ns, "command", None) == "join" or entry[0] == "geomesh-bootstrap":
            reachable = (
                ns.host == "0.0.0.0"
                and ns.advertise_host
                and ([str(ns.port), str(ns.port)] in published or "host" in _option(opts, "--network"))
            )
            if getattr(ns, "client_only", False):
                assert not published, "a client-only peer accepts no connections"
                kinds.add("client-only")
            else:
                assert reachable, f"{' '.join(words)}: not reachable from outside the container"
                kinds.add("reachable " + entry[0])
            if getattr(ns, "metrics_port", None) is not None:
                kinds.add("metrics")
            if getattr(ns, "checkpoint_dir", None) is not None:
                assert ns.checkpoint_dir == "/checkpoints"
            if getattr(ns, "data", None) is not None and not ns.data.startswith("hf:"):
                assert ns.data.startswith("/data/")
    assert kinds == {"client-only", "reachable geomesh-peer", "reachable geomesh-bootstrap", "metrics"}


def test_every_build_arg_in_the_docs_is_declared(dockerfile):
    global_args, stages = dockerfile
    declared = set(global_args) | {n for st in stages for n in _arg_defaults(st)}
    builds = _docker_commands("build")
    assert builds
    used = {w.split("=")[0] for words in builds for k, w in enumerate(words) if words[k - 1] == "--build-arg"}
    used |= set(re.findall(r"--build-arg (\w+)=", "\n".join(p.read_text() for p in DOCS)))
    assert used and used <= declared, used - declared
    assert {"TORCH_INDEX", "TORCH", "EXTRAS", "PYTHON_IMAGE"} <= declared


def test_writes_only_to_volumes_so_a_read_only_root_works(dockerfile):
    """Issue 29 #6: ``docker run --read-only`` (docs/docker.md): the caches the node writes (tokenizers, token
    ids; Hugging Face and torch downloads follow ``XDG_CACHE_HOME``) lie in a declared volume, and the docs
    show a read-only run with the key as a secret."""
    _, stages = dockerfile
    runtime = stages[-1]
    env = " ".join(r for w, r in runtime if w == "ENV")
    cache = re.search(r"XDG_CACHE_HOME=(\S+)", env)
    assert cache, "the runtime sets XDG_CACHE_HOME"
    volumes = {v for w, r in runtime if w == "VOLUME" for v in json.loads(r)}
    assert any(cache.group(1) == v or cache.group(1).startswith(v + "/") for v in volumes), cache.group(1)
    read_only = [w for w in _docker_commands("run") if "--read-only" in w]
    assert read_only and any(
        any(v.startswith("/run/secrets/") for v in _option(_split_run(w)[0], "-v")) or "/run/secrets/" in " ".join(w)
        for w in read_only
    )
