"""Red team 44: a config file's list for a repeatable flag (``bootstrap:``). A null in it was taken as an address
(``status`` then failed with a TypeError traceback on ``', '.join``), and ``status``'s ``--bootstrap`` on the command
line was added to the file's list instead of replacing it (as ``join``'s does since a fresh-user trial), while the
file's list alone was refused (``--bootstrap`` required on the command line)."""

from __future__ import annotations

import pytest

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
    assert err == [f"geomesh-peer: config file {cfg}: bootstrap: expected text, got null in the list"]


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
