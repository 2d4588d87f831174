"""The HEAD_GATHER table (docs/design.md, "Tables"; docs/tables.md). A section's key also
holds the logits dtype: a row serves only at the V, stock and dtype it was measured at
(absent from a section: ``KIMI_K2_VOCAB``, ``NCCL_STOCK``, ``dtypes.DEFAULT``). ``parse``
raises on any defect; serving's ``load_layers`` skips only what a defect spoils and sets
aside only the user table, never ``$LAMPORT_HEAD_TABLE``.
"""

import math
import re
from dataclasses import dataclass, fields, replace
from importlib import resources
from pathlib import Path
from typing import NamedTuple

import yaml

from . import dtypes, tablefile  # tablefile's lock and set-aside read at the call
from .config import GatherConfig
from .dtypes import ITEMSIZE, NAMES as DTYPES
from .settings import TABLE_ENV, cache_dir, table_override
from .tablefile import TornTable, check_seal

SCHEMA = 1
MAX_ROWS = 1024
KIMI_K2_VOCAB = 163840
SECTION_KEYS = {"schema", "tp", "dcp", "vocab", "stock", "dtype", "emulated", "provenance",
                "rows"}
NCCL_STOCK = "nccl-all-gather"  # vLLM's _gather_logits, SGLang without NVLS, the tuner's stand-in
MULTIMEM_STOCK = "multimem-all-gather"  # SGLang's MultimemAllGatherer (NVLS one-shot)
# vLLM's CudaCommunicator.custom_all_gather, where a release gathers logits through it
CUSTOM_STOCK = "custom-all-gather"
# vLLM 0.34's all_to_all_vocab_shards: the AllToAll's sections, their rows the step's total M
ALL_TO_ALL_STOCK = "nccl-all-to-all"
STOCKS = (NCCL_STOCK, MULTIMEM_STOCK, ALL_TO_ALL_STOCK, CUSTOM_STOCK)
MAX_CTAS = 1024
# versions of one key, so environments sharing a user table don't re-measure over each other
MAX_VERSIONS = 4
# TP 1 has no gather; an NVL72 joins at most 72 GPUs; a V past 2^24 is a typo
MIN_TP, MAX_TP = 2, 72
MAX_VOCAB = 1 << 24
ROW_KNOBS = {f.name for f in fields(GatherConfig)}
ROW_KEYS = ROW_KNOBS | {"enabled", "lamport_us", "stock_us"}
PROVENANCE_KEYS = {"gpu", "driver", "cuda", "torch", "cutlass_dsl", "lamport_head", "kernel",
                   "date", "commit", "command", "host", "note"}
YAML11_BOOLS = {"on", "off", "yes", "no", "y", "n"}
_RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")


class TableError(ValueError):
    """A malformed HEAD_GATHER table; the message names the file and the entry."""


@dataclass(frozen=True)
class TableRow:
    """The entry for one row count; ``ctas`` stays because the seed's public contract names it."""

    config: GatherConfig
    enabled: bool
    filled: bool = False

    @property
    def ctas(self) -> int:
        return self.config.ctas


def fill(measured):
    """The entries serving reads from the ``measured`` ones: a gap takes the measured row
    above's entry (its CTAs cover the bytes), enabled only when both neighbours are; rows
    outside the measured span stay stock (absent)."""
    rows = sorted(measured)
    entries = dict(measured)
    for below, above in zip(rows, rows[1:]):
        if above - below > 1:
            enabled = measured[below].enabled and measured[above].enabled
            gap = replace(measured[above], enabled=enabled, filled=True)
            entries.update(dict.fromkeys(range(below + 1, above), gap))
    return dict(sorted(entries.items()))


def normalize(name: str) -> str:
    """GPU model names compare case-insensitively, with whitespace collapsed."""
    return " ".join(str(name).split()).lower()


