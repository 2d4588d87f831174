"""The HEAD_GATHER loader: good tables with ranges, and a corpus of bad ones, each
rejected with a TableError naming the file and the entry."""

import re

import pytest

from lamport_head.config import GatherConfig
from lamport_head.table import TableError, TableRow, fill, load_table, parse

GOOD = """\
schema: 1
devices:
  NVIDIA H200:
    - tp: 8
      dcp: 1
      provenance: {gpu: NVIDIA H200, date: '2026-12-02', command: lamport-head tune}
      rows:
        1: {ctas: 8, enabled: true, lamport_us: 5.1, stock_us: 19.8}
        2-4: {ctas: 16, enabled: true, threads: 512, unroll: 2}
        5-64: {ctas: 32, enabled: false}
    - tp: 8
      dcp: 1
      emulated: true
      rows:
        1: {ctas: 4, enabled: true}
    - tp: 4
      dcp: 2
      rows:
        "1 - 2": {ctas: 1, enabled: true}
"""


def test_good_table_expands_ranges(tmp_path):
    t = parse(GOOD, "good.yaml")
    entries = t.entries("nvidia  h200", 8, 1)
    assert entries[1] == TableRow(GatherConfig(8), True)
    assert entries[3] == TableRow(GatherConfig(16, 512, 2), True)
    assert entries[64] == TableRow(GatherConfig(32), False) and 65 not in entries
    assert sorted(entries) == list(range(1, 65))
    assert t.entries("NVIDIA H200", 8, 1, emulated=True) == {1: TableRow(GatherConfig(4), True)}
    assert t.entries("NVIDIA H200", 4, 2) == {1: TableRow(GatherConfig(1), True),
                                              2: TableRow(GatherConfig(1), True)}
    assert t.entries("NVIDIA H100", 8, 1) == {} and t.entries("NVIDIA H200", 2, 1) == {}


def test_env_override_and_packaged(tmp_path, monkeypatch):
    p = tmp_path / "t.yaml"
    p.write_text(GOOD)
    monkeypatch.setenv("LAMPORT_HEAD_TABLE", str(p))
    assert load_table().entries("NVIDIA H200", 8, 1)[1].ctas == 8
    monkeypatch.delenv("LAMPORT_HEAD_TABLE")
    assert load_table().path.endswith("head_gather.yaml")  # the packaged one loads


def section(rows="1: {ctas: 8, enabled: true}", extra=""):
    return f"schema: 1\ndevices:\n  GPU X:\n    - tp: 8\n      dcp: 1\n{extra}      rows:\n        {rows}\n"


