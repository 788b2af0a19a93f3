"""The index protocol, the entry-point registry, `anns-lab indexes`, and bad-input errors."""

import pickle
import re
from importlib.metadata import EntryPoint

import numpy as np
import pytest
from click.testing import CliRunner

from anns_lab import indexes
from anns_lab.errors import IndexConfigError
from anns_lab.indexes import registry
from anns_lab.indexes.base import Param
from anns_lab.indexes.cli import indexes as indexes_cmd
from anns_lab.testing import positions

BUILTINS = ["flat", "hnsw", "ivf", "vamana"]


@pytest.fixture
def with_broken_plugin(monkeypatch):
    """The registry as if an installed plugin's module failed to import."""
    real = registry._entry_points

    def fake():
        eps = dict(real())
        eps["brokenidx"] = [EntryPoint("brokenidx", "no_such_module_xyz:Index", registry.GROUP)]
        return eps

    monkeypatch.setattr(registry, "_entry_points", fake)


def test_a_name_two_distributions_claim_is_a_conflict_never_a_silent_winner(monkeypatch):
    """Before: the last one found (an order of sys.path) won; a plugin's "ivf" replaced the built-in without a word."""
    real = registry._entry_points
    faulty = EntryPoint("ivf", "anns_lab.indexes.flat:FlatIndex", registry.GROUP)
    monkeypatch.setattr(registry, "_entry_points", lambda: real() | {"ivf": [*real()["ivf"], faulty]})
    with pytest.raises(IndexConfigError, match="'ivf' is announced by 2 distributions"):
        indexes.get("ivf")
    assert "ivf" not in indexes.available() and "announced by 2" in registry.broken()["ivf"]
    assert "flat" in indexes.available()


def test_a_name_that_cannot_name_files_and_labels_is_refused(monkeypatch):
    """Before: a plugin named ``<script>alert(1)</script>`` stopped a sweep at its first part file (the ``/``), one named
    ``$\\frac{$`` a report's figures (matplotlib's math text); an estimator's name reached report.html unescaped."""
    from anns_lab.eval import html

    real = registry._entry_points
    odd = {name: [EntryPoint(name, "anns_lab.indexes.flat:FlatIndex", registry.GROUP)]
           for name in ("<script>alert(1)</script>", "$\\frac{$", "a|b")}
    monkeypatch.setattr(registry, "_entry_points", lambda: real() | odd)
    for name in odd:
        assert "is not a name anns-lab can use" in registry.broken()[name] and name not in indexes.available()
        with pytest.raises(IndexConfigError, match="rename its entry point"):
            indexes.get(name)
    assert "flat" in indexes.available()
    assert html.paragraph("Estimators (<img src=x onerror=alert(1)>)") == \
        "<p>Estimators (&lt;img src=x onerror=alert(1)&gt;)</p>"


@pytest.mark.parametrize("value", ["anns_lab.indexes.flat FlatIndex", "anns_lab/indexes:FlatIndex", ":FlatIndex"])
def test_an_entry_point_value_that_is_not_module_class_is_listed_as_such(monkeypatch, value):
    """Before: importlib's load failed inside its own parsing ("AttributeError: 'NoneType' object has no attribute
    'group'"), which said nothing of the plugin's pyproject."""
    real = registry._entry_points
    monkeypatch.setattr(registry, "_entry_points", lambda: real() | {"odd": [EntryPoint("odd", value, registry.GROUP)]})
    assert registry.broken()["odd"].startswith(f"IndexConfigError: entry point 'odd' = {value!r}")
    assert "is not 'module:Class'" in registry.broken()["odd"] and "odd" not in indexes.available()
    with pytest.raises(IndexConfigError, match="fix the plugin's"):
        indexes.get("odd")
    assert "flat" in indexes.available()


def test_an_alias_entry_point_leaves_the_class_it_names_its_own_name(monkeypatch, tmp_path):
    """Before: loading ``myflat = anns_lab.indexes.flat:FlatIndex`` set ``FlatIndex.name = "myflat"``, so flat's own
    instances (messages, saves, the decoder's labels) then said myflat."""
    from anns_lab.indexes.flat import FlatIndex

    real = registry._entry_points
    alias = EntryPoint("myflat", "anns_lab.indexes.flat:FlatIndex", registry.GROUP)
    monkeypatch.setattr(registry, "_entry_points", lambda: real() | {"myflat": [alias]})
    flat, myflat = indexes.create("flat"), indexes.create("myflat")
    assert (flat.name, myflat.name, FlatIndex.name) == ("flat", "myflat", "flat")
    assert isinstance(myflat, FlatIndex) and indexes.get("myflat") is indexes.get("myflat")
    keys = np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32)
    myflat.build(keys)
    myflat.save(tmp_path / "saved")  # the same class on disk: either name loads it
    assert type(FlatIndex.load(tmp_path / "saved")).name == "flat"
    assert indexes.get("myflat").load(tmp_path / "saved").name == "myflat"
    again = pickle.loads(pickle.dumps(myflat))  # the alias's class is made at load: its instances still pickle
    assert type(again) is type(myflat) and np.array_equal(again.search(keys[:3], 5).ids, myflat.search(keys[:3], 5).ids)


