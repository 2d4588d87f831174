"""Merging tuned sections into the HEAD_GATHER YAML, atomically and durably.

Only the section being written (device, tp, dcp, emulated, vocab, stock, dtype) is
replaced; every other device and section is kept as it was: a section for another
vocabulary or dtype stays beside it (a section written before sections carried ``vocab``
counts as ``table.KIMI_K2_VOCAB``; one written without ``stock``, ``table.NCCL_STOCK``;
one without ``dtype``, ``dtypes.DEFAULT``). The new text is validated with the loader
before it replaces the file, sealed and durably (``tablefile``: the seal lets a reader
tell a cut file from a whole one; temporary file, fsync, rename, fsync of the
directory; the mode follows the umask), so a reader never sees a half-written or
invalid table, not even after a host crash. Merging into a file that cannot be read
whole (torn, not a table) sets that file aside (renamed beside itself with a timestamp,
one warning) and starts a fresh one; a section of it the loader cannot read is dropped
(one warning: it could serve nothing), one of a newer schema is kept as it is. The read-modify-write holds an
exclusive lock (``flock`` on ``.head_gather.lock`` beside the table), so writers of
different sections at once (several TP groups' rank 0s on one host, DP > 1) lose none.
"""

import logging
import math
from pathlib import Path

import yaml

from lamport_head import tablefile
from lamport_head import dtypes
from lamport_head.dtypes import name as dtype_name
from lamport_head.table import (KIMI_K2_VOCAB,
                                MAX_VERSIONS, NCCL_STOCK, SCHEMA, TableError, load_table,
                                normalize, read, version)

logger = logging.getLogger("lamport_head")


def _load(path):
    """The data to merge into: the file's readable sections and its newer-schema ones
    (as written), in file order; nothing when it is absent or set aside."""
    path = Path(path)
    if not path.exists():
        return {"schema": SCHEMA, "devices": {}}
    try:
        table = load_table(path, strict=False)
    except TableError as exc:
        aside = tablefile.set_aside(path)
        logger.warning(tablefile.aside_line(path, aside, exc, "a fresh table is written in its "
                                            "place"))
        return {"schema": SCHEMA, "devices": {}}
    devices = {}
    for s in table.sections:
        devices.setdefault(s.device, []).append(dict(s.raw))
    for device, raw in table.kept:
        devices.setdefault(device, []).append(raw)
    dropped = [p for p in table.problems if p.kind != "newer"]
    if dropped:  # each was its own line when read; one line for the lot here
        logger.warning("lamport-head: %d section(s) of %s the loader cannot read dropped while "
                       "writing it (first: %s)", len(dropped), path, dropped[0].line)
    return {"schema": SCHEMA, "devices": devices}


def measured_rows(results):
    """{rows: entry} for the YAML: one entry per measured row count, never a range.
    The tuner writes only what it measured; serving fills the gaps (table.fill)."""
    table = {}
    for r in sorted(results, key=lambda r: r.rows):
        knobs = r.entry.config.values()  # every field: a new knob is written as it is
        entry = {"ctas": knobs.pop("ctas"), "enabled": r.entry.enabled, **knobs}
        if math.isfinite(r.lamport_us):
            entry["lamport_us"] = round(r.lamport_us, 2)
        entry["stock_us"] = round(r.stock_us, 2)
        table[r.rows] = entry
    return table


def merge_section(path, device, tp, dcp, rows, provenance, *, emulated=False,
                  vocab=KIMI_K2_VOCAB, stock=NCCL_STOCK, dtype=dtypes.DEFAULT):
    """Write ``rows`` ({key: entry}) as the (device, tp, dcp, emulated, vocab, stock,
    dtype) section; ``vocab``: the full vocabulary V the rows were measured at (the
    tuner's ``--vocab``, first use's TP x shard width); ``stock``: the gather they were
    measured against (``table.STOCKS``); ``dtype``: the logits dtype they were
    measured at (a ``dtypes`` name or a torch dtype)."""
    path = Path(path)
    with tablefile.locked(path):
        return _merge(path, device, tp, dcp, rows, provenance, emulated, vocab, stock,
                      dtype_name(dtype))


def _merge(path, device, tp, dcp, rows, provenance, emulated, vocab, stock, dtype):
    data = _load(path)
    devices = data.setdefault("devices", {}) or {}
    data["devices"] = devices
    name = next((d for d in devices if normalize(d) == normalize(device)), device)
    # a newer schema's sections are another version's: kept as written, never replaced
    newer = [s for s in devices.get(name, []) if s.get("schema", SCHEMA) > SCHEMA]
    def key_of(s):  # a section's key as written, a field left out read as its default
        return (s.get("emulated", False), s.get("tp"), s.get("dcp", 1),
                s.get("vocab", KIMI_K2_VOCAB), s.get("stock", NCCL_STOCK),
                s.get("dtype", dtypes.DEFAULT))

    def same_key(s):
        return key_of(s) == (emulated, tp, dcp, vocab, stock, dtype)

    # Another environment's version of this key is kept beside the new one (it serves that
    # environment), the oldest dropped past MAX_VERSIONS; this environment's is replaced.
    current = [s for s in devices.get(name, []) if s.get("schema", SCHEMA) <= SCHEMA]
    others = [s for s in current if same_key(s)
              and version(s.get("provenance")) not in ((), version(provenance))]
    others = sorted(others, key=lambda s: str((s.get("provenance") or {}).get("date", "")))
    others = others[max(0, len(others) - (MAX_VERSIONS - 1)):]
    sections = [s for s in current if not same_key(s) or any(s is o for o in others)]
    section = {"tp": tp, "dcp": dcp, "vocab": vocab, "stock": stock, "dtype": dtype,
               "emulated": emulated, "provenance": provenance, "rows": rows}
    sections.append(section)
    sections.sort(key=key_of)
    devices[name] = sections + newer
    text = _render(data)
    check = read(text, str(path))  # what is written must read back, but the kept newer ones
    bad = [p.line for p in check.problems if p.kind != "newer"]
    if bad:
        raise TableError(bad[0])
    return tablefile.write_durably(path, tablefile.seal(text))


HEADER = """\
# HEAD_GATHER: the Lamport logits gather's plan per GPU model, (TP, DCP), vocabulary V,
# logits dtype and row count.
# Written by `lamport-head tune` (merged in place: other sections are kept). Format and
# rules: lamport_head/table.py. Emulated sections (one GPU standing in for TP ranks)
# are kept for reference and never used for serving.
"""


def _render(data):
    body = yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100)
    return HEADER + body
