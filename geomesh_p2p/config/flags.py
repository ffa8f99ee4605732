"""Command-line flags and config files generated from the config models (:mod:`geomesh_p2p.config.models`).

Each field of :class:`~geomesh_p2p.config.models.RunConfig`, :class:`~geomesh_p2p.config.models.NodeConfig` and
:class:`~geomesh_p2p.config.models.BootstrapConfig` is declared once with :func:`opt`: its default, help text,
range (pydantic's ``ge``/``gt``/``le``/``lt``) and CLI spelling. :func:`flag_specs` turns the fields into
:class:`FlagSpec` rows, :func:`add_flags` adds them to an argparse parser, :func:`values_from` reads a
parsed namespace back into field values, :func:`to_argv` renders a namespace back into argv (the demo's
peers) and :func:`load_config_defaults` reads a YAML/JSON config file into parser defaults.

Precedence: a flag on the command line > a value in ``--config FILE`` > the field's default. The file's
values become the parser's defaults: each is checked for its kind first (pydantic's strict types,
:func:`file_value_problem`: no list, true or null for a number, no number for a path), then goes through the same
flag type and choices, so an unknown key or a bad value fails at start, naming the key and the file
(:class:`ConfigFileError`).

Only argparse, json, math, yaml and pydantic are imported here, so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional, cast

from pydantic import BaseModel, Field
from pydantic.fields import FieldInfo

from geomesh_p2p.config.value_kinds import KIND_WORDS, file_value_problem as file_value_problem, shown_value
from geomesh_p2p.config.value_kinds import takes as takes, value_kind as value_kind
from geomesh_p2p.net.addr import AddressError, canonical_address
from geomesh_p2p.schema.run_id import check_run_id

__all__ = [
    "opt",
    "FlagSpec",
    "flag_specs",
    "add_flags",
    "add_log_level",
    "values_from",
    "to_argv",
    "ConfigFileError",
    "load_config_defaults",
    "unknown_home",
    "home_problem",
    "PARSERS",
    "capped",
    "takes",
    "comma_numbers",
    "AppendOverDefault",
]

_DEFAULT_MARK = " (default: %(default)s)"


def opt(
    default: Any = ...,
    help: str = "",
    *,
    flag: Optional[str] = "",
    metavar: Optional[str] = None,
    parse: Optional[str] = None,
    scale: Optional[float] = None,
    default_text: Optional[str] = None,
    group: Optional[str] = None,
    derived_from: Optional[str] = None,
    default_factory: Optional[Callable] = None,
    **constraints,
) -> Any:
    """A pydantic ``Field`` that also describes its command-line flag (stored in ``json_schema_extra["cli"]``).

    Args:
        default / default_factory: the field's default (the only place it is written).
        help: the field's description and the flag's help; " (default: X)" is appended unless the default is
            None/False or ``default_text`` says it otherwise.
        flag: the option name; "" = ``--`` + the field name with dashes; None = no flag of its own (then
            ``derived_from`` names the flag it is computed from, e.g. RunConfig.data from ``--data``).
        metavar / group: argparse's metavar; the help group name when not the model's.
        parse: a name in :data:`PARSERS` for a flag type the field's annotation and range do not give.
        scale: field value = flag value x scale (``--memory-budget-gb`` fills bytes: scale 2**30).
        default_text: the default as the help shows it, e.g. "torch's choice".
        **constraints: pydantic's ``ge``/``gt``/``le``/``lt``/``min_length``...; they also bound the flag.
    """
    cli = {
        "flag": flag,
        "metavar": metavar,
        "parse": parse,
        "scale": scale,
        "default_text": default_text,
        "group": group,
        "derived_from": derived_from,
    }
    extra: dict[str, Any] = {"cli": {k: v for k, v in cli.items() if v is not None or k == "flag"}}
    if default_factory is not None:
        return Field(default_factory=default_factory, description=help or None, json_schema_extra=extra, **constraints)
    return Field(default, description=help or None, json_schema_extra=extra, **constraints)


# ---------------------------------------------------------------------------------------------- flag types
@takes("number")
def _finite(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return v


@takes("int")
def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _shown_bound(x: float) -> str:
    """A bound as a message shows it: ``21600``, not ``21600.0``; ``0.5`` as it is."""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else str(x)


def number_type(kind: type, ge=None, gt=None, le=None, lt=None) -> Callable[[str], Any]:
    """An argparse type: an int or a finite float within the given bounds. Messages name the range:
    "must be >= 1, got -3", "must be in [0, 65535], got 70000", "must be a finite number > 0, got 0"."""
    lo, lo_open = (gt, True) if gt is not None else (ge, False)
    hi, hi_open = (lt, True) if lt is not None else (le, False)
    if lo is not None and hi is not None:
        rng = f"in {'(' if lo_open else '['}{_shown_bound(lo)}, {_shown_bound(hi)}{')' if hi_open else ']'}"
    elif lo is not None:
        rng = f"{'>' if lo_open else '>='} {_shown_bound(lo)}"
    elif hi is not None:
        rng = f"{'<' if hi_open else '<='} {_shown_bound(hi)}"
    else:
        rng = None
    what = "a finite number " if kind is float and rng and rng[0] in "<>" else ""

    def parse(text: str):
        v = _integer(text) if kind is int else _finite(text)
        bad = (lo is not None and (v <= lo if lo_open else v < lo)) or (
            hi is not None and (v >= hi if hi_open else v > hi)
        )
        if bad:
            raise argparse.ArgumentTypeError(f"must be {what}{rng}, got {text}")
        return v

    parse.__name__ = kind.__name__  # argparse's "invalid int value" wording, for a type that raises ValueError
    parse.value_kind = "int" if kind is int else "number"  # type: ignore[attr-defined]
    return parse


@takes("text")
def _nonempty(text: str) -> str:
    """A string field with ``min_length=1`` (an identifier: run id, host, key path): '' is refused."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