class _Loader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys and YAML 1.1 word booleans."""


def _mapping(loader, node, deep=False):
    seen = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            hash(key)
        except TypeError:
            raise TableError(f"key {type(key).__name__} at line {key_node.start_mark.line + 1} "
                             "is not a scalar; keys are names, numbers or ranges") from None
        if key in seen:
            raise TableError(f"duplicate key {key_node.value!r} (line {key_node.start_mark.line + 1}; "
                             f"first at line {seen[key] + 1})")
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


def _bool(loader, node):
    if node.style is None and node.value.lower() in YAML11_BOOLS:
        raise TableError(
            f"bare {node.value!r} at line {node.start_mark.line + 1} is read by YAML 1.1 as the "
            f"boolean {node.value.lower() in ('on', 'yes', 'y')}; write true/false, or quote it")
    return loader.construct_yaml_bool(node)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)
_Loader.add_constructor("tag:yaml.org,2002:bool", _bool)


def _int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def row_span(key, where="rows"):
    """(first, last) row of a row key: a count ``8`` or an inclusive range ``'2-4'``."""
    if _int(key):
        lo = hi = key
    elif isinstance(key, str) and _RANGE.match(key):
        lo, hi = (int(g) for g in _RANGE.match(key).groups())
    else:
        raise TableError(f"{where}: row key {key!r} is neither a row count nor a range 'a-b'")
    if lo < 1:
        raise TableError(f"{where}: row {key!r} must start at 1 or more")
    if hi < lo:
        raise TableError(f"{where}: row range {key!r} is reversed")
    if hi > MAX_ROWS:  # checked before any range is expanded: a huge range stays cheap
        what = f"row {hi}" if lo == hi else f"rows {lo}-{hi}"
        raise TableError(f"{where}: {what} exceed{'s' if lo == hi else ''} the limit of "
                         f"{MAX_ROWS} rows: {mailbox_cost(hi)}")
    return lo, hi


def mailbox_cost(rows, vocab=KIMI_K2_VOCAB, dtype=dtypes.DEFAULT):
    """Why rows are capped: every rank holds a mailbox of 2 parities x rows x V values."""
    size = 2 * rows * vocab * ITEMSIZE[dtype]
    return (f"a mailbox for {rows} rows costs {size / 1e9:.1f} GB per rank at V = {vocab} "
            f"{dtype} (2 parities x rows x V x {ITEMSIZE[dtype]} bytes)")


def _row(entry, where):
    if not isinstance(entry, dict):
        raise TableError(f"{where}: expected a mapping with ctas and enabled, got {entry!r}")
    unknown = set(entry) - ROW_KEYS
    if unknown:
        raise TableError(f"{where}: unknown key(s) {sorted(map(str, unknown))}; allowed {sorted(ROW_KEYS)}")
    for key in ("ctas", "enabled"):
        if key not in entry:
            raise TableError(f"{where}: missing {key!r}")
    ctas = entry["ctas"]
    if not _int(ctas) or not 1 <= ctas <= MAX_CTAS:
        raise TableError(f"{where}: ctas must be an int in [1, {MAX_CTAS}], got {ctas!r}")
    if not isinstance(entry["enabled"], bool):
        raise TableError(f"{where}: enabled must be true or false, got {entry['enabled']!r}")
    try:
        config = GatherConfig(**{k: v for k, v in entry.items() if k in ROW_KNOBS})
    except ValueError as exc:
        raise TableError(f"{where}: {exc}") from None
    for key in ("lamport_us", "stock_us"):
        if key in entry:
            v = entry[key]
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                    or v < 0):
                raise TableError(f"{where}: {key} must be a finite non-negative number, "
                                 f"got {v!r}")
    return TableRow(config, entry["enabled"])


@dataclass
class Section:
    device: str
    tp: int
    dcp: int
    emulated: bool
    provenance: dict
    rows: dict  # measured row count -> TableRow (ranges expanded); Table.entries fills gaps
    raw: dict  # the section as written
    source: str = ""
    vocab: int = KIMI_K2_VOCAB
    stock: str = NCCL_STOCK
    dtype: str = dtypes.DEFAULT

    @property
    def vocab_written(self) -> bool:
        return "vocab" in self.raw


def version(provenance):
    """A section's environment (``provenance.STALE_KEYS``' values); ``()``: hand-written."""
    from .provenance import STALE_KEYS  # lazy: provenance loads torch (the CLI's help reads tables)

    if not isinstance(provenance, dict) or not any(k in provenance for k in STALE_KEYS):
        return ()
    return tuple(str(provenance.get(k)) for k in STALE_KEYS)


def _newest(sections, facts):
    """The version to serve: the one measured in ``facts``'s environment, else the newest."""
    if facts is not None:
        mine = version(facts)
        for s in sections:
            if version(s.provenance) == mine:
                return s
    return max(reversed(sections), key=lambda s: str(s.provenance.get("date", "")))


def section_key(section):
    """What a section is for: a higher layer's replaces a lower one's of the same key."""
    return (normalize(section.device), section.tp, section.dcp, section.emulated, section.vocab,
            section.stock, section.dtype)


