"""Config-file support shared by the CLIs: a YAML or JSON file whose keys are the long option names.

Values from the file become the parser's defaults, so flags on the command line still win.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml


class ConfigFileError(ValueError):
    """The config file is missing, does not parse, or names an unknown option."""


def load_config_defaults(parser: argparse.ArgumentParser, path: str | None) -> dict:
    """Read ``path`` (YAML or JSON), check every key is an option of ``parser``, return them as defaults.

    Keys may use dashes or underscores (``speed-factors`` or ``speed_factors``).
    Raises ConfigFileError with a one-line message naming the file and the bad key.
    """
    if not path:
        return {}
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigFileError(f"cannot read config file {p}: {e.strerror}") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigFileError(f"config file {p} does not parse: {str(e).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"config file {p} must hold a mapping of option names to values")
    actions = {a.dest: a for a in parser._actions}
    out = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest not in actions or dest in ("help", "config"):
            raise ConfigFileError(f"config file {p}: unknown option {key!r}")
        action = actions[dest]
        if isinstance(action, argparse._AppendAction) and not isinstance(value, list):
            value = [value]  # a repeatable flag given once: `bootstrap: host:port`
        out[dest] = _checked(p, key, action, value)
    return out


def _checked(path: Path, key, action: argparse.Action, value):
    """``value`` from the file run through the option's own ``type`` and ``choices``, as the same flag on
    the command line would be (ranges, types: a ``threads: -3`` fails here, not in the node)."""
    def one(v):
        if action.type is not None and v is not None:
            text = ",".join(str(x) for x in v) if isinstance(v, list) else str(v)
            try:
                v = action.type(text)
            except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
                raise ConfigFileError(f"config file {path}: {key}: {e}") from None
        if action.choices is not None and v not in action.choices:
            raise ConfigFileError(f"config file {path}: {key}: {v!r} is not one of {', '.join(map(str, action.choices))}")
        return v

    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ConfigFileError(f"config file {path}: {key}: expected true or false, got {value!r}")
        return value
    if isinstance(action, argparse._AppendAction):
        return [one(v) for v in value]
    return one(value)