def test_an_alias_of_a_class_with_its_own_reduction_pickles_through_it(monkeypatch, tmp_path):
    """A class that pickles itself its own way (``__reduce__``: here rebuilt from its keys) keeps that way under an
    alias. Before: the alias's pickling read object's state and made an empty instance (nothing built, no name's
    reduction called)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "recipe_plugin.py").write_text(
        "from anns_lab.indexes.flat import FlatIndex\n\nREBUILT = []\n\n\n"
        "def rebuild(cls, params, keys):\n    REBUILT.append(cls)\n    return cls(**params).build(keys)\n\n\n"
        "class Recipe(FlatIndex):\n    name = 'recipe'\n\n"
        "    def __reduce__(self):\n        return rebuild, (type(self), self.params, self._keys_seen)\n\n"
        "    def _build(self, keys, *args, **kwargs):\n        self._keys_seen = keys.copy()\n"
        "        return super()._build(keys, *args, **kwargs)\n")
    real = registry._entry_points
    monkeypatch.setattr(registry, "_entry_points", lambda: real() | {
        "recipe": [EntryPoint("recipe", "recipe_plugin:Recipe", registry.GROUP)],
        "myrecipe": [EntryPoint("myrecipe", "recipe_plugin:Recipe", registry.GROUP)]})
    import recipe_plugin

    keys = np.random.default_rng(1).standard_normal((40, 8)).astype(np.float32)
    index = indexes.create("myrecipe").build(keys)
    again = pickle.loads(pickle.dumps(index))
    assert recipe_plugin.REBUILT == [recipe_plugin.Recipe]  # the class's own reduction, with the base class
    assert type(again) is type(index) and again.name == "myrecipe" and again.n_keys == 40
    assert np.array_equal(again.search(keys[:3], 5).ids, index.search(keys[:3], 5).ids)
    # the common idiom ``return type(self), (), state``: the alias class as the callable is read as the base
    monkeypatch.setattr(recipe_plugin.Recipe, "__reduce__", lambda self: (type(self), (), self.__dict__))
    again = pickle.loads(pickle.dumps(index))
    assert type(again) is type(index) and np.array_equal(again.search(keys[:3], 5).ids, index.search(keys[:3], 5).ids)


def test_a_plugin_subclass_of_a_builtin_that_sets_no_name_is_named_in_place(monkeypatch, tmp_path):
    """The common plugin (``class Tuned(FlatIndex)``, no ``name``) is its own class under its entry point's name; the
    alias rule read its inherited name and served a generated subclass of it (a review's catch)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "tuned_plugin.py").write_text("from anns_lab.indexes.flat import FlatIndex\n\n\n"
                                              "class Tuned(FlatIndex):\n    pass\n")
    real = registry._entry_points
    monkeypatch.setattr(registry, "_entry_points",
                        lambda: real() | {"tuned": [EntryPoint("tuned", "tuned_plugin:Tuned", registry.GROUP)]})
    import tuned_plugin

    assert indexes.get("tuned") is tuned_plugin.Tuned and tuned_plugin.Tuned.name == "tuned"
    assert indexes.get("flat").name == "flat"