def _label(section):
    vocab = section.vocab if section.vocab_written else f"{section.vocab} (not written)"
    return (f"{section.source or '<string>'}: {section.device} tp={section.tp} "
            f"dcp={section.dcp} vocab={vocab} stock={section.stock} dtype={section.dtype}"
            + (" (emulated)" if section.emulated else ""))


class Table:
    """A validated table: ``path`` its file (the highest layer's), ``layers`` every file
    read, lowest first. No two sections share a ``section_key`` and version."""

    facts = None  # this environment's runtime facts: which version of a key serves (_newest)
    problems = ()  # Problem per section (or layer) a lenient read skipped
    kept = ()  # (device, section as written) of a newer schema: skipped, kept by the writer
    broken = None  # why the user table cannot be read whole, or None
    without_user = None  # the merged view of every layer but the user table

    def __init__(self, path, sections, layers=None):
        self.path, self.sections = path, sections
        self.layers = layers or [path]

    def section(self, device_name, tp, dcp, *, emulated=False, vocab=None, stock=None,
                dtype=None):
        """The section for this key, or None. ``vocab``/``stock``/``dtype`` None: the one
        there is whatever its value; ``TableError`` naming them when there are several."""
        if dtype is not None:
            dtype = dtypes.name(dtype)
        found = [s for s in self.sections
                 if normalize(s.device) == normalize(device_name) and s.tp == tp
                 and s.dcp == dcp and s.emulated == emulated
                 and (vocab is None or s.vocab == vocab)
                 and (stock is None or s.stock == stock)
                 and (dtype is None or s.dtype == dtype)]
        versions = {}
        for s in found:
            versions.setdefault((s.vocab, s.stock, s.dtype), []).append(s)
        found = [v[0] if len(v) == 1 else _newest(v, self.facts) for v in versions.values()]
        if len(found) > 1:
            raise TableError(
                f"{self.path}: {len(found)} sections for {device_name}, tp={tp}, dcp={dcp}"
                + (" (emulated)" if emulated else "") + ", one per vocabulary, stock and dtype: "
                + "; ".join(_label(s) for s in found)
                + "; ask for one with vocab=V, stock=S, dtype=D")
        return found[0] if found else None

    def vocabs(self, device_name, tp, dcp, *, emulated=False):
        return sorted({s.vocab for s in self.sections
                       if normalize(s.device) == normalize(device_name) and s.tp == tp
                       and s.dcp == dcp and s.emulated == emulated})

    def stocks(self, device_name, tp, dcp, vocab, *, emulated=False):
        return sorted({s.stock for s in self.sections
                       if normalize(s.device) == normalize(device_name) and s.tp == tp
                       and s.dcp == dcp and s.emulated == emulated and s.vocab == vocab})

    def dtypes(self, device_name, tp, dcp, vocab, stock, *, emulated=False):
        return sorted({s.dtype for s in self.sections
                       if normalize(s.device) == normalize(device_name) and s.tp == tp
                       and s.dcp == dcp and s.emulated == emulated and s.vocab == vocab
                       and s.stock == stock})

    def entries(self, device_name, tp, dcp=1, *, emulated=False, vocab=None, stock=None,
                dtype=None):
        """The section's entries ``{rows: TableRow}``, enabled or not, gaps filled; ``{}``
        for an unknown key. Emulated sections only with ``emulated=True``."""
        s = self.section(device_name, tp, dcp, emulated=emulated, vocab=vocab, stock=stock,
                         dtype=dtype)
        return fill(s.rows) if s else {}



def _syntax_error(path, text, exc):
    """PyYAML's several-line error as one line: ``FILE:LINE:COLUMN: YAML syntax error: ...``."""
    def flat(words):
        return " ".join(str(words).split())

    if isinstance(exc, yaml.reader.ReaderError):
        line = text.count("\n", 0, exc.position) + 1
        column = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        char = exc.character if isinstance(exc.character, int) else ord(exc.character[:1] or "\0")
        return (f"{path}:{line}:{column}: YAML syntax error: unacceptable character "
                f"#x{char:04x}: {flat(exc.reason)}")
    mark = getattr(exc, "problem_mark", None)
    if mark is None or getattr(exc, "problem", None) is None:
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
        return f"{where}: YAML syntax error: {flat(exc)}"
    what = flat(exc.problem)
    context, at = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context:
        what += f" ({flat(context)}" + (f" at line {at.line + 1}" if at is not None else "") + ")"
    return f"{path}:{mark.line + 1}:{mark.column + 1}: YAML syntax error: {what}"


