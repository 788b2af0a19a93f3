"""The sweep, report and export on a short real dump: correct tables, figures that match them, resumable work."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from anns_lab.cli import main
from anns_lab.dumps.store import open_dump
from anns_lab.errors import AnnsLabError, DumpError, IndexConfigError
from anns_lab.eval import export, metrics, report
from anns_lab.eval.heads import default_layers, load_head
from anns_lab.eval.sweep import run_sweep
from anns_lab.eval.table import RESULTS

pytestmark = pytest.mark.realmodel
WINDOW = (16, 128)


@pytest.fixture(scope="module")
def sweep(smollm2_dump, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "res"
    return run_sweep(smollm2_dump.path, ["flat", "ivf", "hnsw"], [2, 15], [0, 4], window=WINDOW, out=out, jobs=2,
                     progress=False)


def test_table_has_every_row_and_column(sweep, smollm2_dump):
    t = sweep.table
    assert not sweep.failures
    assert set(t["index"]) == {"flat", "ivf", "hnsw"} and set(t["direction"]) == {"q2k", "k2k"}
    assert set(zip(t["layer"], t["head"])) == {(2, 0), (2, 4), (15, 0), (15, 4)}
    assert (t["n_keys"] == 2048 - sum(WINDOW) - 64).all()
    assert (t.loc[t["direction"] == "q2k", "n_queries"] == 64).all()  # 16 decode + 48 held-out prefill queries
    assert t["kv_head"].tolist() == [smollm2_dump.kv_head_of(h) for h in t["head"]]
    assert not t.duplicated(["layer", "head", "index", "build_params", "search_params", "direction"]).any()


def test_flat_is_exact_and_scans_everything(sweep):
    flat = sweep.table[sweep.table["index"] == "flat"]
    assert (flat["recall"] == 1.0).all() and np.allclose(flat["scanned_fraction"], 1.0)
    q = flat[flat["direction"] == "q2k"]
    assert (q["mass_recovered"] > 0.5).all() and (q["mass_recovered"] <= 1.0 + 1e-12).all()


def test_rows_agree_with_an_independent_recomputation(sweep, smollm2_dump):
    from anns_lab.indexes import create

    row = sweep.table.query("index == 'ivf' and layer == 15 and head == 4 and direction == 'q2k'").iloc[2]
    data = load_head(smollm2_dump, 15, 4, WINDOW)
    index = create("ivf")
    index.build(data.keys)
    res = index.search(data.test_queries, 100, **json.loads(row["search_params"]))
    # Recall by brute force in float64, ties included, independent of the sweep's exact() cache.
    s = data.test_queries.astype(np.float64) @ data.keys.astype(np.float64).T
    kth = np.sort(s, axis=1)[:, -100]
    rec = np.mean([(s[i, ids[ids >= 0]] >= kth[i] - 1e-6).sum() / 100 for i, ids in enumerate(res.ids)])
    assert row["recall"] == pytest.approx(rec, abs=1e-3)
    assert row["scanned_fraction"] == pytest.approx(res.n_scanned.mean() / len(data.keys))
    assert row["bytes_read"] == pytest.approx(res.bytes_read.mean())
    assert 0 < row["recall"] < 1 and 0 < row["scanned_fraction"] < 1


def test_resumed_sweep_adds_no_rows_and_redoes_only_missing_parts(sweep, smollm2_dump):
    parts = sorted((sweep.path.parent / "parts").glob("*.parquet"))
    assert len(parts) == 4 * 3
    mtimes = {p: p.stat().st_mtime_ns for p in parts}
    parts[0].unlink()  # as if interrupted before that (layer, head, index) finished
    again = run_sweep(smollm2_dump.path, ["flat", "ivf", "hnsw"], [2, 15], [0, 4], window=WINDOW,
                      out=sweep.path.parent, jobs=1, progress=False)
    assert len(again.table) == len(sweep.table)
    for p in parts[1:]:
        assert p.stat().st_mtime_ns == mtimes[p]
    pd.testing.assert_frame_equal(again.table.drop(columns=["latency_us", "qps", "build_s"]),
                                  sweep.table.drop(columns=["latency_us", "qps", "build_s"]))


def test_report_numbers_equal_the_table(sweep, tmp_path):
    path = report.write_report(sweep.path, tmp_path / "rep")
    text = path.read_text()
    for fig in ("recall_vs_scanned.png", "recall_vs_bytes.png", "mahalanobis.png", "dynamic_vs_static.png"):
        assert (tmp_path / "rep" / fig).stat().st_size > 10_000
        assert fig in text
    t = sweep.table
    # By hand: IVF Q→K, the scanned fraction at recall 0.95 per head, read off the line between the frontier's grid
    # points around it (np.interp on the frontier: each point recalls more than every cheaper one), median of 4 heads.
    ivf = t[(t["index"] == "ivf") & (t["direction"] == "q2k")]

    def at_095(g, column):
        g = g.sort_values([column, "recall"], ascending=[True, False])
        g = g[g["recall"] > g["recall"].cummax().shift(fill_value=-1.0)]
        return float(np.interp(0.95, g["recall"], g[column])) if g["recall"].max() >= 0.95 else np.nan

    per_head = [at_095(g, "scanned_fraction") for _, g in ivf.groupby(["layer", "head"])]
    expected = f"{100 * np.median(per_head):.1f}%"
    line = next(ln for ln in text.splitlines() if ln.startswith("| ivf | q2k |"))
    assert line.split("|")[5].strip().startswith(expected)
    # The bytes table: bytes read per query at 0.95 per head, the same way, median, in KiB.
    per_head = [at_095(g, "bytes_read") for _, g in ivf.groupby(["layer", "head"])]
    line = next(ln for ln in text.split("## Least bytes")[1].splitlines() if ln.startswith("| ivf |"))
    assert line.split("|")[4].strip().startswith(f"{np.median(per_head) / 1024:.1f} KiB")
    assert "Mahalanobis" in text and "dynamic top-100" in text
    # 16 decode steps: 48 held-out prefill queries make up the 64 test queries (all called decode queries before)
    assert "their queries and the last 48 prefill queries, held out of the index, are the 64 test queries" in text
    assert "Test queries lie at a median Mahalanobis distance" in text


def test_report_says_when_the_dump_is_beyond_the_models_context(sweep, smollm2_dump, tmp_path, monkeypatch):
    plain = report.write_report(sweep.path, tmp_path / "plain").read_text()
    assert "extrapolated" not in plain.lower()

    shorter = {"by": 1}

    def short_context(path):  # the same dump, as if the model had been trained on fewer tokens than it holds
        dump = open_dump(path)
        dump.manifest["model"]["context"] = dump.manifest["n_tokens"]["prefill"] - shorter["by"]
        return dump

    monkeypatch.setattr(report, "open_dump", short_context)
    text = report.write_report(sweep.path, tmp_path / "beyond").read_text()
    assert "Extrapolated:" in text and "--allow-extrapolation" in text
    # The prompt fits, the decode steps (the Q→K rows' queries) run past it: said too (before: nothing), no flag named.
    shorter["by"] = -4
    text = report.write_report(sweep.path, tmp_path / "decode-beyond").read_text()
    n_decode = smollm2_dump.manifest["n_tokens"]["decode"]
    assert f"Extrapolated: the last {n_decode - 4} of the {n_decode} decode steps run beyond" in text
    assert "--allow-extrapolation" not in text


def rendered_dom(page) -> str:
    """The DOM of ``page`` after headless Chromium has loaded it and run its scripts."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser, "Chromium is missing: `make setup` installs it (apt-get install chromium, as root)"
    out = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_html_report_renders_its_figures_and_tables_in_a_browser(sweep, tmp_path):
    # Sweeps of the same dump beside this one: the page links to the one with a report, names the one without.
    for name in ("other", "unreported"):
        (sweep.path.parent.parent / name).mkdir(exist_ok=True)
        (sweep.path.parent.parent / name / "sweep.json").write_text((sweep.path.parent / "sweep.json").read_text())
    (sweep.path.parent.parent / "other" / "report.html").write_text("<html></html>")
    report.write_report(sweep.path)
    page = sweep.path.parent / "report.html"
    assert "http" not in re.sub(r'<img [^>]*>', "", page.read_text()).replace("http-equiv", "")  # nothing to fetch
    dom = rendered_dom(page)
    imgs = re.findall(r'<img [^>]*src="data:image/png;base64,([A-Za-z0-9+/=]+)"', dom)
    assert len(imgs) == len(report.FIGURES) == 4 and all(base64.b64decode(b).startswith(b"\x89PNG") for b in imgs)
    t = sweep.table
    def rows(table_id):
        body = re.search(rf'<table class="sortable" id="{table_id}">.*?<tbody>(.*?)</tbody>', dom, re.S).group(1)
        return body.count("<tr>")
    assert rows("pareto") == t.groupby(["index", "direction"]).ngroups == 6
    assert rows("per-head") == t.groupby(["layer", "head", "index", "direction"]).ngroups == 24
    assert rows("points") == t[t["direction"] == "q2k"].groupby(["index", "search_params"]).ngroups
    findings = re.search(r'<ul id="findings">(.*?)</ul>', dom, re.S).group(1)
    assert findings.count("<li>") >= 6 and "IVF reaches recall 0.95 on Q→K" in findings
    assert 'href="../other/report.html"' in dom and "unreported (no report yet)" in dom
    assert "unreported/report.html" not in dom  # before: a link to a page no one wrote


