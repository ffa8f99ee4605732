"""Red team 44: a config file's list for a repeatable flag (``bootstrap:``). A null in it was taken as an address
(``status`` then failed with a TypeError traceback on ``', '.join``), and ``status``'s ``--bootstrap`` on the command
line was added to the file's list instead of replacing it (as ``join``'s does since a fresh-user trial), while the
file's list alone was refused (``--bootstrap`` required on the command line). And a text value with an unpaired
surrogate (JSON's ``"\\ud800"``) was taken, then raised UnicodeEncodeError where it was used as a path."""

from __future__ import annotations

import json

import pytest
import yaml

from geomesh_p2p.config.flags import ConfigFileError, load_config_defaults

pytestmark = pytest.mark.timeout(60)


def _command(name: str):
    from peer.cli import build_parser

    return build_parser()._subparsers._group_actions[0].choices[name]


@pytest.mark.parametrize("command", ["status", "join"])
@pytest.mark.parametrize("text", ["bootstrap: [null]\n", "bootstrap: [127.0.0.1:2, null]\n", "bootstrap: null\n"])
def test_a_null_address_is_refused_naming_the_key(tmp_path, command, text):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigFileError) as ei:
        load_config_defaults(_command(command), str(cfg))
    assert str(ei.value).startswith(f"config file {cfg}: bootstrap: expected text, got null")


def test_status_with_a_null_address_exits_2_in_one_line(tmp_path, capsys):
    from peer.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("bootstrap: [null]\n")
    assert main(["status", "--config", str(cfg), "--bootstrap", "127.0.0.1:1", "--timeout", "0.2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"geomesh-peer status: config file {cfg}: bootstrap: expected text, got null in the list"]


def test_the_status_command_line_bootstrap_replaces_the_files(tmp_path):
    from peer.cli import build_parser, parse, with_config_file

    cfg = tmp_path / "c.yaml"
    cfg.write_text("bootstrap: [127.0.0.1:2]\n")
    parser = build_parser()
    argv = ["status", "--config", str(cfg), "--bootstrap", "127.0.0.1:1", "--bootstrap", "127.0.0.1:3"]
    assert with_config_file(parser, parse(parser, argv), argv).bootstrap == ["127.0.0.1:1", "127.0.0.1:3"]
    parser = build_parser()
    argv = ["status", "--config", str(cfg)]
    assert with_config_file(parser, parse(parser, argv), argv).bootstrap == ["127.0.0.1:2"]  # the file's alone


def test_status_without_any_bootstrap_exits_2_in_one_line(tmp_path, capsys):
    from peer.cli import main

    assert main(["status", "--run-id", "x"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "geomesh-peer status: --bootstrap HOST:PORT is required (on the command line, or bootstrap: in --config)"
    ]


@pytest.mark.parametrize("key", ["checkpoint_dir", "log_json", "bootstrap"])
@pytest.mark.parametrize("ext", ["json", "yaml"])
def test_join_refuses_an_unpaired_surrogate_naming_the_key(tmp_path, capsys, key, ext):
    """JSON's and YAML's ``"\\ud800"`` is a lone surrogate no file name, address or log line can hold: the folder's
    mkdir or the log's open raised UnicodeEncodeError, a traceback (red team 44)."""
    from peer.cli import main

    cfg = tmp_path / f"peer.{ext}"
    cfg.write_text('{"%s": "\\ud800x"}\n' % key)  # JSON is YAML too: the same escape
    assert main(["join", "--config", str(cfg), "--identity", str(tmp_path / "id.key")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"geomesh-peer join: config file {cfg}: {key}: expected text, got text with an unpaired surrogate ('\\ud800' at "
        "character 1): write the character itself"
    ]
    assert not (tmp_path / "id.key").exists()


def test_the_bootstrap_refuses_an_unpaired_surrogate_naming_the_key(tmp_path, capsys):
    from bootstrap.cli import main

    cfg = tmp_path / "b.json"
    cfg.write_text('{"state_file": "a\\udfffb"}')
    assert main(["--config", str(cfg)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"geomesh-bootstrap: config file {cfg}: state_file: expected text, got text with an unpaired surrogate "
        "('\\udfff' at character 2): write the character itself"
    ]


def test_a_byte_argv_could_not_decode_is_still_the_flag_types(tmp_path):
    """``\\udc80``-``\\udcff`` is how Python spells a byte of a non-UTF-8 file name (surrogateescape): a path may hold it,
    as on the command line; the run id's own check words it."""
    cfg = tmp_path / "c.json"
    cfg.write_text('{"checkpoint_dir": "ck\\udcff", "run_id": "a\\udcff"}')
    with pytest.raises(ConfigFileError) as ei:
        load_config_defaults(_command("join"), str(cfg))
    assert str(ei.value) == (f"config file {cfg}: run_id: is not UTF-8 text (character 2 is an undecodable byte)")


def _alias_bomb(key: str, depth: int = 9) -> str:
    """``key: [...]`` whose YAML aliases make a list of ``10**depth`` numbers out of ~500 bytes."""
    levels = ["&a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    levels += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, depth)]
    return f"{key}: [{', '.join(levels)}]\n"


@pytest.mark.parametrize("key, kind", [("mmap_threshold_mib", "a number"), ("checkpoint_dir", "text")])
def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path, key, kind):
    """The error showed the file's value as json.dumps of the whole list, cut to 60 characters after: a 500-byte file
    whose aliases nest a list of 10**9 numbers held ``geomesh-peer join`` there for good (red team 44)."""
    cfg = tmp_path / "peer.yaml"
    cfg.write_text(_alias_bomb(key))
    assert len(cfg.read_bytes()) < 600
    with pytest.raises(ConfigFileError) as ei:
        load_config_defaults(_command("join"), str(cfg))
    # what json.dumps of the whole value began with (the same for a small bomb)
    shown = json.dumps(yaml.safe_load(_alias_bomb(key, depth=3))[key])[:57] + "..."
    assert str(ei.value) == f"config file {cfg}: {key}: expected {kind}, got the list {shown}"


def test_a_long_text_is_shown_cut(tmp_path):
    cfg = tmp_path / "peer.yaml"
    cfg.write_text(f"port: '{'9' * 100_000}'\n")
    with pytest.raises(ConfigFileError) as ei:
        load_config_defaults(_command("join"), str(cfg))
    assert str(ei.value) == f"config file {cfg}: port: expected an integer, got the text '{'9' * 56}..."
