"""vLLM 0.34's all-to-all of vocab shards (``lamport_head.engines.vllm.vocab_shards``) on
stand-ins (no vLLM): which callers a step takes (``exchange_paths``) and their row
counts, the install (one all-to-all per TP group, device, shard width and dtype, each
caller's module global replaced once by a dispatcher that finds the call's group as
vLLM does), a release without the names (0.33) keeping vLLM's, first-use tuning of the
all-to-all unless ``LAMPORT_HEAD_ALL_TO_ALL=0`` (issue 49), and the summary's
clauses. tests/test_vllm_sharded.py runs the target's path on vLLM's own
``GPUModelRunner.sample``."""

import sys
import types

import pytest
import torch

from lamport_head import install, mailbox
from lamport_head.engines import vllm as plugin
from lamport_head.engines.vllm import release, vocab_shards
from lamport_head.outcome import Outcome, Ranks, Reason
from lamport_head.table import ALL_TO_ALL_STOCK

TARGET, DSPARK = release.TARGET_EXCHANGE, release.DSPARK_EXCHANGE
SHARD = 64  # helpers.model's head: 64 rows a rank, V = 128 on 2 ranks


def _lm(width=SHARD, head_dtype=None, sharding=True):
    lp = types.SimpleNamespace(logits_as_input=False, head_dtype=head_dtype, use_all_gather=True)
    lp._gather_logits = lambda x: ("stock", x.shape[0])
    head = types.SimpleNamespace(weight=torch.zeros(width, 16, dtype=torch.bfloat16), tp_size=2)
    model = types.SimpleNamespace(logits_processor=lp, lm_head=head)
    if sharding:
        model.compute_logits_local = lambda hidden: hidden
        model.compute_draft_logits_local = lambda hidden: hidden  # read on a drafter only
    return model


def _config(sharded=True, seqs=4, k=None, method=None, v2=None):
    spec = None if k is None else types.SimpleNamespace(num_speculative_tokens=k, method=method)
    config = types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(enable_batch_sharded_sampling=sharded),
        scheduler_config=types.SimpleNamespace(max_num_seqs=seqs), speculative_config=spec)
    if v2 is not None:
        config.use_v2_model_runner = v2  # 0.33's field; 0.34 has none
    return config


def _speculator(sharded):
    return types.SimpleNamespace(**{release.DSPARK_SHARDED: object() if sharded else None})


def test_exchange_paths_follow_the_config():
    """The target's sampling takes the all-to-all with batch-sharded sampling on a model
    with compute_logits_local (M: the step's logits rows); DSpark's sharded drafting
    too when its speculator decided to shard (M = TP x capacity x k)."""
    target = _lm()
    assert plugin.exchange_paths(target, None, None, _config(sharded=False), 2) == []
    assert plugin.exchange_paths(_lm(sharding=False), None, None, _config(), 2) == []
    assert plugin.exchange_paths(target, None, None, _config(v2=False), 2) == []  # 0.33's V1
    (path,) = plugin.exchange_paths(target, None, None, _config(), 2)
    assert path.path == TARGET and path.rows == (1, 2, 3, 4)
    assert path.processor is target.logits_processor and path.head is target.lm_head
    dspark = _config(seqs=5, k=3, method="dspark")
    paths = plugin.exchange_paths(target, _lm(), _speculator(True), dspark, 2)
    assert [p.path for p in paths] == [TARGET, DSPARK]
    assert paths[0].rows == tuple(range(1, 21)) and paths[1].rows == (6, 12, 18)
    # vLLM kept DSpark's sampling replicated; another method; no local draft logits
    assert [p.path for p in plugin.exchange_paths(target, _lm(), _speculator(False), dspark,
                                                   2)] == [TARGET]
    eagle = _config(seqs=5, k=3, method="eagle")
    assert [p.path for p in plugin.exchange_paths(target, _lm(), _speculator(True), eagle,
                                                   2)] == [TARGET]
    assert [p.path for p in plugin.exchange_paths(target, _lm(sharding=False),
                                                   _speculator(True), dspark, 2)] == [TARGET]