def test_queries_are_out_of_distribution_for_keys(smollm2_dump):
    d = load_head(smollm2_dump, 15, 0, WINDOW)
    q = np.median(metrics.mahalanobis(d.test_queries, d.keys))
    k = np.median(metrics.mahalanobis(d.k2k_queries, d.keys))
    assert q > 1.5 * k  # the paper's Fig. 3b phenomenon, on our own data


def test_fbin_export_reads_back_identical_arrays(smollm2_dump, tmp_path):
    files = export.export_fbin(smollm2_dump, 2, 4, tmp_path / "x", k=100, window=WINDOW)
    d = load_head(smollm2_dump, 2, 4, WINDOW)
    np.testing.assert_array_equal(export.read_fbin(files["base.fbin"]), d.keys)
    np.testing.assert_array_equal(export.read_fbin(files["test_queries.fbin"]), d.test_queries)
    np.testing.assert_array_equal(export.read_fbin(files["train_queries.fbin"]), d.train_queries)
    ids, scores = export.read_gt(tmp_path / "x" / "gt_q2k.bin")
    assert ids.shape == (64, 100)
    np.testing.assert_array_equal(ids, metrics.exact_topk(d.exact("q2k"), 100))
    np.testing.assert_allclose(scores[:, 0], d.exact("q2k").max(axis=1))