BAD = {
    "syntax": ("schema: 1\ndevices: {GPU: [", "YAML syntax"),
    "top_list": ("- 1\n- 2\n", "top level"),
    "extra_top": ("schema: 1\ndevices: {}\nextra: 1\n", "top level"),
    "schema": ("schema: 2\ndevices: {}\n", "schema 2"),
    "devices_list": ("schema: 1\ndevices: [1]\n", "'devices' must map"),
    "sections_empty": ("schema: 1\ndevices:\n  GPU X: []\n", "non-empty list"),
    "unknown_section_key": (section(extra="      colour: red\n"), "unknown key"),
    "unknown_row_key": (section("1: {ctas: 8, enabled: true, speed: 3}"), "unknown key"),
    "tp_zero": (section().replace("tp: 8", "tp: 0"), "tp must be an int in [2, 72]"),
    "tp_str": (section().replace("tp: 8", "tp: eight"), "tp must be an int in [2, 72]"),
    "dcp_bad": (section().replace("dcp: 1", "dcp: 3"), "not a multiple of dcp"),
    "dup_section": ("schema: 1\ndevices:\n  G:\n    - {tp: 2, rows: {1: {ctas: 1, enabled: true}}}\n"
                    "    - {tp: 2, dcp: 1, rows: {1: {ctas: 2, enabled: true}}}\n", "duplicate section"),
    "rows_empty": (section("{}").replace("rows:\n        {}", "rows: {}"), "rows must be a non-empty"),
    "range_malformed": (section("1-x: {ctas: 8, enabled: true}"), "neither a row count nor a range"),
    "range_reversed": (section("8-4: {ctas: 8, enabled: true}"), "reversed"),
    "row_zero": (section("0: {ctas: 8, enabled: true}"), "start at 1"),
    "range_zero": (section("0-4: {ctas: 8, enabled: true}"), "start at 1"),
    "overlap": (section("1-4: {ctas: 8, enabled: true}\n        4-8: {ctas: 8, enabled: true}"), "overlap"),
    "ctas_zero": (section("1: {ctas: 0, enabled: true}"), "ctas must be an int in"),
    "ctas_big": (section("1: {ctas: 2048, enabled: true}"), "ctas must be an int in"),
    "ctas_float": (section("1: {ctas: 8.5, enabled: true}"), "ctas must be an int in"),
    "ctas_missing": (section("1: {enabled: true}"), "missing 'ctas'"),
    "enabled_int": (section("1: {ctas: 8, enabled: 1}"), "enabled must be true or false"),
    "enabled_str": (section("1: {ctas: 8, enabled: 'true'}"), "enabled must be true or false"),
    "latency_negative": (section("1: {ctas: 8, enabled: true, lamport_us: -1}"), "non-negative"),
    "latency_str": (section("1: {ctas: 8, enabled: true, stock_us: fast}"), "non-negative"),
    "threads_bad": (section("1: {ctas: 8, enabled: true, threads: 100}"), "threads must be"),
    "dup_row_key": (section("1: {ctas: 8, enabled: true}\n        1: {ctas: 4, enabled: true}"), "duplicate key '1'"),
    "dup_device": ("schema: 1\ndevices:\n  G: []\n  G: []\n", "duplicate key 'G'"),
    "bare_on_value": (section("1: {ctas: 8, enabled: on}"), "bare 'on'"),
    "bare_off_value": (section("1: {ctas: 8, enabled: off}"), "bare 'off'"),
    "bare_yes_key": (section("1: {ctas: 8, enabled: true}").replace("dcp: 1", "dcp: 1\n      yes: 1"), "bare 'yes'"),
    "bare_on_key": (section("1: {ctas: 8, on: true}"), "read by YAML 1.1 as the boolean True"),
    "bare_no": (section("1: {ctas: 8, enabled: no}"), "bare 'no'"),
    "provenance_unknown": (section(extra="      provenance: {colour: red}\n"), "unknown provenance"),
    "emulated_str": (section(extra="      emulated: maybe\n"), "emulated must be true or false"),
    "unhashable_list_key": (section("? [1, 2]\n        : {ctas: 8, enabled: true}"), "key list at line 7"),
    "unhashable_map_key": ("schema: 1\n? {a: 1}\n: x\n", "key dict at line 2"),
    "schema_true": ("schema: true\ndevices: {}\n", "schema True is not supported"),
    "schema_float": ("schema: 1.0\ndevices: {}\n", "schema 1.0 is not supported"),
    "rows_over_limit": (section("1-4096: {ctas: 8, enabled: true}"),
                        "rows 1-4096 exceed the limit of 1024 rows: a mailbox for 4096 rows costs "
                        "2.7 GB per rank at V = 163840 bfloat16 (2 parities x rows x V x 2 bytes)"),
    "row_over_limit": (section("2048: {ctas: 8, enabled: true}"), "row 2048 exceeds the limit"),
    "vocab_zero": (section(extra="      vocab: 0\n"), "vocab must be an int in [1, 16777216]"),
    "vocab_str": (section(extra="      vocab: '128256'\n"), "vocab must be an int in [1, 16777216]"),
    "vocab_bool": (section(extra="      vocab: true\n"), "vocab must be an int in [1, 16777216]"),
    "dup_section_vocab": ("schema: 1\ndevices:\n  G:\n"
                          "    - {tp: 2, vocab: 128256, rows: {1: {ctas: 1, enabled: true}}}\n"
                          "    - {tp: 2, vocab: 151936, rows: {1: {ctas: 1, enabled: true}}}\n"
                          "    - {tp: 2, vocab: 128256, rows: {1: {ctas: 2, enabled: true}}}\n",
                          "dup_section_vocab.yaml: devices.G[2]: duplicate section for tp=2, dcp=1, "
                          "vocab=128256, stock=nccl-all-gather, dtype=bfloat16: ambiguous, two entries "
                          "(devices.G[0] vocab=128256, "
                          "devices.G[2] vocab=128256)"),
    "dup_section_unwritten_vocab": (
        "schema: 1\ndevices:\n  G:\n    - {tp: 2, rows: {1: {ctas: 1, enabled: true}}}\n"
        "    - {tp: 2, vocab: 163840, rows: {1: {ctas: 2, enabled: true}}}\n",
        "ambiguous, two entries (devices.G[0] vocab=163840 (not written: taken as 163840), "
        "devices.G[1] vocab=163840)"),
    "device_case_dup": ("schema: 1\ndevices:\n  GPU X: [{tp: 2, rows: {1: {ctas: 1, enabled: true}}}]\n"
                        "  gpu x: [{tp: 2, rows: {1: {ctas: 1, enabled: true}}}]\n", "case-insensitively"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_table_names_file_and_entry(tmp_path, name):
    text, message = BAD[name]
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    with pytest.raises(TableError) as err:
        load_table(path)
    assert str(path) in str(err.value)
    assert message in str(err.value)


def test_missing_file_is_a_table_error(tmp_path):
    with pytest.raises(TableError, match="cannot read"):
        load_table(tmp_path / "nope.yaml")


def test_quoted_words_are_fine():
    t = parse(section("1: {ctas: 8, enabled: true}").replace("GPU X", "'on'"))
    assert t.entries("on", 8, 1)[1].ctas == 8


def test_huge_range_is_rejected_before_it_is_expanded():
    import time

    start = time.perf_counter()
    with pytest.raises(TableError, match="rows 1-30000000 exceed the limit of 1024 rows"):
        parse(section("1-30000000: {ctas: 8, enabled: true}"), "huge.yaml")
    assert time.perf_counter() - start < 2.0


def test_range_up_to_the_limit_loads():
    assert len(parse(section("1-1024: {ctas: 8, enabled: true}")).entries("GPU X", 8, 1)) == 1024


FILL = """\
schema: 1
devices:
  GPU X:
    - tp: 8
      rows:
        2: {ctas: 2, enabled: true}
        4: {ctas: 4, enabled: true, threads: 128}
        8: {ctas: 8, enabled: false}
        16-20: {ctas: 16, enabled: true}
        32: {ctas: 32, enabled: true, unroll: 8}
"""


def test_gaps_fill_from_the_row_above():
    entries = parse(FILL).entries("GPU X", 8, 1)
    assert 1 not in entries  # below the smallest measured row: no lower neighbour, stock
    assert entries[2] == TableRow(GatherConfig(2), True)  # measured rows are served as written
    assert entries[3] == TableRow(GatherConfig(4, 128), True, filled=True)  # both neighbours on
    for m in (5, 6, 7):  # enabled below, disabled above: stays disabled
        assert entries[m] == TableRow(GatherConfig(8), False, filled=True)
    for m in range(9, 16):  # disabled below, enabled above: stays disabled
        assert entries[m] == TableRow(GatherConfig(16), False, filled=True)
    # a range: all measured
    assert all(entries[m] == TableRow(GatherConfig(16), True) for m in range(16, 21))
    assert all(entries[m] == TableRow(GatherConfig(32, 256, 8), True, filled=True)
               for m in range(21, 32))
    assert max(entries) == 32  # past the largest measured row: stock
    assert sorted(entries) == list(range(2, 33))


def test_a_tables_entries_are_table_rows():
    """``Table.entries`` answers ``{rows: TableRow}``, each row with ``.ctas`` and
    ``.enabled``; the 0.3 names (``RowPlan``, ``Table.plan``) are gone in 0.4."""
    import lamport_head.table as table

    t = parse(FILL)
    assert t.entries("GPU X", 8, 1) and t.entries("GPU Y", 8, 1) == {}
    assert all(isinstance(r, TableRow) and isinstance(r.ctas, int) and isinstance(r.enabled, bool)
               for r in t.entries("GPU X", 8, 1).values())
    assert not hasattr(table, "RowPlan") and not hasattr(t, "plan")


def test_fill_from_row_one_leaves_nothing_below():
    four, eight = TableRow(GatherConfig(4), True), TableRow(GatherConfig(8), True)
    entries = fill({1: four, 4: eight})
    gap = TableRow(GatherConfig(8), True, filled=True)
    assert entries == {1: four, 2: gap, 3: gap, 4: eight}
    off = TableRow(GatherConfig(1), False)
    assert fill({}) == {} and fill({5: off}) == {5: off}


def layer(*sections):
    """A table text of (device, tp, ctas, emulated) sections, each serving row 1."""
    return "schema: 1\ndevices:\n" + "".join(
        f"  {device}:\n    - tp: {tp}\n      emulated: {str(emulated).lower()}\n"
        f"      rows:\n        1: {{ctas: {ctas}, enabled: true}}\n"
        for device, tp, ctas, emulated in sections)


def test_layers_higher_replaces_lower(tmp_path, monkeypatch):
    from lamport_head.table import layer_paths, packaged_path, user_path

    shipped = next(s for s in load_table(packaged_path()).sections)
    assert layer_paths() == [packaged_path()]  # no user table yet, no env
    assert load_table().entries(shipped.device, shipped.tp, shipped.dcp, emulated=shipped.emulated)
    user = user_path()
    user.parent.mkdir(parents=True, exist_ok=True)
    # the user's section for the shipped key is spelled in another case: still the same key
    user.write_text(layer(("GPU X", 8, 2, False), ("GPU Z", 4, 4, False),
                          (shipped.device.lower(), shipped.tp, 5, shipped.emulated)))
    t = load_table()
    assert t.layers == [str(packaged_path()), str(user)]
    assert t.entries("GPU X", 8, 1)[1].ctas == 2
    assert t.entries(shipped.device, shipped.tp, 1, emulated=shipped.emulated) == {
        1: TableRow(GatherConfig(5), True)}
    assert t.section(shipped.device, shipped.tp, 1, emulated=shipped.emulated).source == str(user)
    env = tmp_path / "env.yaml"
    env.write_text(layer(("GPU X", 8, 3, False)))
    monkeypatch.setenv("LAMPORT_HEAD_TABLE", str(env))
    t = load_table()
    assert t.layers == [str(packaged_path()), str(user), str(env)] and t.path == str(env)
    assert t.entries("GPU X", 8, 1)[1].ctas == 3  # the env layer wins
    assert t.section("GPU X", 8, 1).source == str(env)
    assert t.entries("GPU Z", 4, 1)[1].ctas == 4  # a section only the user has stays
    keys = [(s.device.lower(), s.tp, s.dcp, s.emulated) for s in t.sections]
    assert len(keys) == len(set(keys))  # one section per key
    one = load_table(env)  # a path reads that one file
    assert one.layers == [str(env)] and len(one.sections) == 1


def test_user_table_location(tmp_path, monkeypatch):
    from lamport_head.table import user_path

    monkeypatch.setenv("LAMPORT_HEAD_CACHE", str(tmp_path / "c"))
    assert user_path() == tmp_path / "c" / "head_gather.yaml"
    monkeypatch.delenv("LAMPORT_HEAD_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_path() == tmp_path / "xdg" / "lamport-head" / "head_gather.yaml"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert user_path() == tmp_path / "home" / ".cache" / "lamport-head" / "head_gather.yaml"


def test_bad_layer_names_its_file(tmp_path, monkeypatch):
    """Issue 40: a layer that cannot be read whole is one problem line naming its file
    and what to do, and the layers below it serve (was: the whole view raised)."""
    from lamport_head.table import user_path

    user_path().parent.mkdir(parents=True, exist_ok=True)
    user_path().write_text(section("1: {ctas: 8, enabled: on}"))
    table = load_table()
    (problem,) = table.problems
    assert "bare 'on'" in problem.line and str(user_path()) in problem.line
    assert "sets it aside" in problem.line and table.broken and "bare 'on'" in table.broken
    assert table.layers[0].endswith("head_gather.yaml") and table.sections  # packaged serves
    monkeypatch.setenv("LAMPORT_HEAD_TABLE", str(tmp_path / "missing.yaml"))
    user_path().unlink()
    table = load_table()
    (problem,) = table.problems
    assert "missing.yaml: cannot read" in problem.line and "unset LAMPORT_HEAD_TABLE" in problem.line
    assert table.broken is None  # never the person's file
    with pytest.raises(TableError, match="missing.yaml: cannot read"):
        load_table(tmp_path / "missing.yaml")  # one file asked for: strict


def test_a_table_that_is_not_utf8_is_one_table_error(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("schema: 1\ndevices: {}\n# caf\xe9\n".encode("latin-1"))
    with pytest.raises(TableError, match=r"latin1\.yaml: not a UTF-8 text file \(byte 0xe9 at "
                                         r"offset 27\); a table is YAML text"):
        load_table(path)


@pytest.mark.parametrize("text,where,what", [
    ("schema: 1\ndevices:\n  H200:\n    - tp: 8\n      rows: {1: [ctas: 8}\n", "5:25",
     "YAML syntax error: expected ',' or ']', but got '}' (while parsing a flow sequence at line 5)"),
    ("schema: 1\ndevices:\n  H200:\n  - tp: 8\n   dcp: 1\n", "5:4",
     "YAML syntax error: expected <block end>, but found '<block mapping start>' (while parsing "
     "a block mapping at line 3)"),
    ("schema: 1\n\tdevices: {}\n", "2:1", "YAML syntax error: found character '\\t' that cannot "
     "start any token (while scanning for the next token)"),
    ("schema: 1\ndevices: {}\n# \x01\n", "3:3", "YAML syntax error: unacceptable character "
     "#x0001: special characters are not allowed"),
])
def test_a_yaml_syntax_error_is_one_line_naming_file_line_and_column(tmp_path, text, where, what):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(TableError) as err:
        load_table(path)
    assert str(err.value) == f"{path}:{where}: {what}"  # one line: no quoted text, no caret


VOCABS = """\
schema: 1
devices:
  NVIDIA H200:
    - tp: 8
      vocab: 128256
      rows:
        1: {ctas: 8, enabled: true}
    - tp: 8
      vocab: 163840
      rows:
        1: {ctas: 16, enabled: true}
    - tp: 4
      rows:
        1: {ctas: 32, enabled: true}
"""


def test_sections_are_keyed_by_vocabulary():
    """Issue 32 item 3: one section per vocabulary V; ``entries(..., vocab=V)`` serves the
    section measured at V and nothing measured at another V."""
    t = parse(VOCABS, "v.yaml")
    assert t.entries("NVIDIA H200", 8, 1, vocab=128256)[1].ctas == 8
    assert t.entries("NVIDIA H200", 8, 1, vocab=163840)[1].ctas == 16
    assert t.entries("NVIDIA H200", 8, 1, vocab=151936) == {}  # Qwen's V: not measured, not served
    assert t.section("NVIDIA H200", 8, 1, vocab=151936) is None
    assert t.vocabs("NVIDIA H200", 8, 1) == [128256, 163840]


def test_no_vocabulary_asked_takes_the_one_section_or_names_the_choices():
    t = parse(VOCABS, "v.yaml")
    assert t.entries("NVIDIA H200", 4, 1)[1].ctas == 32  # one section for (GPU, TP, DCP): it
    assert t.entries("NVIDIA H200", 2, 1) == {}
    with pytest.raises(TableError) as err:
        t.entries("NVIDIA H200", 8, 1)
    assert str(err.value) == (
        "v.yaml: 2 sections for NVIDIA H200, tp=8, dcp=1, one per vocabulary, stock and dtype: "
        "v.yaml: NVIDIA H200 tp=8 dcp=1 vocab=128256 stock=nccl-all-gather dtype=bfloat16; "
        "v.yaml: NVIDIA H200 tp=8 dcp=1 vocab=163840 stock=nccl-all-gather dtype=bfloat16; "
        "ask for one with vocab=V, stock=S, dtype=D")


def test_a_section_without_vocab_is_taken_as_the_tuners_default():
    """Tables written before sections carried ``vocab`` still load: such a section is
    V = 163840 (the tuner's default --vocab), served to that V only."""
    from lamport_head.table import KIMI_K2_VOCAB

    t = parse(VOCABS, "v.yaml")
    (old,) = [s for s in t.sections if s.tp == 4]
    assert KIMI_K2_VOCAB == 163840
    assert old.vocab == 163840 and not old.vocab_written
    assert t.entries("NVIDIA H200", 4, 1, vocab=163840)[1].ctas == 32
    assert t.entries("NVIDIA H200", 4, 1, vocab=128256) == {}
    assert all(s.vocab_written for s in t.sections if s.tp == 8)


def test_a_higher_layer_replaces_a_lower_one_only_for_the_same_vocabulary(tmp_path, monkeypatch):
    from lamport_head.table import user_path

    user = user_path()
    user.parent.mkdir(parents=True, exist_ok=True)
    user.write_text(VOCABS)
    env = tmp_path / "env.yaml"
    env.write_text("schema: 1\ndevices:\n  nvidia h200:\n    - tp: 8\n      vocab: 163840\n"
                   "      rows:\n        1: {ctas: 64, enabled: true}\n    - tp: 4\n"
                   "      vocab: 128256\n      rows:\n        1: {ctas: 2, enabled: true}\n")
    monkeypatch.setenv("LAMPORT_HEAD_TABLE", str(env))
    t = load_table()
    assert t.entries("NVIDIA H200", 8, 1, vocab=163840)[1].ctas == 64  # the same V: replaced
    assert t.section("NVIDIA H200", 8, 1, vocab=163840).source == str(env)
    assert t.entries("NVIDIA H200", 8, 1, vocab=128256)[1].ctas == 8  # another V: kept
    assert t.section("NVIDIA H200", 8, 1, vocab=128256).source == str(user)
    # the user's tp-4 section has no vocab (163840): the env's tp-4 one at 128256 is beside it
    assert t.entries("NVIDIA H200", 4, 1, vocab=163840)[1].ctas == 32
    assert t.entries("NVIDIA H200", 4, 1, vocab=128256)[1].ctas == 2


def test_the_writer_writes_vocab_and_replaces_only_the_same_vocabulary(tmp_path):
    import yaml

    from lamport_head.tuning.writer import merge_section

    path = tmp_path / "t.yaml"
    path.write_text("schema: 1\ndevices:\n  GPU X:\n    - tp: 2\n      rows:\n"
                    "        1: {ctas: 1, enabled: true}\n")  # no vocab: 163840
    merge_section(path, "GPU X", 2, 1, {1: {"ctas": 2, "enabled": True}}, {}, vocab=128256)
    merge_section(path, "GPU X", 2, 1, {1: {"ctas": 3, "enabled": True}}, {}, vocab=128256)
    sections = yaml.safe_load(path.read_text())["devices"]["GPU X"]
    assert [(s.get("vocab"), s["rows"][1]["ctas"]) for s in sections] == [(128256, 3), (None, 1)]
    merge_section(path, "GPU X", 2, 1, {1: {"ctas": 4, "enabled": True}}, {})  # the default V
    sections = yaml.safe_load(path.read_text())["devices"]["GPU X"]
    assert [(s["vocab"], s["rows"][1]["ctas"]) for s in sections] == [(128256, 3), (163840, 4)]
    t = load_table(path)
    assert t.entries("GPU X", 2, 1, vocab=163840)[1].ctas == 4


def test_show_prints_each_sections_vocabulary(tmp_path, capsys):
    from lamport_head import cli

    p = tmp_path / "v.yaml"
    p.write_text(VOCABS)
    assert cli.main(["show", "--table", str(p), "--device", "NVIDIA H200"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if "vocab V" in line] == [
        "  vocab V = 128256, 16032 a rank",
        "  vocab V = 163840, 20480 a rank",
        "  vocab V = 163840, 40960 a rank (not written in the section: taken as 163840, the "
        "tuner's default; served only to a model of that V)"]
    assert out.index("NVIDIA H200  tp=8 dcp=1") < out.index("  vocab V = 128256, 16032 a rank")


STOCKS = """\
schema: 1
devices:
  NVIDIA H200:
    - tp: 8
      vocab: 163840
      rows:
        1: {ctas: 16, enabled: true}
    - tp: 8
      vocab: 163840
      stock: multimem-all-gather
      rows:
        1: {ctas: 8, enabled: false}
"""


def test_sections_are_keyed_by_the_stock_they_were_measured_against():
    """Issue 32 item 4: a section names the engine gather its rows beat (``stock``); a
    section measured against NCCL is not served where the route replaces SGLang's
    multimem one-shot gather, and one written without ``stock`` is NCCL's."""
    from lamport_head.table import MULTIMEM_STOCK, NCCL_STOCK

    t = parse(STOCKS, "s.yaml")
    nccl = t.section("NVIDIA H200", 8, 1, vocab=163840, stock=NCCL_STOCK)
    multimem = t.section("NVIDIA H200", 8, 1, vocab=163840, stock=MULTIMEM_STOCK)
    assert (nccl.stock, nccl.rows[1].ctas) == (NCCL_STOCK, 16) and "stock" not in nccl.raw
    assert (multimem.stock, multimem.rows[1].enabled) == (MULTIMEM_STOCK, False)
    assert t.entries("NVIDIA H200", 8, 1, vocab=163840, stock=MULTIMEM_STOCK)[1].ctas == 8
    only_nccl = parse(STOCKS.split("    - tp: 8\n      vocab: 163840\n      stock")[0], "n.yaml")
    assert only_nccl.entries("NVIDIA H200", 8, 1, vocab=163840, stock=MULTIMEM_STOCK) == {}
    with pytest.raises(TableError, match="one per vocabulary, stock and dtype"):
        t.entries("NVIDIA H200", 8, 1, vocab=163840)


def test_a_stock_the_loader_does_not_know_and_a_repeated_stock_are_refused():
    with pytest.raises(TableError, match=r"stock must be one of nccl-all-gather, "
                                         r"multimem-all-gather, nccl-all-to-all, "
                                         r"custom-all-gather .*got 'nccl'"):
        parse(STOCKS.replace("stock: multimem-all-gather", "stock: nccl"), "s.yaml")
    with pytest.raises(TableError, match="duplicate section .*stock=nccl-all-gather, dtype=bfloat16: ambiguous"):
        parse(STOCKS.replace("stock: multimem-all-gather", "stock: nccl-all-gather"), "s.yaml")


def test_an_all_to_all_section_is_keyed_apart_from_the_gathers():
    """Issue 43: the all-to-all's rows (the step's total M) live in sections of stock
    ``nccl-all-to-all``, beside the gather's of the same GPU, TP, DCP, V and dtype."""
    from lamport_head.table import ALL_TO_ALL_STOCK, NCCL_STOCK

    t = parse(STOCKS.replace("stock: multimem-all-gather", f"stock: {ALL_TO_ALL_STOCK}"),
              "s.yaml")
    gather = t.entries("NVIDIA H200", 8, 1, vocab=163840, stock=NCCL_STOCK)
    a2a = t.entries("NVIDIA H200", 8, 1, vocab=163840, stock=ALL_TO_ALL_STOCK)
    assert gather[1].ctas == 16 and a2a[1].ctas == 8


def test_a_custom_all_gather_section_is_keyed_apart_from_nccls():
    """Issue 48 item 3: a vLLM release whose LogitsProcessor gathers through
    ``CudaCommunicator.custom_all_gather`` is served only from sections measured against
    it (``custom-all-gather``), never from NCCL's of the same GPU, TP, DCP, V and dtype."""
    from lamport_head.table import CUSTOM_STOCK, NCCL_STOCK

    t = parse(STOCKS.replace("stock: multimem-all-gather", f"stock: {CUSTOM_STOCK}"), "s.yaml")
    nccl = t.entries("NVIDIA H200", 8, 1, vocab=163840, stock=NCCL_STOCK)
    custom = t.entries("NVIDIA H200", 8, 1, vocab=163840, stock=CUSTOM_STOCK)
    assert nccl[1].ctas == 16 and custom[1].ctas == 8 and not custom[1].enabled
    assert parse(STOCKS.split("    - tp: 8\n      vocab: 163840\n      stock")[0],
                 "n.yaml").entries("NVIDIA H200", 8, 1, vocab=163840, stock=CUSTOM_STOCK) == {}


def test_the_writer_writes_stock_and_replaces_only_the_same_stock(tmp_path):
    import yaml

    from lamport_head.table import MULTIMEM_STOCK
    from lamport_head.tuning.writer import merge_section

    path = tmp_path / "t.yaml"
    path.write_text(STOCKS)
    merge_section(path, "NVIDIA H200", 8, 1, {1: {"ctas": 32, "enabled": True}}, {},
                  vocab=163840, stock=MULTIMEM_STOCK)
    sections = yaml.safe_load(path.read_text())["devices"]["NVIDIA H200"]
    assert sorted((s.get("stock", ""), s["rows"][1]["ctas"]) for s in sections) == [
        ("", 16), (MULTIMEM_STOCK, 32)]
    merge_section(path, "NVIDIA H200", 8, 1, {1: {"ctas": 4, "enabled": True}}, {}, vocab=163840)
    t = load_table(path)
    assert t.entries("NVIDIA H200", 8, 1, vocab=163840, stock="nccl-all-gather")[1].ctas == 4
    assert t.entries("NVIDIA H200", 8, 1, vocab=163840, stock=MULTIMEM_STOCK)[1].ctas == 32


def test_show_prints_each_sections_stock(tmp_path, capsys):
    from lamport_head import cli

    p = tmp_path / "s.yaml"
    p.write_text(STOCKS)
    assert cli.main(["show", "--table", str(p), "--device", "NVIDIA H200"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line for line in out if "measured against" in line] == [
        "  measured against nccl-all-gather (not written in the section: NCCL's all-gather); "
        "served only where the route replaces that gather",
        "  measured against multimem-all-gather; served only where the route replaces that "
        "gather"]


# Issue 40: tables that heal (the loader's side; the install side is test_autotune's).

def _written(tmp_path):
    """A table as the tool writes it (sealed), two sections."""
    from lamport_head.tuning.writer import merge_section

    path = tmp_path / "w.yaml"
    for vocab in (128, 192):
        merge_section(path, "NVIDIA H200", 2, 1, {m: {"ctas": 8 * m, "enabled": True}
                                                  for m in (1, 2, 4, 8, 16)},
                      {"gpu": "NVIDIA H200"}, vocab=vocab)
    return path


def test_a_written_table_cut_anywhere_reads_as_torn(tmp_path):
    """Item 2: every cut of a sealed table, line boundaries included (where the rest is
    a smaller valid YAML table), is a TableError; the whole file loads."""
    path = _written(tmp_path)
    whole = path.read_text()
    assert len(load_table(path).sections) == 2
    for at in range(len(whole)):
        with pytest.raises(TableError):
            parse(whole[:at], "cut.yaml")
    for at in (i + 1 for i, c in enumerate(whole) if c == "\n" and i + 1 < len(whole)):
        with pytest.raises(TableError, match="torn"):
            parse(whole[:at], "cut.yaml")


def test_a_hand_written_table_has_no_seal_and_loads():
    """Item 2: a table a person wrote (no seal line) loads as before; an edited sealed
    one is torn and says so."""
    assert parse(GOOD, "hand.yaml").sections
    from lamport_head.tablefile import seal

    sealed = seal(GOOD)
    assert parse(sealed, "s.yaml").sections
    with pytest.raises(TableError, match="edited by hand"):
        parse(sealed.replace("ctas: 8", "ctas: 9"), "s.yaml")


ABSURD = {
    "ctas_zero": ("1: {ctas: 0, enabled: true}", "ctas must be an int in [1, 1024]"),
    "ctas_negative": ("1: {ctas: -1, enabled: true}", "ctas must be an int in [1, 1024]"),
    "ctas_huge": ("1: {ctas: 1000000000, enabled: true}", "ctas must be an int in [1, 1024]"),
    "rows_2000": ("2000: {ctas: 8, enabled: true}", "row 2000 exceeds the limit"),
    "rows_overlap": ("1-4: {ctas: 8, enabled: true}\n        2: {ctas: 8, enabled: true}",
                     "overlap"),
    "stock_inf": ("1: {ctas: 8, enabled: true, stock_us: .inf}", "finite non-negative"),
    "lamport_nan": ("1: {ctas: 8, enabled: true, lamport_us: .nan}", "finite non-negative"),
}
ABSURD_SECTIONS = {
    "tp_4096": ("tp: 4096", "tp must be an int in [2, 72]"),
    "tp_1": ("tp: 1", "tp must be an int in [2, 72]"),
    "vocab_huge": ("tp: 2\n      vocab: 1000000000000000000000000000000",
                   "vocab must be an int in [1, 16777216]"),
    "vocab_not_divisible": ("tp: 3\n      vocab: 128", "not a multiple of tp=3"),
}


def _two_sections(first_rows="1: {ctas: 8, enabled: true}", first_head="tp: 2"):
    return ("schema: 1\ndevices:\n  NVIDIA H200:\n"
            f"    - {first_head}\n      dcp: 1\n      rows:\n        {first_rows}\n"
            "    - tp: 4\n      rows:\n        1: {ctas: 8, enabled: true}\n")


@pytest.mark.parametrize("name", sorted(ABSURD) + sorted(ABSURD_SECTIONS))
def test_absurd_values_cost_their_section_only(name):
    """Items 5 and 1: what no GPU serves is rejected in one line (strict: the error;
    lenient, as serving reads: that section skipped, the other one served)."""
    if name in ABSURD:
        rows, message = ABSURD[name]
        text = _two_sections(first_rows=rows)
    else:
        head, message = ABSURD_SECTIONS[name]
        text = _two_sections(first_head=head)
    with pytest.raises(TableError, match=re.escape(message)):
        parse(text, "t.yaml")
    from lamport_head.table import read

    table = read(text, "t.yaml")
    (problem,) = table.problems
    assert message in problem.line and problem.kind == "section"
    assert [s.tp for s in table.sections] == [4]


def test_a_newer_schema_section_is_skipped_and_the_rest_serves():
    from lamport_head.table import read

    text = _two_sections().replace("    - tp: 4\n", "    - schema: 2\n      tp: 4\n")
    table = read(text, "t.yaml")
    (problem,) = table.problems
    assert problem.kind == "newer" and "schema 2, newer than this lamport-head" in problem.line
    assert [s.tp for s in table.sections] == [2]


def test_odd_yaml_in_a_newer_file_costs_a_section_or_reads_as_broken():
    """A newer file's section that is no mapping is a bad section (it raised TypeError or
    ValueError out of the lenient loader, which no rank's vote tells apart from a broken
    engine); YAML nested past Python's recursion limit is a TableError, not a crash."""
    from lamport_head.table import read

    for odd in ("5", "ab"):
        text = _two_sections().replace("schema: 1", "schema: 2").replace(
            "  NVIDIA H200:\n", f"  NVIDIA H200:\n    - {odd}\n", 1)
        table = read(text, "t.yaml")
        assert any("expected a mapping" in p.line for p in table.problems), table.problems
    with pytest.raises(TableError, match="nested too deeply"):
        read("schema: 1\ndevices: " + "[" * 20000 + "]" * 20000 + "\n", "t.yaml")


def test_show_says_what_to_do_for_each_problem(tmp_path, capsys):
    """Item 1: ``show`` lists each skipped section or layer with what to do, and still
    shows what serves (it used to print the error and exit 2)."""
    from lamport_head.cli import main
    from lamport_head.table import user_path

    user_path().parent.mkdir(parents=True, exist_ok=True)
    user_path().write_text(_two_sections(first_head="tp: 4096"))
    assert main(["show", "--device", "NVIDIA H200", "--tp", "4"]) == 0
    out, err = capsys.readouterr()
    assert "problem: " in err and "tp must be an int in [2, 72]" in err
    assert "first-use tuning measures it again" in err and "tp=4" in out
    user_path().write_text(user_path().read_text()[:20])
    assert main(["show", "--device", "NVIDIA H200"]) == 0
    assert "the next engine start sets it aside" in capsys.readouterr().err
    assert main(["show", "--table", str(user_path())]) == 2  # a file checked by name
    cut = tmp_path / "cut.yaml"
    cut.write_text(_written(tmp_path).read_text()[:300])
    assert main(["show", "--table", str(cut)]) == 2
    err = capsys.readouterr().err
    assert "torn" in err and "fix the file" in err


def test_versions_of_one_key_are_one_per_environment():
    """Item 4: two sections of one key measured in different environments are versions,
    not duplicates: the one measured in this environment serves, else the newest; two
    of one environment are still ambiguous."""
    from lamport_head.table import MAX_VERSIONS, read

    def sec(torch, date):
        return (f"    - {{tp: 2, vocab: 128, provenance: {{torch: '{torch}', date: '{date}'}}, "
                "rows: {1: {ctas: 8, enabled: true}}}\n")

    text = "schema: 1\ndevices:\n  G:\n" + sec("2.14", "2026-12-02") + sec("2.13", "2026-12-01")
    table = read(text, "t.yaml")
    assert not table.problems and len(table.sections) == 2
    assert table.section("G", 2, 1).provenance["torch"] == "2.14"  # the newest
    table.facts = {"torch": "2.13"}
    assert table.section("G", 2, 1).provenance["torch"] == "2.13"  # this environment's
    with pytest.raises(TableError, match="duplicate section"):
        parse("schema: 1\ndevices:\n  G:\n" + sec("2.13", "a") + sec("2.13", "b"), "t.yaml")
    assert MAX_VERSIONS >= 2


def test_a_file_a_person_named_is_never_the_one_set_aside_however_spelled(tmp_path, monkeypatch):
    """The torn user table is marked for install to set aside (its problem ``aside``);
    named in LAMPORT_HEAD_TABLE, through a link or a relative path too, it is refused
    and never marked."""
    from lamport_head.table import load_layers, user_path

    user_path().parent.mkdir(parents=True, exist_ok=True)
    user_path().write_text(_two_sections()[:20])
    monkeypatch.delenv("LAMPORT_HEAD_TABLE", raising=False)
    table = load_layers()
    assert table.broken and [p.aside for p in table.problems] == [True]
    link = tmp_path / "named.yaml"
    link.symlink_to(user_path())
    monkeypatch.chdir(user_path().parent)
    for named in (str(link), "head_gather.yaml"):
        monkeypatch.setenv("LAMPORT_HEAD_TABLE", named)
        table = load_layers()
        assert table.broken is None and not any(p.aside for p in table.problems), named
        assert any("unset LAMPORT_HEAD_TABLE" in p.line for p in table.problems), named


DTYPES_TABLE = """\
schema: 1
devices:
  NVIDIA H200:
    - tp: 2
      vocab: 128
      rows:
        1-4: {ctas: 8, enabled: true}
"""


def test_a_bf16_section_does_not_serve_an_fp32_head():
    """Issue 42: a section is measured for one logits dtype (the bytes a row moves). A
    section written without ``dtype`` is BF16 (``dtypes.DEFAULT``) and is not served to a
    model whose lm_head runs in FP32: asked for float32, the table has nothing; an
    FP32 section of the same key sits beside it and serves FP32 only."""
    import torch

    from lamport_head import dtypes

    t = parse(DTYPES_TABLE, "d.yaml")
    assert dtypes.DEFAULT == "bfloat16"
    bf16 = t.section("NVIDIA H200", 2, 1, vocab=128, dtype=torch.bfloat16)
    assert bf16.dtype == "bfloat16" and "dtype" not in bf16.raw
    assert t.section("NVIDIA H200", 2, 1, vocab=128, dtype=torch.float32) is None
    assert t.entries("NVIDIA H200", 2, 1, vocab=128, dtype="float32") == {}
    both = parse(DTYPES_TABLE + "    - tp: 2\n      vocab: 128\n      dtype: float32\n"
                 "      rows:\n        1-2: {ctas: 16, enabled: true}\n", "d.yaml")
    assert {m: e.ctas for m, e in both.entries("NVIDIA H200", 2, 1, vocab=128,
                                               dtype="float32").items()} == {1: 16, 2: 16}
    assert both.entries("NVIDIA H200", 2, 1, vocab=128, dtype="bfloat16")[4].ctas == 8
    assert both.dtypes("NVIDIA H200", 2, 1, 128, "nccl-all-gather") == ["bfloat16", "float32"]
    with pytest.raises(TableError, match="one per vocabulary, stock and dtype"):
        both.entries("NVIDIA H200", 2, 1, vocab=128)


@pytest.mark.parametrize("bad", ["float16", "fp32", "'bfloat16 '", "[float32]", "32"])
def test_a_dtype_the_loader_does_not_know_costs_that_section_only(bad):
    """An unknown ``dtype`` is a defect of its section: ``parse`` raises naming the file
    and the entry; serving's lenient read skips that section (one ``Problem``) and the
    rest of the file serves."""
    from lamport_head.table import read

    text = DTYPES_TABLE + (f"    - tp: 4\n      vocab: 128\n      dtype: {bad}\n"
                           "      rows:\n        1: {ctas: 8, enabled: true}\n")
    with pytest.raises(TableError, match=r"d\.yaml: devices\.NVIDIA H200\[1\] \(tp=4, dcp=1\): "
                                         r"dtype must be one of bfloat16, float32"):
        parse(text, "d.yaml")
    table = read(text, "d.yaml")
    (problem,) = table.problems
    assert problem.kind == "section" and "dtype must be one of" in problem.line
    assert [(s.tp, s.dtype) for s in table.sections] == [(2, "bfloat16")]


def test_the_writer_writes_dtype_and_replaces_only_the_same_dtype(tmp_path):
    import yaml

    from lamport_head.tuning.writer import merge_section

    path = tmp_path / "t.yaml"
    path.write_text(DTYPES_TABLE)
    merge_section(path, "NVIDIA H200", 2, 1, {1: {"ctas": 32, "enabled": True}}, {},
                  vocab=128, dtype="float32")
    merge_section(path, "NVIDIA H200", 2, 1, {1: {"ctas": 24, "enabled": True}}, {},
                  vocab=128, dtype="float32")  # the same key: replaced
    sections = yaml.safe_load(path.read_text().split("\n", 1)[1])["devices"]["NVIDIA H200"]
    assert [(s.get("dtype"), s["rows"].get(1, {}).get("ctas")) for s in sections] == [
        (None, None), ("float32", 24)]  # the hand-written BF16 section kept as written
    table = load_table(path)
    assert table.entries("NVIDIA H200", 2, 1, vocab=128, dtype="bfloat16")[3].ctas == 8
    with pytest.raises(ValueError, match="float16 is not served"):
        merge_section(path, "NVIDIA H200", 2, 1, {1: {"ctas": 8, "enabled": True}}, {},
                      vocab=128, dtype="float16")