def test_dspark_rows():
    assert plugin.dspark_rows(_config(seqs=5, k=3), 2) == (6, 12, 18)
    assert plugin.dspark_rows(_config(seqs=8, k=1), 4) == (4, 8)
    assert plugin.dspark_rows(_config(seqs=None, k=3), 2) is None
    assert max(plugin.dspark_rows(_config(seqs=4096, k=8), 8)) <= 1024  # table.MAX_ROWS


class FakeAllToAll:
    """AllToAll's call on the served rows (``("lamport", M)``, then ``tag`` when given:
    which one served it); stock otherwise."""

    def __init__(self, rows, dtype, shard, tag=None):
        self.rows, self.dtype, self.shard_width = frozenset(rows), getattr(torch, dtype), shard
        self.tag = tag

    def __call__(self, x, send_splits, num_local_rows, stock):
        if x.shape[0] in self.rows and x.dtype == self.dtype and x.shape[1] == self.shard_width:
            return ("lamport", x.shape[0]) + (() if self.tag is None else (self.tag,))
        return stock(x, send_splits, num_local_rows)


class Coordinators:
    """vLLM's ``parallel_state`` as the dispatcher reads it: ``get_tp_group()`` answers
    the ``current`` engine's TP group coordinator (its ``device_group``)."""

    def __init__(self, device_group=None):
        self.current = types.SimpleNamespace(device_group=device_group)

    def get_tp_group(self):
        return self.current


def _vllm_modules(monkeypatch, callers=True):
    """Stand-ins for vLLM's batch_shard module and the callers' modules, each with its own
    ``all_to_all_vocab_shards`` (``callers=False``: the callers lack it, as 0.33's)."""
    modules = {}
    for name in (release.EXCHANGE_HOME, *release.EXCHANGE_CALLERS.values()):
        module = types.ModuleType(name)
        if callers or name == release.EXCHANGE_HOME:
            def original(x, send_splits, num_local_rows, _name=name):
                return ("stock", _name, x.shape[0])

            module.all_to_all_vocab_shards = original
        monkeypatch.setitem(sys.modules, name, module)
        modules[name] = module
    monkeypatch.setattr(vocab_shards, "_ROUTES", {})
    monkeypatch.setattr(vocab_shards, "_HOLDERS", {})
    # the TP group a call runs on, where vLLM's own function finds it: RANKS's (None)
    coordinators = Coordinators()
    monkeypatch.setitem(sys.modules, release.TP_GROUP[0], coordinators)
    modules["coordinators"] = coordinators
    return modules


def _serve(monkeypatch, tmp_path, built, make=FakeAllToAll):
    table = tmp_path / "t.yaml"
    table.write_text("schema: 1\ndevices:\n  NVIDIA H200:\n"
                     + "".join(f"    - tp: 2\n      dcp: 1\n      vocab: {v}\n"
                               f"      stock: {ALL_TO_ALL_STOCK}\n"
                               "      rows:\n        1-2: {ctas: 4, enabled: true}\n"
                               "        3: {ctas: 4, enabled: false}\n"
                               "        4: {ctas: 4, enabled: true}\n"
                               "        5: {ctas: 4, enabled: false}\n"
                               "        6: {ctas: 4, enabled: true}\n" for v in (128, 256)))
    monkeypatch.setenv("LAMPORT_HEAD_TABLE", str(table))
    monkeypatch.setattr(install, "_device_name", lambda d: "NVIDIA H200")

    def build(g, d, tp, r, shard, entries, budget_s, dtype, *, stock):
        built.append((shard, dtype, stock))
        return make(entries, dtype, shard)

    monkeypatch.setattr(install, "_build", build)
    monkeypatch.setattr(install, "all_gather_objects", lambda obj, group=None: [obj])  # one rank


RANKS = Ranks(None, 2, 0, "cpu")