def test_bad_input(smollm2_dump, sweep, tmp_path, tiny_llama):
    with pytest.raises(DumpError, match="not a dump"):
        run_sweep(tmp_path, out=tmp_path / "o", progress=False)
    (tmp_path / "unfinished" / ".staging").mkdir(parents=True)
    with pytest.raises(DumpError, match="unfinished"):
        run_sweep(tmp_path / "unfinished", out=tmp_path / "o", progress=False)
    with pytest.raises(IndexConfigError, match="did you mean ivf"):
        run_sweep(smollm2_dump.path, ["ivff"], out=tmp_path / "o", progress=False)
    with pytest.raises(DumpError, match="layer 7 is not in dump"):
        run_sweep(smollm2_dump.path, ["flat"], [7], out=tmp_path / "o", progress=False)
    with pytest.raises(DumpError, match="query head 9 is out of range"):
        run_sweep(smollm2_dump.path, ["flat"], [2], [9], out=tmp_path / "o", progress=False)
    with pytest.raises(AnnsLabError, match=r"other settings \(k: 100 there, 10 here\); pass --overwrite"):
        run_sweep(smollm2_dump.path, ["flat"], [2], [0], k=10, window=WINDOW, out=sweep.path.parent, progress=False)
    assert (sweep.path.parent / RESULTS).is_file()  # nothing overwritten
    with pytest.raises(AnnsLabError, match="not .*dump"):
        report.write_report(sweep.path, tmp_path / "r", dump_path=tiny_llama)
    r = CliRunner().invoke(main, ["sweep", "--dump", str(smollm2_dump.path), "--indexes", "flat", "--window", "12"])
    assert r.exit_code == 2 and "SINK,RECENT" in r.output


