"""``geomesh-peer``: join a GeoMesh swarm as a volunteer, run a local demo swarm, or manage identity.

Subcommands:
  identity   create or show this node's Ed25519 key and print its PeerID
  join       train with a swarm reached through one or more bootstrap nodes
  demo       a whole swarm on this machine (bootstrap + N peers as OS processes)
  profile    measure this device (memory, tokens/s per batch size; link bandwidth with --probe)
  status     the swarm's peers, round, leader and digests, read from its DHT through a bootstrap
  checkpoints / export / generate   inspect checkpoints, write one as a Hugging Face folder, sample from it
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import NoReturn

from geomesh_p2p import __version__
from geomesh_p2p.config.flags import (
    ConfigFileError,
    StrictParser,
    add_log_level,
    load_config_defaults,
    unknown_home,
)
from geomesh_p2p.config.models import DEFAULT_IDENTITY
from geomesh_p2p.util.exit_gc import arm_startup_freeze, skip_exit_collections
from geomesh_p2p.util.fds import raise_fd_limit
from geomesh_p2p.util.grpc_env import quiet_grpc_core
from geomesh_p2p.util.malloc import limit_malloc_arenas


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML/JSON file of option values (flags on the command line win)")
    add_log_level(p)
    # after a command too (`geomesh-peer join --version` was refused as an unknown flag: fresh-user trial)
    p.add_argument("--version", action="version", version=f"geomesh-peer {__version__}")


class _Formatter(argparse.HelpFormatter):
    """Each command's help on its name's line: argparse measures command names without the extra
    indent it then prints them with, so a long name (``checkpoints``) would get a line of its own."""

    def add_argument(self, action):
        super().add_argument(action)
        if action.help is not argparse.SUPPRESS and hasattr(action, "_get_subactions"):
            for sub in action._get_subactions():
                self._action_max_length = max(
                    self._action_max_length,
                    len(sub.metavar or sub.dest or "") + self._current_indent + self._indent_increment,
                )


class _Parser(StrictParser):
    """Errors in one line, naming the command whose flag is wrong, without the usage dump (a join's usage is
    ~48 lines above the one useful line): ``geomesh-peer join: error: argument --rounds: must be >= 1, got -1
    (see geomesh-peer join --help)``; exit status 2, as argparse's. Subcommand parsers are of this class too
    (argparse makes them of the parent's class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {self.suggest(message)} (see {self.prog} --help)\n")


def _command_parser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    """The parser of ``command`` (``parser`` itself for None)."""
    if command is None or parser._subparsers is None:
        return parser
    return parser._subparsers._group_actions[0].choices[command]


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, except that an unknown flag after a command is reported by that command's
    parser (``geomesh-peer join: error: unrecognized arguments: --bogus``), not the top level's.
    Raises SystemExit(2) with one line on stderr for a bad flag or value."""
    ns, extra = parser.parse_known_args(argv)
    if extra:
        _command_parser(parser, getattr(ns, "command", None)).error(f"unrecognized arguments: {' '.join(extra)}")
    return ns


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="geomesh-peer",
        formatter_class=_Formatter,
        description="GeoMesh-P2P volunteer node: adaptive workload balancing + sign-compressed DiLoCo over gRPC.",
        epilog="geomesh-peer COMMAND --help explains the flags of a command.",
    )
    ap.add_argument("--version", action="version", version=f"geomesh-peer {__version__}")
    # The commands are listed once, by argparse, from each parser's one-line help.
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    ident = sub.add_parser(
        "identity",
        help="create or show this node's key and print its PeerID",
        description="Create (mode 0600) or show this node's Ed25519 key and print its PeerID.",
    )
    ident.add_argument(
        "--identity",
        default=DEFAULT_IDENTITY,
        metavar="PATH",
        help="Ed25519 key file, created with mode 0600 if absent (default: %(default)s)",
    )
    _add_common(ident)

    try:
        from peer import node_cli  # the training node (join / demo / profile)
    except ImportError:
        node_cli = None
    if node_cli is not None:
        node_cli.add_subcommands(sub, _add_common)
        from peer import tools_cli  # status, checkpoints, export, generate

        tools_cli.add_subcommands(sub, _add_common)
    else:
        for name, text in [
            ("join", "train with a swarm (not built yet)"),
            ("demo", "local demo swarm (not built yet)"),
        ]:
            sp = sub.add_parser(name, help=text)
            _add_common(sp)
    return ap


def cmd_identity(ns: argparse.Namespace) -> int:
    from geomesh_p2p.net.identity import Identity, IdentityError

    try:
        ident = Identity.load_or_create(ns.identity)
    except IdentityError as e:
        print(f"geomesh-peer: {e}", file=sys.stderr)
        return 2
    print(f"PeerID: {ident.peer_id}")
    print(f"short:  {ident.peer_id.short()}")
    # said either way: a mistyped path makes a new identity, and this is where a user looks (fresh-user trial)
    print(f"key:    {ns.identity} ({'created now' if ident.keep_created() else 'loaded'})")
    return 0


def with_config_file(
    parser: argparse.ArgumentParser, ns: argparse.Namespace, argv: list[str] | None
) -> argparse.Namespace:
    """``argv`` parsed again with the values of ``--config FILE`` as the chosen command's defaults:
    a flag on the command line > the file > the field's default. ``ns`` is returned as is without
    --config. Raises ConfigFileError naming the file and the unknown key or bad value."""
    if not getattr(ns, "config", None):
        return ns
    sub = _command_parser(parser, ns.command)
    values = load_config_defaults(sub, ns.config)
    sub.set_defaults(**values)
    out = parse(parser, argv)
    # the options whose value is the file's: a later check's message names the file too (:func:`named_source`)
    out.config_dests = frozenset(d for d, v in values.items() if getattr(out, d, None) == v)
    return out


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # this process's own command line: gRPC's C core quiet unless --log-level DEBUG
        # first: the C core reads GRPC_VERBOSITY once, when grpc is first imported, and this module's imports and
        # the parser's (node_cli, tools_cli) load no grpc (tests/unit/test_start_messages.py); done here, not at the
        # package's import, so that importing the package reads nothing of the process (the test zygote preloads it)
        quiet_grpc_core()
    # The interpreter's exit would otherwise spend seconds to minutes (on a loaded machine) in full collections
    # over torch's and transformers' objects after the node has shut down (geomesh_p2p/util/exit_gc.py).
    skip_exit_collections()
    if argv is None:  # this process's own command line (not main([...]) in a test): freeze the start-up heap
        arm_startup_freeze()
    # first of all: glibc fixes its arena limit when a second thread first allocates (geomesh_p2p/util/malloc.py)
    limit_malloc_arenas()
    parser = build_parser()
    ns = parse(parser, argv)
    if ns.command is None:
        parser.print_help()
        return 0
    try:
        ns = with_config_file(parser, ns, argv)
    except ConfigFileError as e:  # the command's name, as its flags' errors say it (fresh user 49)
        print(f"geomesh-peer {ns.command}: {e}", file=sys.stderr)
        return 2
    home = unknown_home(_command_parser(parser, ns.command), ns)
    if home is not None:  # ~NAME of nobody: pathlib's expanduser raised it as a traceback (red team 43)
        print(f"geomesh-peer {ns.command}: {home}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=getattr(ns, "log_level", "INFO"),
        format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if ns.command == "identity":
        return cmd_identity(ns)
    raise_fd_limit()  # the listeners' and channels' shares of it (geomesh_p2p/util/fds.py) grow with it
    handler = getattr(ns, "handler", None)
    if handler is None:
        print(f"geomesh-peer {ns.command}: not available yet in this build; see README.md", file=sys.stderr)
        return 0
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # started in the background by a shell (`join ... &`), which ignores SIGINT for it: a `kill -INT` was then
        # ignored during the start (imports, model, proof of work) and obeyed once the node ran (fresh user 43)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return handler(ns)
    except KeyboardInterrupt:  # before the node's own handler: nothing joined yet (a new key file is discarded)
        if ns.command != "join":
            return 130  # export, generate, profile, status stopped half-way did not do their work: `... && next` stops
        print(f"geomesh-peer {ns.command}: stopped during start-up", file=sys.stderr, flush=True)
        return 0


if __name__ == "__main__":
    sys.exit(main())