def test_one_all_to_all_per_width_routes_each_callers_global(monkeypatch, tmp_path):
    """The target and a DSpark drafter of the same shard width share one all-to-all
    (built once, for the union of their rows); a drafter of another width gets its own.
    Each caller's module global becomes a dispatcher (once): served calls take the
    all-to-all, the rest that module's own function."""
    modules = _vllm_modules(monkeypatch)
    built = []
    _serve(monkeypatch, tmp_path, built)
    target = _lm()
    paths = plugin.exchange_paths(target, _lm(), _speculator(True),
                                  _config(seqs=3, k=1, method="dspark"), 2)
    target_rows, dspark_rows = paths[0].rows, paths[1].rows
    assert (target_rows, dspark_rows) == ((1, 2, 3, 4, 5, 6), (2, 4))
    got = plugin.install_exchanges(paths, RANKS)
    assert built == [(SHARD, "bfloat16", ALL_TO_ALL_STOCK)]
    assert [(e.path, e.outcome.rows, e.outcome.shared, e.width) for e in got] == [
        (TARGET, (1, 2, 4, 6), False, SHARD), (DSPARK, (2, 4), True, SHARD)]
    for name in release.EXCHANGE_CALLERS.values():
        call = modules[name].all_to_all_vocab_shards
        assert getattr(call, "_lamport_head_wrapped", False)
        x = torch.zeros(4, SHARD, dtype=torch.bfloat16)
        assert call(x, [2, 2], 2) == ("lamport", 4)
        assert call(x[:3], [2, 1], 2) == ("stock", name, 3)  # not a served M: its own
        assert call(x.float(), [2, 2], 2) == ("stock", name, 4)  # another dtype
        assert call(torch.zeros(4, 32, dtype=torch.bfloat16), [2, 2], 2) == ("stock", name, 4)
    # the same again (a second load): the first AllToAll kept (no second mailbox, no
    # second dispatcher), and a wider drafter's own
    wrapped = modules[release.EXCHANGE_CALLERS[TARGET]].all_to_all_vocab_shards
    cpu = torch.device("cpu")
    first = vocab_shards._ROUTES[(None, cpu, SHARD, torch.bfloat16)]  # RANKS: group None
    wide = plugin.exchange_paths(target, _lm(width=2 * SHARD), _speculator(True),
                                 _config(seqs=3, k=1, method="dspark"), 2)
    got = plugin.install_exchanges(wide, RANKS)
    assert built[1:] == [(2 * SHARD, "bfloat16", ALL_TO_ALL_STOCK)]
    assert vocab_shards._ROUTES[(None, cpu, SHARD, torch.bfloat16)] is first
    assert [(e.outcome.rows, e.outcome.shared, e.width) for e in got] == [
        ((1, 2, 4, 6), False, SHARD), ((2, 4), False, 2 * SHARD)]
    assert modules[release.EXCHANGE_CALLERS[TARGET]].all_to_all_vocab_shards is wrapped
    call = modules[release.EXCHANGE_CALLERS[DSPARK]].all_to_all_vocab_shards
    assert call(torch.zeros(4, 2 * SHARD, dtype=torch.bfloat16), [2, 2], 2) == ("lamport", 4)
    assert vocab_shards.routed() == [(SHARD, torch.bfloat16), (2 * SHARD, torch.bfloat16)]


def test_stock_outcomes_route_nothing(monkeypatch, tmp_path):
    """No table rows for the width (another vocabulary): every path stays vLLM's, no
    caller's global is replaced; a release whose callers lack the name (0.33) decides
    so before any collective."""
    modules = _vllm_modules(monkeypatch)
    built = []
    _serve(monkeypatch, tmp_path, built)
    (path,) = plugin.exchange_paths(_lm(width=32), None, None, _config(), 2)
    (got,) = plugin.install_exchanges([path], RANKS)
    assert got.outcome.reason is Reason.NO_ROWS and built == []
    assert f"stock={ALL_TO_ALL_STOCK}" in got.outcome.message
    caller = modules[release.EXCHANGE_CALLERS[TARGET]].all_to_all_vocab_shards
    assert not getattr(caller, "_lamport_head_wrapped", False)

    modules = _vllm_modules(monkeypatch, callers=False)

    def no_collective(obj, group=None):
        pytest.fail("a collective on a release that lacks the names")

    monkeypatch.setattr(install, "all_gather_objects", no_collective)
    (path,) = plugin.exchange_paths(_lm(), None, None, _config(), 2)
    (got,) = plugin.install_exchanges([path], RANKS)
    assert got.outcome.reason is Reason.ENGINE and built == []
    assert got.outcome.message == (f"this vLLM lacks {release.EXCHANGE_CALLERS[TARGET]}:"
                                   "all_to_all_vocab_shards")
    assert plugin.install_exchanges([], RANKS) == ()


