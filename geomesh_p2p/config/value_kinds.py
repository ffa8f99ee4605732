"""What a config file may give for each kind of flag value (:mod:`geomesh_p2p.config.flags`' config files): the
kinds as pydantic's strict types, the :func:`takes` mark of a flag type, :func:`value_kind` of an argparse action and
:func:`file_value_problem`, the one-line reason a file's value is not of its kind. Imports only pydantic (``--help``
stays fast)."""

from __future__ import annotations

import argparse
import functools
import json
from typing import Any, Callable, Iterator, Optional, TypeVar, Union

from pydantic import StrictFloat, StrictInt, StrictStr, TypeAdapter, ValidationError

__all__ = ["takes", "value_kind", "file_value_problem", "shown_value", "KIND_WORDS"]

#: What a config file may give for each kind of flag value, as pydantic's strict types: the file's value is checked
#: against it before it goes through the flag's type as text, so YAML's ``[1]`` is no number (it read as 1), ``true``
#: no number, ``5`` no path and ``null`` no port (``mmap_threshold_mib: [1]`` was taken for 1, session 44). A list
#: is only for the flags that take a comma-separated list (``profile_batches: [4, 8]`` or ``"4,8"``).
_FILE_TYPES: dict[str, Any] = {
    "text": StrictStr,
    "int": StrictInt,
    "number": Union[StrictInt, StrictFloat],
    "auto_int": Union[StrictInt, StrictStr],  # auto or an integer (the flag's type reads the text)
    "auto_number": Union[StrictInt, StrictFloat, StrictStr],
    "int_list": Union[StrictStr, list[StrictInt]],
    "number_list": Union[StrictStr, list[Union[StrictInt, StrictFloat]]],
    "text_list": Union[StrictStr, list[StrictStr]],
}

#: Each kind in the words of a config-file error ("expected an integer, got ...").
KIND_WORDS = {
    "text": "text",
    "int": "an integer",
    "number": "a number",
    "auto_int": "auto or an integer",
    "auto_number": "auto or a number",
    "int_list": "a list of integers",
    "number_list": "a list of numbers",
    "text_list": "a list of text values",
}

_Parse = TypeVar("_Parse", bound=Callable[..., Any])


def takes(kind: str) -> Callable[[_Parse], _Parse]:
    """Decorator of a flag type: the kind of value (a key of :data:`_FILE_TYPES`) a config file may give for it."""
    if kind not in _FILE_TYPES:
        raise ValueError(f"unknown value kind {kind!r}")

    def mark(parse: _Parse) -> _Parse:
        parse.value_kind = kind  # type: ignore[attr-defined]
        return parse

    return mark


@functools.cache
def _file_type(kind: str) -> TypeAdapter:
    return TypeAdapter(_FILE_TYPES[kind])


def value_kind(action: argparse.Action) -> str:
    """The kind of value (:data:`_FILE_TYPES`) a config file may give for ``action``: its type's
    :func:`takes` mark; ``int`` and ``float`` for Python's own; text for a flag without a type (paths, hosts,
    names, choices)."""
    kind = getattr(action.type, "value_kind", None)
    if kind is not None:
        return kind
    if action.type is int:
        return "int"
    if action.type is float:
        return "number"
    return "text"


#: The most characters of a config file's value that an error shows.
SHOWN_CHARS = 60

_END = object()


def _cut(text: str, limit: int = SHOWN_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _json_head(value: Any, limit: int) -> str:
    """``json.dumps(value)`` (a nested mapping as ``{...}``) written up to a little over ``limit`` characters only: YAML's
    aliases make a 500-byte file a list of 10**9 numbers, whose whole json.dumps never ended (red team 44)."""
    out: list[str] = []
    size = 0
    stack: list[tuple[Iterator[Any], str]] = [(iter([value]), "")]
    first = [True]
    while stack and size <= limit:
        item = next(stack[-1][0], _END)
        if item is _END:
            text = stack.pop()[1]
            first.pop()
        else:
            text = "" if first[-1] else ", "
            first[-1] = False
            if isinstance(item, list):
                stack.append((iter(item), "]"))
                first.append(True)
                text += "["
            else:
                text += "{...}" if isinstance(item, dict) else json.dumps(item, default=str)[: limit + 1]
        out.append(text)
        size += len(text)
    return "".join(out)


def shown_value(value: Any) -> str:
    """A config file's value as its error shows it, in YAML's words: ``the list [1]``, ``true``, ``null``, ``the
    number 5``, ``the text '5'``, ``a mapping``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return f"the number {value}"
    if isinstance(value, str):
        return f"the text {_cut(repr(value))}"
    if isinstance(value, list):
        return f"the list {_cut(_json_head(value, SHOWN_CHARS))}"  # as the file writes it: [1, true], not [1, True]
    if isinstance(value, dict):
        return "a mapping"
    return f"a {type(value).__name__}"


def file_value_problem(kind: str, value: Any) -> Optional[str]:
    """``"expected <kind>, got <value>"`` when a config file's ``value`` is not of ``kind`` (pydantic's strict
    check of :data:`_FILE_TYPES`), with how to quote a number or true/false given for text; None when it is."""
    try:
        _file_type(kind).validate_python(value, strict=True)
        return _unpaired_surrogate(kind, value)
    except ValidationError:
        pass
    hint = ""
    if kind in ("text", "text_list") and isinstance(value, (bool, int, float)):
        hint = f' (quote it: "{shown_value(value).removeprefix("the number ")}")'
    return f"expected {KIND_WORDS[kind]}, got {shown_value(value)}{hint}"


def _unpaired_surrogate(kind: str, value: Any) -> Optional[str]:
    """Why a config file's text ``value`` (or a text of its list) cannot be used: a surrogate (JSON's and YAML's
    ``"\\ud800"``) that is no byte of an undecodable file name (Python's ``\\udc80``-``\\udcff``, as on the command
    line) encodes to nothing, so the path's mkdir or the log's open raised UnicodeEncodeError, a traceback (red team
    44). None when every text encodes."""
    for text in value if isinstance(value, list) else [value]:
        if not isinstance(text, str):
            continue
        try:
            text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError as e:
            return (
                f"expected {KIND_WORDS[kind]}, got text with an unpaired surrogate ({text[e.start]!r} at character "
                f"{e.start + 1}): write the character itself"
            )
    return None
