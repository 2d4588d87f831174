"""The CLI as a newcomer meets it: plain-text help stating every option's default,
``--version``, ``--device`` matched case-insensitively (a unique part of a name is
enough; nothing matching lists the known models), and every invalid argument or
table one line on stderr with exit status 2, never a traceback."""

import subprocess
import sys

import pytest

from lamport_head import __version__, cli


def _run(*argv, env=None):
    import os

    p = subprocess.run([sys.executable, "-m", "lamport_head.cli", *argv], capture_output=True,
                       text=True, env=dict(os.environ, **(env or {})), timeout=120)
    return p.returncode, p.stdout, p.stderr


@pytest.mark.parametrize("command", ["tune", "show", "verify", "bench"])
def test_every_option_has_help_in_plain_text(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "``" not in text
    sub = next(a for a in cli.parser()._actions if a.dest == "command").choices[command]
    for action in sub._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{command} {action.option_strings} has no help"
            if action.default not in (None, False):  # the help states the default
                assert "default" in cli._Help("lamport-head")._get_help_string(action), \
                    action.option_strings
    if command == "tune":
        assert "(default: 8)" in text and "(default: 1,2,4,8,16,32,64)" in text
        assert "(default: 0.05)" in text and "(default: 128,256,512)" in text


def test_version():
    code, out, _ = _run("--version")
    assert code == 0 and out.strip() == f"lamport-head {__version__}"


def test_device_matches_a_part_of_a_name_case_insensitively():
    code, out, err = _run("show", "--device", "h200", "--emulated")
    assert code == 0 and "NVIDIA H200  tp=8 dcp=1" in out, err


def test_an_unknown_device_lists_the_known_ones():
    code, out, err = _run("show", "--device", "a100")
    assert code == 0 and err == ""
    assert "no serving entries for a100, tp=any, dcp=1: the stock gather is used" in out
    assert ("GPU models in these tables: NVIDIA H200 (--emulated also shows emulated sections)"
            in out)


@pytest.mark.parametrize("argv,message", [
    (("show", "--dcp", "3", "--tp", "8"), "lamport-head: show: --dcp 3 does not divide --tp 8"),
    (("tune", "--tp", "x"), "lamport-head tune: argument --tp: expected a positive int, got 'x' "
                            "(see lamport-head tune --help)"),
    (("bench", "--rows", "0,2"), "lamport-head bench: argument --rows: rows must be positive, "
                                 "got '0,2' (see lamport-head bench --help)"),
    (("frobnicate",), "lamport-head: argument command: invalid choice: 'frobnicate'"),
])
def test_an_invalid_argument_is_one_line_and_exit_2(argv, message):
    code, out, err = _run(*argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith(message), err


def test_a_table_that_is_not_utf8_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"schema: 1\ndevices: {}\n# \xff\n")
    code, out, err = _run("show", "--table", str(bad))
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "bad.yaml: not a UTF-8 text file" in err