def test_summary_names_both_all_to_all_paths():
    served = plugin.Exchange(TARGET, Outcome.serving((1, 2, 4)), SHARD)
    shared = plugin.Exchange(DSPARK, Outcome.serving((2, 4), shared=True, dtype="float32"),
                             SHARD)
    stock = plugin.Exchange(DSPARK, Outcome.kept(Reason.NO_ROWS, "why"), SHARD)
    line = plugin.summary("vLLM 0.34.0", "M", 2, 1, Outcome.serving((1,)), [],
                          ["compute_logits_local (x)"], exchanges=[served, shared])
    assert line == (
        "vLLM 0.34.0, M, tp=2, dcp=1: Lamport logits gather installed for rows [1] on all 2 TP "
        "ranks, but no step takes it: compute_logits_local (x) skips the gather; "
        "Lamport all-to-all for rows [1, 2, 4] through GPUModelRunner.sample's "
        "all_to_all_vocab_shards; Lamport all-to-all for rows [2, 4] (float32 logits) (shared "
        "with an earlier path: the same shard width) through "
        "DSparkSpeculator._sample_sequential_sharded's all_to_all_vocab_shards")
    assert plugin.summary("vLLM 0.34.0", "M", 2, 1, Outcome.serving((1,)), [], [],
                          exchanges=[stock]).endswith(
        "; DSparkSpeculator._sample_sequential_sharded's all_to_all_vocab_shards: stock "
        "all-to-all (no-rows: why)")


@pytest.mark.parametrize("asked", [True, False])
def test_first_use_tuning_measures_the_all_to_all_unless_switched_off(monkeypatch, tmp_path,
                                                                    asked):
    """With first-use tuning on, no section for the all-to-all and
    ``LAMPORT_HEAD_ALL_TO_ALL`` unset, first-use tuning measures the all-to-all
    (``stock_kind``: ``nccl-all-to-all``) against vLLM's own ``all_to_all_vocab_shards``
    for the path's rows; the rows it enables are built and routed
    (tests/test_all_to_all_tuning.py: the measuring itself). With it 0 (issue 49 item
    3) nothing is measured or built, the path stays vLLM's, and the outcome says why and
    how to turn it on."""
    from lamport_head.config import GatherConfig
    from lamport_head.table import TableRow
    from lamport_head.tuning import firstuse

    modules = _vllm_modules(monkeypatch)
    built, asked_for = [], []
    _serve(monkeypatch, tmp_path, built)
    monkeypatch.setenv("LAMPORT_HEAD_AUTOTUNE", "1")
    if asked:  # the default
        monkeypatch.delenv("LAMPORT_HEAD_ALL_TO_ALL", raising=False)
    else:
        monkeypatch.setenv("LAMPORT_HEAD_ALL_TO_ALL", "0")
    monkeypatch.setattr(mailbox, "device_key", lambda device: ("host", "gpu0"))

    def measure(group, device, tp, rank, dcp, shard, rows, shared, name, **kwargs):
        asked_for.append((shard, rows, kwargs))
        entries = {m: TableRow(GatherConfig(4), m < 3) for m in (1, 2, 4)}
        return firstuse.Outcome({m: e for m, e in entries.items() if e.enabled}, [], False,
                                0.1, str(tmp_path / "user.yaml"))

    monkeypatch.setattr(firstuse, "measure", measure)
    (path,) = plugin.exchange_paths(_lm(width=32), None, None, _config(), 2)  # no section
    (got,) = plugin.install_exchanges([path], RANKS)
    caller = modules[release.EXCHANGE_CALLERS[TARGET]].all_to_all_vocab_shards
    if not asked:
        assert asked_for == [] and built == [] and vocab_shards.routed() == []
        assert got.outcome.reason is Reason.SWITCHED_OFF and not got.outcome.served
        assert got.outcome.message == (
            "first-use tuning of the all-to-all is switched off (LAMPORT_HEAD_ALL_TO_ALL=0) and "
            "no table holds a section for NVIDIA H200, tp=2, dcp=1, vocab=64, "
            f"stock={ALL_TO_ALL_STOCK}, dtype=bfloat16; to turn it on, unset "
            "LAMPORT_HEAD_ALL_TO_ALL on every rank (first-use tuning then measures it) or "
            "tune it into a table (`lamport-head tune --all-to-all` under torchrun)")
        assert not getattr(caller, "_lamport_head_wrapped", False)
        return
    (shard, rows, kwargs), = asked_for
    assert (shard, tuple(rows)) == (32, path.rows)
    assert kwargs == {"stock": modules[release.EXCHANGE_HOME].all_to_all_vocab_shards,
                      "stock_kind": ALL_TO_ALL_STOCK, "dtype": "bfloat16"}
    assert got.outcome.rows == (1, 2) and built == [(32, "bfloat16", ALL_TO_ALL_STOCK)]
    assert caller(torch.zeros(2, 32, dtype=torch.bfloat16), [1, 1], 1) == ("lamport", 2)


