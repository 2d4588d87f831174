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


@pytest.mark.parametrize("argv,message", [
    (("--device", "a100"), "lamport-head: show: no GPU model in these tables matches --device "
                           "'a100'; sections: NVIDIA H200 tp=8 dcp=1 (emulated)"),
    (("--device", "nonsense", "--emulated"), "lamport-head: show: no GPU model in these tables "
                                             "matches --device 'nonsense'; sections: NVIDIA H200 "
                                             "tp=8 dcp=1 (emulated)"),
    (("--tp", "3"), "lamport-head: show: no section has --tp 3; sections: NVIDIA H200 tp=8 dcp=1 "
                    "(emulated)"),
    (("--device", "h200", "--tp", "4", "--emulated"), "lamport-head: show: no section for NVIDIA "
                                                      "H200 has --tp 4; sections: NVIDIA H200 tp=8 "
                                                      "dcp=1 (emulated)"),
    (("--tp", "8", "--dcp", "2"), "lamport-head: show: no section has --tp 8 and --dcp 2; "
                                  "sections: NVIDIA H200 tp=8 dcp=1 (emulated)"),
])
def test_a_device_or_tp_that_matches_nothing_is_exit_2_listing_what_exists(argv, message):
    code, out, err = _run("show", *argv)  # the packaged table: one emulated H200 TP-8 section
    assert (code, out, err) == (2, "", message + "\n")


def test_a_matching_device_without_serving_sections_says_stock():
    """H200 TP 8 exists, emulated only: not an argument error, the answer is stock."""
    code, out, err = _run("show", "--device", "h200", "--tp", "8")
    assert code == 0 and err == ""
    assert "no serving entries for NVIDIA H200, tp=8, dcp=1: the stock gather is used" in out
    assert ("GPU models in these tables: NVIDIA H200 (--emulated also shows emulated sections)"
            in out)


def test_an_emulated_section_shows_no_stock_speedup_or_enabled():
    """One GPU's TP virtual ranks are never served, and a local cat is no all-gather."""
    code, out, err = _run("show", "--device", "h200", "--emulated")
    assert code == 0, err
    lines = out.splitlines()
    header = next(x for x in lines if x.split()[:1] == ["rows"])
    assert header.split() == ["rows", "ctas", "threads", "unroll", "gather", "µs"]
    row1 = next(x for x in lines if x.split()[:1] == ["1"])
    assert row1.split() == ["1", "16", "256", "4", "6.97"]  # the packaged table's row 1
    from lamport_head.table import packaged_path

    text = out.replace(str(packaged_path()), "<table>")  # a clone's path may hold any word
    for word in ("stock", "speedup", "enabled", "yes", " no "):
        assert word not in text.replace("(emulated: never served)", ""), word


def test_a_served_section_shows_stock_and_what_serves_above_it(tmp_path):
    table = tmp_path / "t.yaml"
    table.write_text("schema: 1\ndevices:\n  NVIDIA H200:\n  - tp: 8\n    dcp: 1\n    rows:\n"
                     "      2: {ctas: 8, enabled: true, lamport_us: 4.5, stock_us: 20.1}\n"
                     "      16: {ctas: 32, enabled: false, lamport_us: 30.0, stock_us: 25.0}\n")
    code, out, err = _run("show", "--table", str(table), "--device", "h200")
    assert code == 0, err
    lines = [x.split() for x in out.splitlines()]
    assert ["rows", "ctas", "threads", "unroll", "enabled", "lamport", "µs", "stock", "µs"] in lines
    assert ["2", "8", "256", "4", "yes", "4.5", "20.1"] in lines
    assert ("  rows above 16: the stock gather (past the largest measured row); rows below 2 "
            "too") in out.splitlines()


@pytest.mark.parametrize("argv,message", [
    (("tune", "--tp", "3"), "lamport-head: tune: vocab 163840 / tp 3 is not a multiple of 8"),
    (("tune", "--threads", "100"), "lamport-head: tune: --threads 100 is not one of 64, 128, 256, "
                                   "512, 1024"),
    (("tune", "--unroll", "32"), "lamport-head: tune: --unroll 32 is not in 1-16"),
    (("tune", "--auto", "--tp", "3"), "lamport-head: tune: vocab 163840 / tp 3 is not a "
                                      "multiple of 8"),
    (("verify", "--tp", "3"), "lamport-head: verify: vocab 163840 / tp 3 is not a multiple of 8"),
    (("verify", "--vocab", "1000"), "lamport-head: verify: vocab 1000 / tp 8 is not a multiple "
                                    "of 8"),
    # FP32 logits: a 16-byte fragment is 4 values (1004 / 2 = 502 is not; 1000 / 8 = 125 not)
    (("verify", "--dtype", "float32", "--vocab", "1004", "--tp", "2"),
     "lamport-head: verify: vocab 1004 / tp 2 is not a multiple of 4 (float32)"),
    (("tune", "--dtype", "float32", "--vocab", "1000"),
     "lamport-head: tune: vocab 1000 / tp 8 is not a multiple of 4 (float32)"),
])
def test_gpu_commands_check_their_arguments_before_looking_for_a_gpu(argv, message):
    """The argument's error on any machine (with or without CUDA), like bench's: never
    'no CUDA GPU' for an argument that could not work anywhere."""
    code, out, err = _run(*argv)
    assert (code, out, err) == (2, "", message + "\n")


def test_a_yaml_syntax_error_is_one_line_with_file_line_and_column(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("schema: 1\ndevices:\n  H200:\n    - tp: 8\n      rows: {1: [ctas: 8}\n")
    code, out, err = _run("show", "--table", str(bad))
    assert (code, out) == (2, "")
    assert err == (f"lamport-head: {bad}:5:25: YAML syntax error: expected ',' or ']', but got "
                   "'}' (while parsing a flow sequence at line 5); the file is refused where "
                   "it is served; fix the file (or re-tune it with `lamport-head tune`)\n")


@pytest.mark.parametrize("command", ["tune", "show", "verify", "bench"])
def test_every_command_has_a_description_line(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    lines = capsys.readouterr().out.splitlines()
    # usage (possibly wrapped), a blank line, then the description before the options
    blank = lines.index("")
    description = lines[blank + 1]
    assert description and not description.startswith(("options:", "optional arguments:",
                                                        "positional arguments:")), lines[:6]


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