class Problem(NamedTuple):
    """What a lenient ``read`` skipped: ``kind`` "file", "section" or "newer" (a newer
    schema's, kept in ``Table.kept`` for the writer); ``line`` says what and where."""

    kind: str
    line: str
    aside: bool = False  # the broken user table, which install sets aside (its own line)


def parse(text, path="<string>"):
    """Validate YAML ``text`` strictly: any defect raises ``TableError``."""
    return _parse(text, path, strict=True)


def read(text, path="<string>"):
    """A lenient ``parse``: a bad or newer section is skipped (in ``problems``); what spoils
    the whole file still raises ``TableError``."""
    return _parse(text, path, strict=False)


def _parse(text, path, strict):
    try:
        text = check_seal(text)
    except TornTable as exc:
        raise TableError(f"{path}: {exc}") from None
    try:
        data = yaml.load(text, Loader=_Loader)
    except TableError as exc:
        raise TableError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise TableError(_syntax_error(path, text, exc)) from None
    except RecursionError:
        raise TableError(f"{path}: nested too deeply to be a HEAD_GATHER table") from None
    if not isinstance(data, dict) or set(data) != {"schema", "devices"}:
        keys = sorted(map(str, data)) if isinstance(data, dict) else type(data).__name__
        raise TableError(f"{path}: the top level must be a mapping of exactly 'schema' and "
                         f"'devices', got {keys}")
    schema = data["schema"]
    if not _int(schema) or schema < 1 or (strict and schema != SCHEMA):  # True == 1 == 1.0
        raise TableError(f"{path}: schema {schema!r} is not supported (expected {SCHEMA})")
    devices = data["devices"]
    if not isinstance(devices, dict):
        raise TableError(f"{path}: 'devices' must map GPU model names to lists of sections")
    sections, names, problems, kept = [], {}, [], []

    def skip(exc, kind="section"):
        if strict:
            raise exc
        problems.append(Problem(kind, str(exc)))

    if schema > SCHEMA:  # one line for the file, its sections kept
        problems.append(Problem("newer", f"{path}: schema {schema}, newer than this "
                                f"lamport-head reads ({SCHEMA}): its sections are skipped"))

    for device, entries in devices.items():
        try:
            if not isinstance(device, str) or not device.strip():
                raise TableError(f"{path}: device name {device!r} must be a non-empty string")
            if normalize(device) in names:
                raise TableError(f"{path}: device {device!r} repeats {names[normalize(device)]!r} "
                                 "(names compare case-insensitively)")
            names[normalize(device)] = device
            if not isinstance(entries, list) or not entries:
                raise TableError(f"{path}: devices.{device}: expected a non-empty list of "
                                 "sections")
        except TableError as exc:
            skip(exc)
            continue
        seen = {}
        for i, sec in enumerate(entries):
            where = f"{path}: devices.{device}[{i}]"
            newer = _schema_of(sec, schema)
            if newer > SCHEMA and isinstance(sec, dict):  # else: a bad section, said below
                if newer != schema:  # the file's own newer schema was said once, above
                    skip(TableError(f"{where}: schema {newer}, newer than this lamport-head "
                                    f"reads ({SCHEMA}): skipped"), "newer")
                kept.append((device, dict(sec, schema=newer)))
                continue
            try:
                s = _section(device, sec, where)
            except TableError as exc:
                skip(exc)
                continue
            s.source = path
            key = (s.tp, s.dcp, s.emulated, s.vocab, s.stock, s.dtype, version(s.provenance))
            if key in seen:
                first, written = seen[key]
                how = ", ".join(
                    f"devices.{device}[{j}] vocab={s.vocab}"
                    + ("" if w else f" (not written: taken as {KIMI_K2_VOCAB})")
                    for j, w in ((first, written), (i, s.vocab_written)))
                skip(TableError(f"{where}: duplicate section for tp={s.tp}, dcp={s.dcp}"
                                + (" (emulated)" if s.emulated else "")
                                + f", vocab={s.vocab}, stock={s.stock}, dtype={s.dtype}: "
                                "ambiguous, two "
                                f"entries ({how}) say how to serve one key"))
                continue
            seen[key] = (i, s.vocab_written)
            sections.append(s)
    table = Table(path, sections)
    table.problems, table.kept = problems, kept
    return table


def _schema_of(sec, schema):
    own = sec.get("schema") if isinstance(sec, dict) else None
    return own if _int(own) else schema