def test_cli_sweep_of_a_selection_gets_its_own_default_folder(smollm2_dump, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["sweep", "--dump", str(smollm2_dump.path), "--indexes", "flat", "--layers", "2", "--heads", "0",
            "--window", "16,128", "--jobs", "1"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    folder = tmp_path / "results" / f"{smollm2_dump.path.name}-flat-L2-H0"
    assert (folder / RESULTS).is_file() and not (tmp_path / "results" / smollm2_dump.path.name).exists()
    assert "(1 head × 1 index)" in r.output and "earlier sweeps" not in r.output
    assert "index kernels ready in" in r.output  # the sweep says what it does before its first part
    # A second index into the same folder: the sweep says the table holds the earlier rows too.
    r = CliRunner().invoke(main, args[:3] + ["--indexes", "ivf", "--out", str(folder)] + args[5:])
    assert r.exit_code == 0, r.output
    assert "(1 head × 2 indexes)" in r.output and "come from earlier sweeps" in r.output


def test_cli_sweep_notes_training_options_its_indexes_do_not_read(smollm2_dump, tmp_path):
    """--train-group / --train-positions typed for indexes that build on the keys alone, or read their queries where the
    prefill had them, are recorded, not refused (a folder's settings govern its resumes): the sweep says they reach
    none (here before --k 0's refusal, so that nothing runs)."""
    base = ["sweep", "--dump", str(smollm2_dump.path), "--layers", "2", "--heads", "0", "--k", "0",
            "--out", str(tmp_path / "o")]
    r = CliRunner().invoke(main, base + ["--indexes", "flat,ivf", "--train-group", "group", "--train-positions", "mix"])
    assert "note: --train-group, --train-positions: read by none of --indexes flat,ivf" in r.output
    assert r.exit_code != 0 and "note:" in r.output.split("Error")[0]
    r = CliRunner().invoke(main, base + ["--indexes", "snapkv", "--train-positions", "serving"])
    assert "note: --train-positions: read by none of --indexes snapkv;" in r.output
    for read in (["--indexes", "roargraph", "--train-group", "group"], ["--indexes", "flat"],
                 ["--indexes", "snapkv,roargraph", "--train-positions", "serving"],
                 ["--indexes", "snapkv", "--train-positions", "own"], ["--indexes", "nosuch", "--train-group", "group"]):
        assert "note:" not in CliRunner().invoke(main, base + read).output, read


def test_default_layers_spread_over_depth():
    assert default_layers(list(range(30))) == [2, 15, 28]
    assert default_layers([5, 11, 17]) == [5, 11, 17]


def test_build_params_make_their_own_rows(smollm2_dump, tmp_path):
    run_sweep(smollm2_dump.path, ["ivf"], [2], [0], window=WINDOW, out=tmp_path, jobs=1, progress=False)
    res = run_sweep(smollm2_dump.path, ["ivf"], [2], [0], window=WINDOW, out=tmp_path, jobs=1, progress=False,
                    build_params={"ivf": {"nlist": 20}})
    rows = res.table[(res.table["index"] == "ivf") & (res.table["layer"] == 2) & (res.table["head"] == 0)]
    nlists = {json.loads(b)["nlist"] for b in rows["build_params"]}
    assert nlists == {0, 20}  # the default build (nlist auto) and the variant, side by side
    assert (rows[rows["build_params"].str.contains('"nlist": 20')]["search_params"].map(
        lambda p: json.loads(p)["nprobe"]).max() == 20)  # the grid ends exhaustive at the variant's nlist
    md = report.write_report(tmp_path).read_text()
    assert "ivf (nlist=20)" in md and "| ivf |" in md  # each build reported apart, the defaults under the index's name
    before = sorted(p.name for p in (tmp_path / "parts").iterdir())
    res = run_sweep(smollm2_dump.path, ["ivf"], [2], [0], window=WINDOW, out=tmp_path, jobs=1, progress=False,
                    build_params={"ivf": {"nlist": 0}})  # the default, given: the default build's part, not a copy
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == before
    assert not res.table.duplicated(["layer", "head", "index", "build_params", "search_params", "direction"]).any()
    with pytest.raises(IndexConfigError, match="unknown parameter 'nlst'"):
        run_sweep(smollm2_dump.path, ["ivf"], [2], [0], window=WINDOW, out=tmp_path, progress=False,
                  build_params={"ivf": {"nlst": 20}})


def test_group_training_is_recorded_and_never_mixes_with_per_head_graphs(smollm2_dump, tmp_path):
    """--train-group: the sweep's settings record it, roargraph's rows come from the group's training queries (other
    graphs than the per-head ones), and a folder of one setting refuses the other."""
    from anns_lab.eval.table import SETTINGS

    head = run_sweep(smollm2_dump.path, ["roargraph"], [2], [1], window=WINDOW, out=tmp_path / "head", jobs=1,
                     progress=False, quick=True).table
    group = run_sweep(smollm2_dump.path, ["roargraph"], [2], [1], window=WINDOW, out=tmp_path / "group", jobs=1,
                      progress=False, quick=True, train_group="group").table
    assert json.loads((tmp_path / "group" / SETTINGS).read_text())["train_group"] == "group"
    assert "train_group" not in json.loads((tmp_path / "head" / SETTINGS).read_text())  # as sweeps before the option
    assert len(head) == len(group) and not np.array_equal(head["scanned_fraction"], group["scanned_fraction"])
    with pytest.raises(AnnsLabError, match="other settings .*train_group: group there, default here"):
        run_sweep(smollm2_dump.path, ["roargraph"], [2], [1], window=WINDOW, out=tmp_path / "group", progress=False,
                  quick=True)
    with pytest.raises(AnnsLabError, match="choose one of head, group, strided"):
        run_sweep(smollm2_dump.path, ["roargraph"], [2], [1], window=WINDOW, out=tmp_path / "x", progress=False,
                  train_group="pooled")


def test_unlisted_training_is_recorded_and_reaches_only_the_attention_aware_build(smollm2_dump, tmp_path):
    """--train-group unlisted: the settings record it; roargraph's rows differ from the per-head sweep's (its build got
    the group's other heads' queries), ivf's are the same (a key-only index gets none)."""
    from anns_lab.eval.table import SETTINGS

    runs = {mode: run_sweep(smollm2_dump.path, ["roargraph", "ivf"], [15], [3], window=WINDOW, out=tmp_path / mode, jobs=1,
                            progress=False, quick=True, train_group=mode).table.sort_values(["index", "search_params", "direction"])
            for mode in ("head", "unlisted")}
    assert json.loads((tmp_path / "unlisted" / SETTINGS).read_text())["train_group"] == "unlisted"
    rg, ivf = ({m: t[t["index"] == name].scanned_fraction.to_numpy() for m, t in runs.items()} for name in ("roargraph", "ivf"))
    assert np.array_equal(ivf["head"], ivf["unlisted"])
    assert len(rg["head"]) == len(rg["unlisted"]) and not np.array_equal(rg["head"], rg["unlisted"])


def test_quick_sweep_keeps_recall_and_never_mixes_with_a_full_one(smollm2_dump, sweep, tmp_path):
    quick = run_sweep(smollm2_dump.path, ["ivf"], [15], [4], window=WINDOW, out=tmp_path, jobs=1, progress=False,
                      quick=True).table
    full = sweep.table.query("index == 'ivf' and layer == 15 and head == 4")
    pd.testing.assert_series_equal(quick["recall"].reset_index(drop=True), full["recall"].reset_index(drop=True))
    assert quick["mass_recovered"].isna().all() and quick["latency_us"].isna().all()
    with pytest.raises(AnnsLabError, match="other settings"):
        run_sweep(smollm2_dump.path, ["ivf"], [15], [4], window=WINDOW, out=tmp_path, progress=False)
