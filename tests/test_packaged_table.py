"""The packaged table is what the README and the writer say a table is: one entry per
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