def _section(device, sec, where):
    if not isinstance(sec, dict):
        raise TableError(f"{where}: expected a mapping, got {sec!r}")
    unknown = set(sec) - SECTION_KEYS
    if unknown:
        raise TableError(f"{where}: unknown key(s) {sorted(map(str, unknown))}; allowed {sorted(SECTION_KEYS)}")
    if "schema" in sec and (not _int(sec["schema"]) or sec["schema"] < 1):
        raise TableError(f"{where}: schema must be a positive int, got {sec['schema']!r}")
    tp, dcp = sec.get("tp"), sec.get("dcp", 1)
    if not _int(tp) or not MIN_TP <= tp <= MAX_TP:
        raise TableError(f"{where}: tp must be an int in [{MIN_TP}, {MAX_TP}] (TP 1 has no "
                         f"gather; one NVLink domain joins at most {MAX_TP} GPUs), got {tp!r}")
    if not _int(dcp) or dcp < 1:
        raise TableError(f"{where}: dcp must be a positive int, got {dcp!r}")
    if tp % dcp:
        raise TableError(f"{where}: tp={tp} is not a multiple of dcp={dcp}")
    where = f"{where} (tp={tp}, dcp={dcp})"
    vocab = sec.get("vocab", KIMI_K2_VOCAB)
    if not _int(vocab) or not 1 <= vocab <= MAX_VOCAB:
        raise TableError(f"{where}: vocab must be an int in [1, {MAX_VOCAB}] (the full "
                         f"vocabulary V the rows were measured at), got {vocab!r}")
    if "vocab" in sec and vocab % tp:
        raise TableError(f"{where}: vocab {vocab} is not a multiple of tp={tp} (V is TP x the "
                         "lm_head shard width)")
    stock = sec.get("stock", NCCL_STOCK)
    if stock not in STOCKS:
        raise TableError(f"{where}: stock must be one of {', '.join(STOCKS)} (the engine "
                         f"collective the rows were measured against), got {stock!r}")
    dtype = sec.get("dtype", dtypes.DEFAULT)
    if dtype not in DTYPES:
        raise TableError(f"{where}: dtype must be one of {', '.join(DTYPES)} (the logits dtype "
                         f"the rows were measured at), got {dtype!r}")
    emulated = sec.get("emulated", False)
    if not isinstance(emulated, bool):
        raise TableError(f"{where}: emulated must be true or false, got {emulated!r}")
    provenance = sec.get("provenance", {})
    if not isinstance(provenance, dict):
        raise TableError(f"{where}: provenance must be a mapping")
    unknown = set(provenance) - PROVENANCE_KEYS
    if unknown:
        raise TableError(f"{where}: unknown provenance key(s) {sorted(map(str, unknown))}")
    rows = sec.get("rows")
    if not isinstance(rows, dict) or not rows:
        raise TableError(f"{where}: rows must be a non-empty mapping")
    measured, spans = {}, []
    for key, entry in rows.items():
        lo, hi = row_span(key, f"{where} rows[{key!r}]")
        for other, (a, b) in spans:
            if lo <= b and a <= hi:
                raise TableError(f"{where}: rows {key!r} overlap rows {other!r}")
        spans.append((key, (lo, hi)))
        row = _row(entry, f"{where} rows[{key!r}]")
        measured.update(dict.fromkeys(range(lo, hi + 1), row))
    return Section(device, tp, dcp, emulated, provenance, dict(sorted(measured.items())), sec,
                   vocab=vocab, stock=stock, dtype=dtype)


def packaged_path() -> Path:
    return Path(str(resources.files("lamport_head.tables").joinpath("head_gather.yaml")))


def user_path() -> Path:
    return cache_dir() / "head_gather.yaml"


def section_status(section):
    """'missing', 'current', or 'stale: key, ...'; only the user table's sections go stale."""
    from . import provenance  # lazy: it loads torch; read at the call (tests replace facts)

    if section is None:
        return "missing"
    if section.source != str(user_path()):
        return "current"
    now = provenance.facts()
    old = [k for k in provenance.STALE_KEYS if str(section.provenance.get(k)) != str(now[k])]
    return f"stale: {', '.join(old)}" if old else "current"


def layer_paths():
    paths = [packaged_path()]
    if user_path().exists():
        paths.append(user_path())
    override = table_override()
    if override is not None:
        paths.append(override)
    return paths


def _same(path, other):
    return other is not None and Path(path).resolve() == Path(other).resolve()