@takes("int_list")
def _batch_list(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be integers >= 1, got {text!r}")
    return sizes


@takes("number")
def _mbps(text: str) -> float:
    v = number_type(float, gt=0)(text)
    if not 0.001 <= v <= 1e6:
        raise argparse.ArgumentTypeError(f"must be between 0.001 and 1,000,000 Mbit/s, got {text}")
    return v


@takes("number")
def _speed_factor(text: str) -> float:
    v = number_type(float, gt=0)(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (1 = this device's own speed), got {text}")
    return v


#: Most ranks ``--local-devices`` may list (geomesh_p2p.model.rank_channel.MAX_RANKS says the same).
MAX_LOCAL_DEVICES = 64


@takes("text_list")
def _device_list(text: str) -> list[str]:
    """``--local-devices``: 2 or more comma-separated devices, all ``cpu`` or all ``cuda`` / ``cuda:N`` (a
    device may repeat: two ranks on one GPU). Spelled canonically (``cuda`` stays ``cuda``: rank i of a
    ``cuda,cuda`` list takes GPU i)."""
    items = [x.strip().lower() for x in text.split(",")]
    if "" in items:  # "cpu,,cpu" or a trailing comma: a typo in a launch script, not two ranks
        raise argparse.ArgumentTypeError(f"{text!r} has an empty entry: list one device per rank, comma-separated")
    for x in items:
        kind, _, index = x.partition(":")
        if kind not in ("cpu", "cuda") or (kind == "cpu" and index) or (index and not index.isdigit()):
            raise argparse.ArgumentTypeError(f"{x!r} is not a device: use cpu, cuda or cuda:N")
    if not 2 <= len(items) <= MAX_LOCAL_DEVICES:
        raise argparse.ArgumentTypeError(
            f"give 2 to {MAX_LOCAL_DEVICES} devices, one per rank, got {len(items)} (one device is --device)"
        )
    if len({x.partition(":")[0] for x in items}) > 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} mixes cpu and cuda: the ranks of a peer all-reduce on one backend (gloo or NCCL)"
        )
    return items


@takes("text")
def _device(text: str) -> str:
    """``--device``: ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (N a GPU index without leading zeros), as given.
    A subset of what :func:`geomesh_p2p.model.device.parse_device` takes (it is not imported: torch), so a value it
    refuses (``tpu:7``, ``meta``, ``cuda:x``) fails at parse time, not in the node's training setup after the join;
    whether this machine has that GPU is checked when the node starts."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    kind, colon, index = text.partition(":")
    ok = text in ("auto", "cpu", "cuda") or (
        kind == "cuda" and colon and index.isascii() and index.isdigit() and (index == "0" or index[0] != "0")
    )
    if not ok:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: use auto, cpu, cuda or cuda:N")
    return text


@takes("text")
def _run_id(text: str) -> str:
    """``--run-id``: :func:`geomesh_p2p.schema.run_id.check_run_id` (every DHT key of the run fits a node's limit)."""
    try:
        return check_run_id(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _auto_or(kind: type, **bounds) -> Callable[[str], Any]:
    """An argparse type: ``auto`` (None: the node derives the value from what it measures) or a number of
    ``kind`` within ``bounds`` (:func:`number_type`'s messages)."""
    number = number_type(kind, **bounds)

    def parse(text: str):
        if text.strip().lower() == "auto":
            return None
        try:
            return number(text)
        except argparse.ArgumentTypeError as e:
            if str(e).startswith("expected"):  # not a number at all (a bound's message stays as it is)
                raise argparse.ArgumentTypeError(f"expected auto or a number, got {text!r}") from None
            raise

    parse.__name__ = kind.__name__
    parse.accepts_auto = True  # type: ignore[attr-defined]  # to_argv renders None as "auto"
    parse.value_kind = "auto_int" if kind is int else "auto_number"  # type: ignore[attr-defined]
    return parse


def comma_numbers(**bounds: float) -> Callable[[str], str]:
    """An argparse type: comma-separated numbers, each within ``bounds`` (:func:`number_type`'s ``ge`` / ``gt`` /
    ``le`` / ``lt``), kept as given (the caller splits them); a config file may give them as a list
    (``speed_factors: [1.0, 0.5]``). Checked here, not by the caller, so that argparse names the one flag at fault
    ("argument --speed-factors: '1,x': expected a number, got 'x'"; one message for two flags named both: fresh user 46)."""
    one = number_type(float, **bounds)

    def parse(text: str) -> str:
        for x in text.split(","):
            if x.strip():
                try:
                    one(x.strip())
                except argparse.ArgumentTypeError as e:  # "'1,x': expected a number, got 'x'"
                    raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
        return text

    parse.value_kind = "number_list"  # type: ignore[attr-defined]
    return parse


@takes("text")
def _host_port(text: str) -> str:
    """``HOST:PORT`` (``[IPV6]:PORT``) in its canonical spelling (:func:`geomesh_p2p.net.addr.canonical_address`)."""
    try:
        return canonical_address(text)
    except AddressError as e:
        msg = str(e)  # once: "'127.0.0.1' has no port: expected HOST:PORT" said it twice in a wrapper (fresh user 41)
        raise argparse.ArgumentTypeError(
            msg if "HOST:PORT" in msg else f"expected HOST:PORT, got {text!r} ({msg})"
        ) from None


def capped(parse: Callable[[str], Any], le: Optional[float] = None, lt: Optional[float] = None) -> Callable[[str], Any]:
    """``parse`` (a flag type of :data:`PARSERS`) that also refuses a number over the field's upper bound (``le`` /
    ``lt``, in the flag's units), which that type does not know: "must be <= 21600, got 1e9". Its own lower bound and
    messages stay (``--min-agreement 0`` means off, though the field is ``> 0``); None (``auto``) and non-numbers
    pass. ``parse`` itself when there is no upper bound."""
    if le is None and lt is None:
        return parse

    def parse_capped(text: str):
        v = parse(text)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if lt is not None and not v < lt:
                raise argparse.ArgumentTypeError(f"must be < {_shown_bound(lt)}, got {text}")
            if le is not None and not v <= le:
                raise argparse.ArgumentTypeError(f"must be <= {_shown_bound(le)}, got {text}")
        return v

    parse_capped.__name__ = getattr(parse, "__name__", "parse")
    parse_capped.value_kind = value_kind(argparse.Action([], "x", type=parse))  # type: ignore[attr-defined]
    if getattr(parse, "accepts_auto", False):
        parse_capped.accepts_auto = True  # type: ignore[attr-defined]  # to_argv renders None as "auto"
    return parse_capped


#: Flag types by name, for fields whose flag is not given by their annotation and range (``opt(parse=...)``).
PARSERS: dict[str, Callable[[str], Any]] = {
    "fraction": number_type(float, ge=0, le=1),  # min_agreement: 0 = off (None) on the flag
    "batch_list": _batch_list,
    "mbps": _mbps,
    "speed_factor": _speed_factor,
    "host_port": _host_port,
    "device_list": _device_list,
    "device": _device,
    "run_id": _run_id,
    "positive_float": number_type(float, gt=0),
    "auto_seconds": _auto_or(float, gt=0),  # --window-s auto (RunConfig.window_s None)
    "auto_rounds": _auto_or(int, ge=1),  # --eval-every auto (NodeConfig.eval_every None)
    "auto_group": _auto_or(int, ge=0),  # --group-size auto (RunConfig.group_size None)
    "file": str,  # the flag names a file; the caller reads it into the field (--allow-peers FILE)
}


# ---------------------------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class FlagSpec:
    """One command-line flag: ``flag`` (e.g. "--window-s"), its namespace ``dest``, the model ``field`` it
    fills (None for an input flag such as ``--data``), argparse ``kwargs``, and ``scale`` (field = flag x scale)."""

    flag: str
    dest: str
    field: Optional[str]
    kwargs: dict
    scale: Optional[float] = None
    group: Optional[str] = None
    as_int: bool = False

    def add_to(self, group) -> argparse.Action:
        """Add this flag to an argparse parser or argument group; returns the action."""
        return group.add_argument(self.flag, dest=self.dest, **self.kwargs)


def _cli(info: FieldInfo) -> Optional[dict]:
    extra = info.json_schema_extra
    cli = extra.get("cli") if isinstance(extra, dict) else None
    return cli if isinstance(cli, dict) else None  # opt() always stores a dict


def _bounds(info: FieldInfo) -> dict:
    out = {}
    for m in info.metadata:
        for k in ("ge", "gt", "le", "lt"):
            v = getattr(m, k, None)
            if v is not None:
                out[k] = v
    return out


def _unwrap_optional(ann):
    if typing.get_origin(ann) is typing.Union:
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return ann


def _default_of(info: FieldInfo):
    # opt()'s factories take no argument (pydantic's type also allows one taking the validated data)
    return cast(Callable[[], Any], info.default_factory)() if info.default_factory is not None else info.default


def flag_specs(
    model: type[BaseModel], only: Optional[typing.Iterable[str]] = None, defaults: Optional[dict] = None
) -> list[FlagSpec]:
    """The flags of ``model``'s fields (those with a flag of their own), in field order.

    ``only``: field names to keep (in that order). ``defaults``: field name -> a default that differs from
    the model's for this command (e.g. the bootstrap listens on 0.0.0.0). Raises KeyError for a name in
    ``only`` that is not a field with a flag.
    """
    out = {}
    for name, info in model.model_fields.items():
        cli = _cli(info)
        if cli is None or cli.get("flag") is None:
            continue
        flag = cli["flag"] or "--" + name.replace("_", "-")
        dest = flag[2:].replace("-", "_")
        ann = _unwrap_optional(info.annotation)
        default = _default_of(info) if not defaults or name not in defaults else defaults[name]
        scale = cli.get("scale")
        if scale is not None and default is not None:
            default = default / scale
        help_text = info.description or ""
        kw: dict = {"help": help_text}
        if cli.get("metavar"):
            kw["metavar"] = cli["metavar"]
        if ann is bool:
            if flag.startswith("--no-"):
                kw.update(action="store_false", default=default)
                dest = name
            else:
                kw.update(action="store_true", default=default)
        elif typing.get_origin(ann) is list and cli.get("parse") not in ("batch_list", "file", "device_list"):
            kw.update(
                action=AppendOverDefault, default=list(default or []), type=PARSERS.get(cli.get("parse", ""), str)
            )
        else:
            if typing.get_origin(ann) is Literal:
                kw["choices"] = list(typing.get_args(ann))
            elif cli.get("parse"):
                # the parse type keeps its own lower bound and messages; the field's upper bound is added (red
                # team, session 16: --window-s took any finite number, a fixed window past what records outlive)
                top = {k: v / scale if scale is not None else v for k, v in _bounds(info).items() if k in ("le", "lt")}
                kw["type"] = capped(PARSERS[cli["parse"]], **top)
            elif ann is str and any(getattr(m, "min_length", 0) for m in info.metadata):
                kw["type"] = _nonempty
            elif ann in (int, float):
                b = _bounds(info)
                if scale is not None:  # the bound is in field units; the flag's is in its own
                    b = {k: v / scale for k, v in b.items()}
                kw["type"] = number_type(ann, **b)
            kw["default"] = default
        if help_text is not argparse.SUPPRESS and kw.get("action") not in ("store_true", "store_false"):
            if cli.get("default_text"):
                kw["help"] = f"{help_text} (default: {cli['default_text']})"
            elif isinstance(default, list) and default:
                kw["help"] = f"{help_text} (default: {','.join(map(str, default))})"
            elif default is not None and default != [] and "%(default)" not in help_text:
                kw["help"] = help_text + _DEFAULT_MARK
        out[name] = FlagSpec(flag, dest, name, kw, scale, cli.get("group"), as_int=ann is int)
    if only is not None:
        return [out[n] for n in only]
    return list(out.values())


def derived_fields(model: type[BaseModel]) -> dict[str, str]:
    """Field name -> the flag it is computed from, for fields without a flag of their own."""
    out = {}
    for name, info in model.model_fields.items():
        cli = _cli(info)
        if cli is not None and cli.get("flag") is None:
            out[name] = cli["derived_from"]
    return out


class AppendOverDefault(argparse._AppendAction):
    """argparse's ``append``, except that the first use on the command line replaces the default list (a
    config file's ``bootstrap: [...]``) instead of adding to it: the command line wins, as for every other
    flag (a fresh-user trial joined through a config file's bootstrap *and* the one given on the command
    line). Later uses append."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        items = [] if current is None or current is self.default else list(current)
        items.append(values)
        setattr(namespace, self.dest, items)


def add_flags(parser, specs: list[FlagSpec], title: Optional[str] = None) -> None:
    """Add ``specs`` to ``parser``: under one group ``title`` (a spec's own ``group`` wins), or ungrouped."""
    groups: dict = {}
    for s in specs:
        name = s.group or title
        if name is None:
            s.add_to(parser)
            continue
        if name not in groups:
            groups[name] = parser.add_argument_group(name)
        s.add_to(groups[name])


def _edit_distance(a: str, b: str) -> int:
    """Edits (insert, delete, substitute, swap two neighbours) from ``a`` to ``b``: optimal string alignment."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        cur = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[-1]


def closest(word: str, known: list[str], cutoff: float = 0.75) -> Optional[str]:
    """The name in ``known`` that ``word`` most likely meant, or None: among those difflib finds close (``cutoff``),
    the fewest edits away (a swap of two neighbours is one edit), then the nearest in length, then the longer. By
    difflib's ratio alone ``--modle`` meant ``--mode`` (fresh user 52), one swap from ``--model``."""
    near = difflib.get_close_matches(word, known, n=len(known) or 1, cutoff=cutoff)
    if not near:
        return None
    return min(near, key=lambda k: (_edit_distance(word, k), abs(len(k) - len(word)), -len(k), k))


class StrictParser(argparse.ArgumentParser):
    """An ArgumentParser that takes no abbreviated flags (``--thread 1`` is an error, not ``--threads 1``: a
    typo silently took another flag's meaning) and suggests the closest flag for an unknown one
    (``unrecognized arguments: --thread 1 (did you mean --threads?)``). Subparsers are of the same class."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def suggest(self, message: str) -> str:
        """``message`` with "(did you mean --X?)" for each unknown ``--flag`` in it that is close to a known one
        (:func:`closest`)."""
        if "unrecognized arguments" not in message:
            return message
        known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        hints = []
        for word in message.split(":", 1)[-1].split():
            flag = word.split("=", 1)[0]
            if flag.startswith("--"):
                close = closest(flag, known)
                if close:
                    hints.append(f"{flag}: did you mean {close}?")
        return f"{message} ({'; '.join(hints)})" if hints else message


def add_log_level(parser, default: str = "INFO") -> None:
    """Add the programs' common ``--log-level`` flag (DEBUG, INFO, WARNING or ERROR; ``default``) to
    ``parser`` (an ArgumentParser or argument group)."""
    parser.add_argument(
        "--log-level",
        default=default,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log verbosity (default: %(default)s)",
    )


def values_from(ns: argparse.Namespace, specs: list[FlagSpec]) -> dict:
    """Field values of ``specs`` read from a parsed namespace, scaled back to the field's unit (an int field
    gets an int). A flag missing from ``ns`` is left out, so the model's default applies."""
    out = {}
    for s in specs:
        if not hasattr(ns, s.dest):
            continue
        v = getattr(ns, s.dest)
        if s.scale is not None and v is not None:
            v = int(v * s.scale) if s.as_int else v * s.scale
        out[s.field] = v
    return out


def to_argv(ns: argparse.Namespace, specs: list[FlagSpec]) -> list[str]:
    """The argv that gives a parser with ``specs`` the same values as ``ns`` (None values and unset
    switches are left out, but for a flag that takes ``auto``, where None is rendered as ``auto``; lists are repeated for ``append`` flags, comma-joined otherwise)."""
    out: list[str] = []
    for s in specs:
        v = getattr(ns, s.dest, None)
        action = s.kwargs.get("action")
        if action == "store_true":
            out += [s.flag] if v else []
        elif action == "store_false":
            out += [] if v else [s.flag]
        elif v is None:
            if getattr(s.kwargs.get("type"), "accepts_auto", False):
                out += [s.flag, "auto"]  # None is the flag's "auto" (--window-s auto), not "unset"
            continue
        elif action in ("append", AppendOverDefault):
            for x in v:
                out += [s.flag, str(x)]
        elif isinstance(v, list):
            out += [s.flag, ",".join(map(str, v))]
        else:
            out += [s.flag, str(v)]
    return out


# ---------------------------------------------------------------------------------------------- config files
class ConfigFileError(ValueError):
    """The config file is missing, does not parse, names an unknown option or holds a bad value."""


def named_source(ns: argparse.Namespace, error: BaseException) -> str:
    """``error``'s message, and where its option's value came from when that was ``--config FILE`` (fresh user 54:
    ``model: tiney`` in a config file was refused as ``--model tiney: unknown model preset``, naming a flag nobody
    typed). The option is the ``--flag`` the message starts with; ``ns.config_dests``: the options whose value is the
    file's (``peer.cli.with_config_file``); without either, the message as it is."""
    msg = str(error)
    m = re.match(r"--([A-Za-z0-9][A-Za-z0-9-]*)", msg)
    dests = getattr(ns, "config_dests", None) or ()
    if m is None or m.group(1).replace("-", "_") not in dests:
        return msg
    return f"{msg} (set by {m.group(1)}: in config file {getattr(ns, 'config', None)})"


def load_config_defaults(parser: argparse.ArgumentParser, path: str | None) -> dict:
    """Read ``path`` (YAML, or JSON for ``*.json``), check every key is an option of ``parser``, and return
    the values as parser defaults (so flags on the command line still win).

    Keys are the long option names, with dashes or underscores (``speed-factors`` or ``speed_factors``; both in one
    file is an error, not the last one winning).
    Each value must be of its option's kind (:func:`value_kind`: ``[1]`` is no number, ``5`` no path), then
    goes through the option's own ``type`` and ``choices``, as on the command line.
    Raises ConfigFileError with a one-line message naming the file and the bad key (or: unreadable, not
    UTF-8 text, does not parse).
    """
    import yaml  # only when a config file is given

    if not path:
        return {}
    problem = home_problem("--config", path)
    if problem is not None:
        raise ConfigFileError(problem)
    p = Path(path).expanduser()  # as every other path flag (`--config=~/x.yaml`: the shell leaves that ~ alone)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigFileError(f"cannot read config file {p}: {e.strerror}") from None
    except UnicodeDecodeError as e:  # a binary or non-UTF-8 file (review M3)
        raise ConfigFileError(f"config file {p} is not UTF-8 text (byte {e.start})") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as e:
        raise ConfigFileError(f"config file {p} does not parse: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)  # where the parser stopped (0-based in PyYAML)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigFileError(f"config file {p} does not parse: {what}{where}") from None
    except RecursionError:  # [[[[... a few thousand deep: the parsers recurse (review, session 10)
        raise ConfigFileError(f"config file {p} does not parse: nested too deeply") from None
    except ValueError as e:  # e.g. an integer of more than 4,300 digits (Python's int limit)
        raise ConfigFileError(f"config file {p} does not parse: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"config file {p} must hold a mapping of option names to values")
    actions = {a.dest: a for a in parser._actions}
    out = {}
    spelled: dict[str, Any] = {}  # dest -> the key that set it
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest not in actions or dest in ("help", "config"):
            raise ConfigFileError(f"config file {p}: unknown option {key!r}{_key_hint(str(key), actions)}")
        if dest in spelled:  # `min-peers: 3` and `min_peers: 2`: one of them was silently lost (fresh user 52)
            flag = next((o for o in actions[dest].option_strings if o.startswith("--")), dest)
            raise ConfigFileError(
                f"config file {p}: {spelled[dest]!r} and {key!r} are the same option ({flag}): keep one"
            )
        spelled[dest] = key
        action = actions[dest]
        if isinstance(action, argparse._AppendAction) and not isinstance(value, (list, type(None))):
            value = [value]  # a repeatable flag given once: `bootstrap: host:port` (null: as any flag's null)
        out[dest] = _checked(p, key, action, value)
    return out


def _key_hint(key: str, actions: dict) -> str:
    """What a config file's unknown ``key`` probably meant, as argparse says it of a mistyped flag (fresh-user trial
    44: ``bootstrp:`` got no hint, ``--run-id:`` none that the dashes go): ``" (write it without the dashes:
    run-id)"``, ``" (did you mean bootstrap?)"`` or ""."""
    known = sorted(d.replace("_", "-") for d in actions if d not in ("help", "config"))
    bare = key.lstrip("-")
    if bare != key and bare.replace("_", "-") in known:
        return f" (write it without the dashes: {bare})"
    near = closest(bare.replace("_", "-"), known)
    return f" (did you mean {near}?)" if near else ""


def _checked(path: Path, key, action: argparse.Action, value):
    """``value`` from the file checked for its kind (:func:`value_kind`: no list, true or null for a number, no
    number for a path...), then run through the option's own ``type`` and ``choices``, as the same flag on the
    command line would be (ranges, types: a ``threads: -3`` fails here, not in the node). Raises ConfigFileError
    naming the file and the key."""

    def one(v):
        if v is None:
            if action.default is not None:  # null for a flag that cannot be unset (a port): not its default
                raise ConfigFileError(
                    f"config file {path}: {key}: expected {KIND_WORDS[value_kind(action)]}, got null (leave the key "
                    "out for the default)"
                )
            return v
        problem = file_value_problem(value_kind(action), v)
        if problem is not None:
            raise ConfigFileError(f"config file {path}: {key}: {problem}")
        if action.type is not None:
            text = ",".join(str(x) for x in v) if isinstance(v, list) else str(v)
            try:
                v = action.type(text)
            except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
                raise ConfigFileError(f"config file {path}: {key}: {e}") from None
        if action.choices is not None and v not in action.choices:
            raise ConfigFileError(
                f"config file {path}: {key}: {v!r} is not one of {', '.join(map(str, action.choices))}"
            )
        return v

    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ConfigFileError(f"config file {path}: {key}: expected true or false, got {shown_value(value)}")
        return value
    if isinstance(action, argparse._AppendAction) and value is not None:
        if any(v is None for v in value):  # [null] was kept as an address: a TypeError later (red team 44)
            raise ConfigFileError(
                f"config file {path}: {key}: expected {KIND_WORDS[value_kind(action)]}, got null in the list"
            )
        return [one(v) for v in value]
    return one(value)


# ---------------------------------------------------------------------------------------------- paths
#: Metavars of the flags that name a file or folder (and dests of those that have none: demo's).
_PATH_METAVARS = frozenset({"FILE", "DIR", "PATH"})
_PATH_DESTS = frozenset({"workdir", "summary_json"})


def unknown_home(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> Optional[str]:
    """``"FLAG ~NAME/...: no user 'NAME' (...)"`` for the first path flag of ``parser`` (metavar FILE, DIR or PATH,
    or one of them first: ``PATH|hf:...``)
    whose value in ``ns`` starts with ``~NAME`` where no user is called NAME, else None. ``pathlib``'s expanduser,
    which every reader of those flags calls, raises RuntimeError for it: a traceback at start, or once the node
    had started (red team 43; red team 42 caught it for the checkpoint folder only)."""
    for action in parser._actions:
        shown = str(action.metavar or "").split("|", 1)[0]  # --data PATH|hf:NAME...
        if not action.option_strings or not (shown in _PATH_METAVARS or action.dest in _PATH_DESTS):
            continue
        value = getattr(ns, action.dest, None)
        for v in value if isinstance(value, list) else [value]:
            problem = home_problem(action.option_strings[0], v)
            if problem is not None:
                return problem
    return None


def home_problem(flag: str, value: Any) -> Optional[str]:
    """``"FLAG ~NAME/...: no user 'NAME' (...)"`` when ``value`` is a path that starts with ``~NAME`` where no user
    is called NAME (``Path.expanduser`` raises RuntimeError for it), else None."""
    if not isinstance(value, str) or not value.startswith("~"):
        return None
    if os.path.expanduser(value) != value:  # os.path's leaves it as it is where pathlib's raises
        return None
    user = value[1:].split("/", 1)[0] or "~"
    return f"{flag} {value}: no user {user!r} (~NAME is NAME's home folder)"
