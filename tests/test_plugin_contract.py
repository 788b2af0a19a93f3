"""The plugin contract: a new index of a few lines passes the conformance kit, no persistence or add needed."""

import inspect

import numpy as np
import pytest

from anns_lab.indexes import Index, IndexConfigError, pad_topk
from anns_lab.testing import check_counts_plausible, check_index


class MatmulTopK(Index):
    """Exact top-k by one ``queries @ keys.T`` (the README's example plugin)."""

    name = "matmul"  # no parameters: the grid is one point, {}

    def _build(self, keys, train_queries):
        self.keys = keys

    def _search(self, queries, k):
        scores = queries @ self.keys.T
        ids = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        full = np.full(len(queries), len(self.keys), np.int64)
        return (*pad_topk(ids, np.take_along_axis(scores, ids, 1)), full)


def test_a_short_plugin_passes_the_kit():
    assert len(inspect.getsource(MatmulTopK).splitlines()) <= 25
    out = check_index(MatmulTopK)
    assert out["recall"] == [1.0]
    index = MatmulTopK().build(np.eye(4, dtype=np.float32))
    assert not index.supports_save and not index.supports_add
    assert index.nbytes == 4 * 4 * 4  # its key array, without _arrays()
    try:
        index.save("/nonexistent")
    except IndexConfigError as err:
        assert "save" in str(err)
    else:
        raise AssertionError("save() of an index without persistence must raise IndexConfigError")