def _movable(path):
    """Whether ``path`` is the user table (set aside when broken), not ``$LAMPORT_HEAD_TABLE``."""
    return _same(path, user_path()) and not _same(path, table_override())


def fix_for(path, kind):
    """What to do about a ``Problem.kind`` of the layer at ``path``: the lines' last clause."""
    if kind == "newer":
        return ("written by a newer lamport-head: kept in the file for it, and this version "
                "serves the rest (first-use tuning measures its own section beside it)")
    if _movable(path):
        if kind == "file":
            return ("the next engine start sets it aside (renamed beside itself) and serves "
                    "from the other layers; first-use tuning, when on, measures what they "
                    "lack; `lamport-head tune` replaces it too")
        return ("this section is skipped and the file's other sections serve; first-use "
                "tuning measures it again (or `lamport-head tune`)")
    if _same(path, table_override()):
        what = "this layer is skipped" if kind == "file" else "this section is skipped"
        return f"{what}; fix the file or unset {TABLE_ENV} (the layers below serve meanwhile)"
    if str(path) == str(packaged_path()):
        return "this is the packaged table: reinstall lamport-head"
    what = "the file is refused" if kind == "file" else "this section is skipped"
    return f"{what} where it is served; fix the file (or re-tune it with `lamport-head tune`)"


def load_layers() -> Table:
    """The merged view of ``layer_paths()``, lenient: a bad section or an unreadable layer
    costs only itself, one ``Problem`` each; ``broken`` and ``without_user`` are install's."""
    paths = [str(p) for p in layer_paths()]
    layers, problems, broken = [], [], None
    for path in paths:
        try:
            layer = load_table(path, strict=False)
        except TableError as exc:
            movable = _movable(path)
            problems.append(Problem("file", f"{exc}; {fix_for(path, 'file')}", movable))
            if movable:
                broken = str(exc)
            continue
        problems += [p._replace(line=f"{p.line}; {fix_for(path, p.kind)}")
                     for p in layer.problems]
        mine = {}
        for s in layer.sections:
            mine.setdefault(section_key(s), []).append(s)
        layers.append((path, mine))

    def merged(kept):
        sections = {}
        for _, mine in kept:
            sections.update(mine)  # a higher layer's key replaces every version of it below
        return [s for versions in sections.values() for s in versions]

    table = Table(paths[-1], merged(layers), paths)
    table.problems, table.broken = problems, broken
    table.without_user = Table(paths[-1], merged([(p, m) for p, m in layers if not _movable(p)]),
                               [p for p in paths if not _movable(p)])
    return table


def load_table(path=None, *, strict=True) -> Table:
    """The one file at ``path`` (``parse``, or ``read``); without a path, ``load_layers()``."""
    if path is None:
        return load_layers()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise TableError(f"{path}: cannot read the table: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise TableError(f"{path}: not a UTF-8 text file (byte {exc.object[exc.start]:#04x} at "
                         f"offset {exc.start}); a table is YAML text") from None
    return (parse if strict else read)(text, str(path))


def _set_aside_if_broken(path):
    """Under the writer's lock: set ``path`` aside unless another engine healed it since."""
    with tablefile.locked(path):
        try:
            load_table(path, strict=False)
            return ("gone", None)
        except TableError:
            return ("aside", str(tablefile.set_aside(path)))


def set_aside_agreed(path, keys, rank, group):
    """Collective: the first rank of each host by ``keys`` (a rank with no key acts too)
    sets ``path`` aside unless it now reads whole. This host's ``(kind, detail)``, the same
    on its ranks: ("aside", new path), ("gone", None) or ("kept", why). Never raises."""
    # lazy: collective loads torch, and the CLI loads this module for its help
    from .collective import all_gather_objects

    host = keys[rank][0] if keys[rank] is not None else None
    first = next(r for r, k in enumerate(keys) if (k[0] if k is not None else None) == host)
    outcome = None
    if first == rank or host is None:
        try:
            outcome = _set_aside_if_broken(path)
        except FileNotFoundError:
            outcome = ("gone", None)  # another rank of this host set it aside first
        except OSError as exc:
            outcome = ("kept", f"{type(exc).__name__}: {exc.strerror or exc}")
        except Exception as exc:  # this rank alone: its peers are about to gather outcomes
            outcome = ("kept", f"{type(exc).__name__}: {exc}")
    outcomes = all_gather_objects(outcome, group)
    return tuple(outcomes[first] if outcomes[first] is not None else outcomes[rank])
