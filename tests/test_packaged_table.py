"""The packaged table is what docs/tables.md and the writer say a table is: one entry per
measured row count (never a range carrying one row's figures), each with its own
latencies, and only emulated sections until real ranks are measured."""

from lamport_head.table import load_table, packaged_path


def test_one_entry_per_measured_row_count():
    table = load_table(packaged_path())
    assert table.sections
    for s in table.sections:
        keys = list(s.raw["rows"])
        assert all(isinstance(k, int) for k in keys), keys
        latencies = [s.raw["rows"][k]["lamport_us"] for k in keys]
        assert len(set(latencies)) == len(latencies)  # each row its own measurement
        assert s.emulated and not any(p.enabled for p in s.rows.values())


def test_emulated_sections_carry_no_stock_figure():
    """One GPU standing in for the TP ranks has no all-gather to compare with (its only
    stand-in was a local cat): an emulated section's rows hold the gather's time only."""
    for s in load_table(packaged_path()).sections:
        if s.emulated:
            for key, entry in s.raw["rows"].items():
                assert "stock_us" not in entry and entry["enabled"] is False, (key, entry)


def test_the_packaged_section_says_its_vocabulary():
    """Measured with the tuner's default --vocab (its command names none): written, not
    left to the loader's rule for sections without one."""
    (shipped,) = load_table(packaged_path()).sections
    assert shipped.vocab_written and shipped.vocab == 163840
    assert "--vocab" not in shipped.provenance["command"]