def test_the_readmes_plugin_as_written_passes_the_kit():
    """The README's example is run from its own text: a copy here once drifted from it (no name, unstable sort)."""
    import re
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("### Writing an index plugin", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert check_index(scope["MatmulTopK"])["recall"] == [1.0]


class UnderCounted(MatmulTopK):
    """Scores every key and reports a tenth of them scanned (the count a half-done port of a real index might give)."""

    name = "undercounted"

    def _search(self, queries, k):
        ids, scores, full = super()._search(queries, k)
        return ids, scores, np.maximum(full // 10, k)


def test_the_kit_refuses_counts_that_cannot_explain_the_recall():
    """Before: an index reporting a tenth of its scans passed every rule (counts were checked for range only)."""
    with pytest.raises(AssertionError, match=r"found 100\.0% of the top-10 with 10\.0% of the keys scanned"):
        check_index(UnderCounted)
    points = check_counts_plausible(MatmulTopK)  # the honest count of the same search
    assert points == [(1.0, 1.0)]
    check_index(UnderCounted, plausible_gain=None)  # the bound is the caller's (an index ranking by compressed codes)


def test_default_search_group_batches_each_distinct_index():
    """The protocol hook's default: one search per distinct index (a GQA group's heads share one) with its rows."""
    rng = np.random.default_rng(0)
    a, b = (MatmulTopK().build(rng.normal(size=(50, 8)).astype(np.float32)) for _ in range(2))
    q = rng.normal(size=(5, 8)).astype(np.float32)
    calls = []
    for ix in (a, b):
        ix._search = (lambda f: lambda queries, k: calls.append(len(queries)) or f(queries, k))(ix._search)
    res = Index.search_group([a, a, b, a, b], q, 7)
    assert sorted(calls) == [2, 3]
    for i, ix in enumerate([a, a, b, a, b]):
        want = ix.search(q[i], 7)
        np.testing.assert_array_equal(res.ids[i], want.ids[0])
        np.testing.assert_allclose(res.scores[i], want.scores[0], rtol=1e-6)
        assert res.n_scanned[i] == 50


def test_the_kit_refuses_a_search_param_before_that_the_index_does_not_declare():
    """``search_params_before`` names search parameters a row may predate (decode --from-sweep adds them to its plan):
    one the index does not declare, or a value out of its range, would fail only at the decode's first search, after the
    model and the builds; ``search_params_since`` must name a declared build parameter. The kit says so at once."""
    import pytest

    from anns_lab.indexes import Param
    from anns_lab.indexes.roargraph import RoarGraphIndex
    from anns_lab.testing import check_declarations

    class Beam(MatmulTopK):
        search_params = {"beam": Param(8, 1, 64)}
        search_params_before = {"beam": 64}
        search_params_since = {"beam": "width"}
        build_params = {"width": Param(1, 1, 4)}

    check_declarations(Beam)
    check_declarations(RoarGraphIndex)
    check_declarations(type("Raised", (Beam,), {"search_grid": {"beam": (8, 16)}, "calibrated_by": "beam"}))
    for bad in ({"search_params_before": {"L": 1}}, {"search_params_before": {"beam": 0}},
                {"search_params_since": {"beam": "depth"}}, {"search_params_since": {"nope": "width"}},
                {"calibrated_by": "beam"}, {"search_grid": {"beam": (8, 16)}, "calibrated_by": "width"}):
        with pytest.raises((AssertionError, IndexConfigError)):
            check_declarations(type("Bad", (Beam,), bad))


def test_the_kit_refuses_auto_rules_that_name_no_auto_build_parameter():
    """``auto_rules`` stamps the rule a build parameter's 0 resolves by (the sweep records them, decode --from-sweep
    compares them): one naming an undeclared parameter, one whose range has no 0, or an empty stamp is refused."""
    import pytest

    from anns_lab.indexes import Param, registry
    from anns_lab.testing import check_declarations

    class Lists(MatmulTopK):
        build_params = {"nlist": Param(0, 0, 64), "width": Param(1, 1, 4)}
        auto_rules = {"nlist": "2026-12-01"}

    check_declarations(Lists)
    for cls in registry.available().values():
        check_declarations(cls)
    assert registry.get("roargraph").auto_rules.keys() >= {"max_train", "list_stride", "M_sq", "n_pivots"}
    for bad in ({"nope": "2026-12-01"}, {"width": "2026-12-01"}, {"nlist": ""}):
        with pytest.raises((AssertionError, IndexConfigError)):
            check_declarations(type("Bad", (Lists,), {"auto_rules": bad}))


def test_the_kit_fails_an_index_that_writes_into_its_inputs():
    """A plugin normalising its keys in place (as faiss.normalize_L2 does) searched by cosine and scored its own recall
    against the changed keys: 1.0, where its inner-product recall was lower, and the caller's arrays were changed."""
    import pytest

    class Normalising(MatmulTopK):
        def _build(self, keys, train_queries):
            keys /= np.linalg.norm(keys, axis=1, keepdims=True)
            self.keys = keys

    with pytest.raises(AssertionError, match="wrote into the keys it was given"):
        check_index(Normalising)


def test_the_indexes_command_runs_the_kit_on_a_registered_index(monkeypatch):
    """`anns-lab indexes --check NAME`: a plugin's CI gets the kit's verdict as an exit status (1: a rule broken, said;
    2: no such index), where the listing exits 0 whatever fails to load (a plugin author's review)."""
    from click.testing import CliRunner

    from anns_lab.cli import main
    from anns_lab.indexes import registry
    from anns_lab.indexes.flat import FlatIndex

    class Undercounts(FlatIndex):
        def _search(self, queries, k, **params):
            ids, scores, scanned, *rest = super()._search(queries, k, **params)
            return (ids, scores, scanned // 10, *rest)

    real = registry.get
    monkeypatch.setattr(registry, "get", lambda name: Undercounts if name == "undercounts" else real(name))
    ok = CliRunner().invoke(main, ["indexes", "--check", "flat"])
    assert ok.exit_code == 0 and "flat passes the conformance kit: recall@10 1.000" in ok.output, ok.output
    bad = CliRunner().invoke(main, ["indexes", "--check", "undercounts"])
    assert bad.exit_code == 1 and "undercounts fails the conformance kit: AssertionError:" in bad.output, bad.output
    assert "n_scanned" in bad.output, bad.output
    unknown = CliRunner().invoke(main, ["indexes", "--check", "nosuch"])
    assert unknown.exit_code == 2 and "unknown index 'nosuch'" in unknown.output
    alone = CliRunner().invoke(main, ["indexes", "--min-recall", "0.5"])  # was ignored, the listing printed
    assert alone.exit_code == 2 and "--min-recall goes with --check NAME" in alone.output
    alone = CliRunner().invoke(main, ["indexes", "--param", "K=4", "--plausible-gain", "none"])
    assert alone.exit_code == 2 and "--param, --plausible-gain go with --check NAME" in alone.output, alone.output


def test_the_indexes_command_passes_the_kits_arguments():
    """`indexes --check` ran the kit at its defaults only: the lab's own magicpig (no exact ids; unbiased where its
    tests check it) and sparq (it finds more of the top-k than its scans explain, by design) failed it whatever was
    given (a docs review). Build parameters, the unbiasedness point and the plausibility bound go through now."""
    from click.testing import CliRunner

    from anns_lab.cli import main

    plain = CliRunner().invoke(main, ["indexes", "--check", "magicpig", "--min-recall", "0"])
    assert plain.exit_code == 1 and "magicpig fails the conformance kit" in plain.output, plain.output
    given = CliRunner().invoke(main, ["indexes", "--check", "magicpig", "--min-recall", "0", "--unbiased-at",
                                      "min_collisions=2", "--param", "K=4", "--param", "L=16"])
    assert given.exit_code == 0 and "magicpig passes the conformance kit" in given.output, given.output
    sparq = ["indexes", "--check", "sparq", "--min-recall", "0.5"]
    refused = CliRunner().invoke(main, sparq)
    assert refused.exit_code == 1 and "above what its scans explain" in refused.output, refused.output
    assert "--plausible-gain X|none" in refused.output
    for gain in ("0.7", "none"):
        passed = CliRunner().invoke(main, [*sparq, "--plausible-gain", gain])
        assert passed.exit_code == 0 and "sparq passes the conformance kit" in passed.output, (gain, passed.output)
    for name, bad, words in (("magicpig", ["--plausible-gain", "-1"], "give a number above 0, or none"),
                             ("magicpig", ["--param", "K"], "--param 'K': write NAME=VALUE"),
                             ("magicpig", ["--unbiased-at", "magicpig.min_collisions=2"], "without the index's name"),
                             ("magicpig", ["--param", "k=1"], "--param k: magicpig has no such build parameter"),
                             ("magicpig", ["--param", "min_recall=0"], "no such build parameter (its own: K, L,"),
                             ("magicpig", ["--unbiased-at", "K=2"], "--unbiased-at K: magicpig has no such search"),
                             ("ivf", ["--unbiased-at", "nprobe=2"], "ivf does not claim to be unbiased")):
        res = CliRunner().invoke(main, ["indexes", "--check", name, *bad])  # before: the kit's k, a TypeError, ignored
        assert res.exit_code == 2 and words in res.output, (bad, res.output)


def test_the_code_stamp_reads_the_helper_modules_of_its_package(tmp_path, monkeypatch):
    """A sweep's resume keeps a part only while its index's code stamp is unchanged: an edit of a helper module the
    class imports (here inside a function, relatively, two levels down) went unseen, the old rows kept (a plugin
    walkthrough, session 55), or a module of a base class's own package (a diff review: ngfix missed hnsw's kernels).
    Comments and blank lines still do not count, indentation does; modules are read from disk, never imported."""
    import importlib
    import sys

    from anns_lab.indexes import registry

    pkg, other = tmp_path / "stamp_plugin", tmp_path / "stamp_base"
    (pkg / "kernels").mkdir(parents=True)
    other.mkdir()
    (pkg / "__init__.py").write_text("from stamp_plugin.index import Stamped\n")
    (pkg / "index.py").write_text(
        "import json\nfrom stamp_base import Based\n\n\nclass Stamped(Based):\n"
        "    name = 'stamped'\n\n    def _build(self, keys, train_queries):\n        from .kernels import fast\n"
        "        return super()._build(fast.scale(keys), train_queries)\n")
    (pkg / "kernels" / "__init__.py").write_text("")
    (pkg / "kernels" / "fast.py").write_text("from . import deep\n\n\ndef scale(keys):\n    return keys\n")
    (pkg / "kernels" / "deep.py").write_text("FACTOR = 1.0\n")
    (pkg / "kernels" / "broken.py").write_text("raise RuntimeError('imported')\n")  # read, never imported
    (pkg / "late.py").write_text("from .kernels import broken\n")
    # a base class of another package: its own helper counts too (ngfix's hnsw kernels were missed)
    (other / "__init__.py").write_text("from anns_lab.indexes.flat import FlatIndex\n\n\n"
                                       "class Based(FlatIndex):\n    def _search(self, queries, k):\n"
                                       "        from stamp_base.helper import HELP\n"
                                       "        return super()._search(queries, k)\n")
    (other / "helper.py").write_text("HELP = 1\n")
    (pkg / "index.py").write_text((pkg / "index.py").read_text() + "\n\ndef later():\n    from . import late\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith(("stamp_plugin", "stamp_base"))]:
        monkeypatch.delitem(sys.modules, name)
    cls = importlib.import_module("stamp_plugin").Stamped
    real = registry.get
    monkeypatch.setattr(registry, "get", lambda name: cls if name == "stamped" else real(name))

    first = registry.code_stamp("stamped")["source_sha256"]
    (pkg / "kernels" / "deep.py").write_text("# the factor\n\nFACTOR = 1.0\n")
    assert registry.code_stamp("stamped")["source_sha256"] == first  # a comment is no edit
    (pkg / "kernels" / "deep.py").write_text("FACTOR = 2.0\n")
    assert registry.code_stamp("stamped")["source_sha256"] != first  # two imports below the class
    (pkg / "kernels" / "deep.py").write_text("FACTOR = 1.0\n")
    (pkg / "kernels" / "fast.py").write_text("from . import deep\n\n\ndef scale(keys):\n    return keys * 1\n")
    assert registry.code_stamp("stamped")["source_sha256"] != first  # imported inside _build, relatively
    (pkg / "kernels" / "fast.py").write_text("from . import deep\n\n\ndef scale(keys):\n    return keys\n")
    assert registry.code_stamp("stamped")["source_sha256"] == first
    (pkg / "kernels" / "deep.py").write_text("if False:\n    pass\n    FACTOR = 1.0\n")
    changed = registry.code_stamp("stamped")["source_sha256"]
    (pkg / "kernels" / "deep.py").write_text("if False:\n    pass\nFACTOR = 1.0\n")
    assert registry.code_stamp("stamped")["source_sha256"] != changed  # a line's indentation alone is code too
    changed = registry.code_stamp("stamped")["source_sha256"]
    (other / "helper.py").write_text("HELP = 2\n")
    assert registry.code_stamp("stamped")["source_sha256"] != changed  # the base class's package's helper
    changed = registry.code_stamp("stamped")["source_sha256"]
    (pkg / "kernels" / "broken.py").write_text("raise RuntimeError('imported, edited')\n")
    assert registry.code_stamp("stamped")["source_sha256"] != changed  # read from disk, never imported
    assert "stamp_plugin.kernels.broken" not in sys.modules and "stamp_plugin.late" not in sys.modules
    assert registry.code_stamp("flat") == registry.code_stamp("flat")  # the same on every call