def test_a_plugin_that_exits_at_import_is_one_broken_entry(monkeypatch, tmp_path):
    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit('plugin called sys.exit at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    real = registry._entry_points
    monkeypatch.setattr(registry, "_entry_points",
                        lambda: real() | {"quitter": [EntryPoint("quitter", "exits_at_import:X", registry.GROUP)]})
    assert "called sys.exit" in registry.broken()["quitter"] and "flat" in indexes.available()
    with pytest.raises(IndexConfigError, match="quitter.*called sys.exit"):
        indexes.get("quitter")


def test_builtins_register_through_entry_points():
    names = {e.name: e for e in registry.entries()}
    for name in BUILTINS:
        assert names[name].distribution == "anns-lab"
        assert indexes.get(name).name == name
    assert set(BUILTINS) <= set(indexes.available())


def test_unknown_index_suggests_close_names():
    with pytest.raises(IndexConfigError, match="did you mean hnsw"):
        indexes.get("hnws")
    with pytest.raises(IndexConfigError, match="unknown index 'zzz'"):
        indexes.create("zzz")


def test_bad_build_parameters():
    with pytest.raises(IndexConfigError, match="unknown parameter 'ef_constuction'.*did you mean ef_construction"):
        indexes.create("hnsw", ef_constuction=10)
    with pytest.raises(IndexConfigError, match="out of range"):
        indexes.create("vamana", alpha=0.5)
    with pytest.raises(IndexConfigError, match="must be int"):
        indexes.create("hnsw", M=4.5)
    with pytest.raises(IndexConfigError, match="nlist=500 is larger than the number of keys"):
        indexes.create("ivf", nlist=500).build(np.ones((100, 4), np.float32))


@pytest.mark.parametrize("name", BUILTINS)
def test_bad_input_errors(name):
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((300, 8)).astype(np.float32)
    index = indexes.create(name)
    with pytest.raises(IndexConfigError, match="call build"):
        index.search(keys[:2], 1)
    bad = keys.copy()
    bad[7, 2] = np.nan
    with pytest.raises(IndexConfigError, match="NaN or infinite values \\(first at row 7\\)"):
        index.build(bad)
    index.build(keys)
    with pytest.raises(IndexConfigError, match="dimension 9 but the index was built with dimension 8"):
        index.search(np.zeros((1, 9), np.float32), 5)
    with pytest.raises(IndexConfigError, match="k=301 is larger than the number of keys \\(300\\)"):
        index.search(keys[:2], 301)
    with pytest.raises(IndexConfigError, match="2-D"):
        index.build(np.zeros((0, 8), np.float32))
    res = index.search(keys[0], 3)  # a single vector is a batch of one
    assert res.ids.shape == (1, 3)


def test_param_ranges():
    p = Param(4, 1, 16)
    assert p.check("x", "n", np.int64(3)) == 3
    with pytest.raises(IndexConfigError, match=r"out of range \[1, 16\]"):
        p.check("x", "n", 17)
    with pytest.raises(IndexConfigError, match="must be finite"):
        Param(1.0, 0.0).check("x", "a", float("nan"))
    with pytest.raises(IndexConfigError, match="must be int"):
        p.check("x", "n", True)


def test_broken_plugin_is_reported_and_others_work(with_broken_plugin):
    assert "brokenidx" in registry.broken()
    assert "ModuleNotFoundError" in registry.broken()["brokenidx"]
    assert set(BUILTINS) <= set(indexes.available())
    with pytest.raises(IndexConfigError, match="'brokenidx'.*failed to load"):
        indexes.get("brokenidx")
    out = CliRunner().invoke(indexes_cmd, [])
    assert out.exit_code == 0
    assert "brokenidx" in out.output and "FAILED TO LOAD" in out.output
    assert "vamana  [anns-lab" in out.output


def test_cli_lists_params_grid_and_plugin():
    out = CliRunner().invoke(indexes_cmd, [])
    assert out.exit_code == 0, out.output
    for name in BUILTINS:
        assert f"{name}  [anns-lab" in out.output
    assert "ef_construction = 200" in out.output
    assert "search grid: nprobe ∈ [1, 2, 4" in out.output
    # The example plugin is installed by `make setup` (every plugins/*/pyproject.toml).
    assert "simhash  [anns-lab-simhash" in out.output
    # what each reads of the prefill queries and of decode's hints: the options decode refuses where none reads them
    block = {chunk.split("  [")[0]: chunk for chunk in re.split(r"\n(?=\S)", out.output)}
    assert "uses train_queries: no\n" in block["flat"] and "takes copy hints (decode --copy-hints): no" in block["flat"]
    assert "uses train_queries: yes, moved by --train-positions and the GQA group's other heads' (--train-group " \
           "unlisted)" in block["roargraph"] and "takes copy hints (decode --copy-hints): yes" in block["roargraph"]
    assert "uses train_queries: yes, moved by --train-positions\n" in block["robust-vamana"]
    if "snapkv" in block:
        assert "uses train_queries: yes, at their own positions (reads no --train-positions)" in block["snapkv"]


def _build_random(name: str, n: int, rng) -> "indexes.Index":
    cls = registry.get(name)
    keys = rng.standard_normal((n, 32)).astype(np.float32)
    if not cls.uses_train_queries:
        return registry.create(name).build(keys)
    queries = rng.standard_normal((200, 32)).astype(np.float32)
    return registry.create(name).build(keys, train_queries=queries, **positions(cls, n, 200))


@pytest.mark.parametrize("name", sorted(registry.available()))
def test_index_bytes_count_every_array_the_index_holds(name):
    """Before: ``nbytes`` (a sweep's ``index_bytes``, the decoder's CPU bytes per key) counted what ``save`` writes,
    not what an index derives on load: quest's page bounds, simhash's and magicpig's codes, retroinfer's summaries
    were free; hnsw left out the hnswlib index it keeps (a second copy of the vectors and links). The reference is
    Python's own count of the memory allocated by a build and still held once only the index refers to it
    (tracemalloc sees numpy's arrays, not faiss's or hnswlib's, which the saved arrays stand for)."""
    import gc
    import tracemalloc

    rng = np.random.default_rng(0)
    _build_random(name, 500, rng)  # kernels compiled and module caches made before the count
    gc.collect()
    tracemalloc.start()
    try:
        index = _build_random(name, 3000, rng)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert index.nbytes >= 0.97 * held - 16384, f"{name}: nbytes {index.nbytes}, memory held {held}"
    if index.supports_save:  # a library's state (faiss's lists, hnswlib's file) is what save writes of it
        assert index.nbytes >= 0.97 * sum(a.nbytes for a in index._arrays().values())