@pytest.fixture
def groups(tmp_path):
    """Real gloo groups of a one-process world: ``groups(n)`` makes n new ones."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'world'}", rank=0,
                            world_size=1)
    yield lambda n: [dist.new_group([0]) for _ in range(n)]
    dist.destroy_process_group()


def test_engines_on_two_groups_in_one_process_each_get_their_own_all_to_all(
        monkeypatch, tmp_path, groups):
    """Issue 49 item 5: two engines in one process on two TP groups (each vLLM's pair: a
    CPU group where install agrees, a device group where vLLM's all-to-all runs), and a
    third on the first's group but another device. Each install builds its own AllToAll
    (the first's, and its peers, are never reused by another group or device); a call
    goes through the one of the group vLLM's own function would run it on (its TP group's
    device group, looked up as vLLM looks it up) and of the shard's device; a second load
    on a group keeps that group's."""
    modules = _vllm_modules(monkeypatch)
    built = []
    _serve(monkeypatch, tmp_path, built,
           make=lambda rows, dtype, shard: FakeAllToAll(rows, dtype, shard, tag=len(built) - 1))
    a_cpu, a_dev, b_cpu, b_dev = groups(4)
    engines = {"a": Ranks(a_cpu, 2, 0, "cpu", device_group=a_dev),
               "b": Ranks(b_cpu, 2, 0, "cpu", device_group=b_dev),
               "a on meta": Ranks(a_cpu, 2, 0, "meta", device_group=a_dev)}
    tp_group = {"a": a_dev, "b": b_dev}
    coordinators = modules["coordinators"]
    for name, ranks in engines.items():
        (path,) = plugin.exchange_paths(_lm(), None, None, _config(), 2)
        (got,) = plugin.install_exchanges([path], ranks)
        assert got.outcome.rows == (1, 2, 4) and not got.outcome.shared, name
    assert len(built) == 3  # one AllToAll each: none reused another group's or device's
    call = modules[release.EXCHANGE_CALLERS[TARGET]].all_to_all_vocab_shards

    def through(engine, device="cpu"):
        coordinators.current = types.SimpleNamespace(device_group=tp_group[engine])
        return call(torch.zeros(4, SHARD, dtype=torch.bfloat16, device=device), [2, 2], 2)

    assert through("a") == ("lamport", 4, 0) and through("b") == ("lamport", 4, 1)
    assert through("a", "meta") == ("lamport", 4, 2)
    assert through("b", "meta") == ("stock", release.EXCHANGE_CALLERS[TARGET], 4)  # none there
    coordinators.current = types.SimpleNamespace(device_group=None)  # another engine's group
    assert call(torch.zeros(4, SHARD, dtype=torch.bfloat16), [2, 2], 2) == (
        "stock", release.EXCHANGE_CALLERS[TARGET], 4)
    (path,) = plugin.exchange_paths(_lm(), None, None, _config(), 2)
    (again,) = plugin.install_exchanges([path], engines["b"])  # a second load on group b
    assert again.outcome.rows == (1, 2, 4) and len(built) == 3 and through("b")[-1] == 1
    assert vocab_shards.routed() == [(SHARD, torch.bfloat16)]
