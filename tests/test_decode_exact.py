"""Exactness of retrieval decoding: the merge, equality with full attention, window mode, inserted tokens."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch

from conftest import TEST_DEVICE

from anns_lab.decode.engine import Mode, Settings, forward_untimed, prefill, run_mode
from anns_lab.decode.kernels import attend_rows, attend_window, merge
from anns_lab.decode.placement import IndexPlan
from anns_lab.dumps.models import load_model
from anns_lab.indexes import registry
from anns_lab.window import Window

# Index modes checked for exactness; search parameters are each index's most thorough setting (capped: the plugins'
# token budgets then cover every key).
CANDIDATES = ("flat", "ivf", "hnsw", "vamana", "roargraph", "robust-vamana", "quest", "shadowkv", "ngfix", "sparq",
              "loki", "double-sparsity", "snapkv", "infllm")


# Where the most thorough value of a parameter would make the rest exact by construction, the cheapest: sparq's and loki's
# partial products over every dimension are the full ones; over an eighth the budget (every key) must make them exact.
CHEAPEST = {"sparq": {"rank": 0.125}, "loki": {"rank": 0.125}, "double-sparsity": {"rank": 0.125}}


def thorough(name: str) -> dict:
    cls = registry.get(name)
    most = {p: type(spec.default)(min(spec.high, 4096)) for p, spec in cls.search_params.items() if spec.high is not None}
    return most | CHEAPEST.get(name, {})


def index_modes() -> list[str]:
    return [n for n in CANDIDATES if n in registry.available()]


def softmax_attention(q, k, v, scaling):
    logits = (k @ q) * scaling
    w = np.exp(logits - logits.max())
    return (w / w.sum()) @ v


# -- the merge ---------------------------------------------------------------------------------------


def test_merge_of_disjoint_sets_is_attention_over_their_union():
    rng = np.random.default_rng(0)
    h, g, n, d = 6, 2, 300, 16
    q = rng.normal(size=(h, d)).astype(np.float32)
    keys = rng.normal(size=(g, n, d)).astype(np.float32) * 3
    values = rng.normal(size=(g, n, d)).astype(np.float32)
    scaling = 0.37
    for trial in range(5):
        perm = rng.permutation(n)
        a, b = perm[: 40 + trial * 30], perm[40 + trial * 30:]
        rows_a = np.tile(a, (h, 1)).astype(np.int64)
        rows_b = np.tile(b, (h, 1)).astype(np.int64)
        rows_b[:, ::7] = -1  # padding ids are skipped...
        kept_b = [b[np.arange(len(b)) % 7 != 0] for _ in range(h)]
        o_a, m_a, z_a = attend_rows(q, keys, values, rows_a, scaling)
        o_b, m_b, z_b = attend_rows(q, keys, values, rows_b, scaling)
        o = merge(o_a, m_a, z_a, o_b, m_b, z_b)
        for head in range(h):
            kv = head // (h // g)
            union = np.concatenate([a, kept_b[head]])
            ref = softmax_attention(q[head].astype(np.float64), keys[kv, union].astype(np.float64),
                                    values[kv, union].astype(np.float64), scaling)
            np.testing.assert_allclose(o[head], ref, rtol=1e-9, atol=1e-9)


def test_merge_with_an_empty_side_and_torch_window_side():
    rng = np.random.default_rng(1)
    q = rng.normal(size=(4, 8)).astype(np.float32)
    keys = rng.normal(size=(2, 20, 8)).astype(np.float32)
    values = rng.normal(size=(2, 20, 8)).astype(np.float32)
    empty = attend_rows(q, keys, values, np.full((4, 3), -1, np.int64), 0.5)
    assert np.all(empty[2] == 0) and np.all(np.isneginf(empty[1]))
    o_w, m_w, z_w = attend_window(torch.from_numpy(q).double(), torch.from_numpy(keys).double(),
                                  torch.from_numpy(values).double(), 0.5)
    merged = merge(o_w, m_w, z_w, *(torch.from_numpy(x) for x in empty))
    torch.testing.assert_close(merged, o_w, rtol=1e-12, atol=1e-12)
    full = attend_rows(q, keys, values, np.tile(np.arange(20), (4, 1)).astype(np.int64), 0.5)
    np.testing.assert_allclose(o_w.numpy(), full[0], rtol=1e-9, atol=1e-9)


# -- equality with full attention --------------------------------------------------------------------

PROMPT = 64
STEPS = 12
SETTINGS = Settings(Window(4, 8), topk=PROMPT + STEPS - 12, add_batch=4, chunk=24)


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_gemma3"])
def prefilled(request):
    lm = load_model(str(request.getfixturevalue(request.param)), device=TEST_DEVICE)
    ids = np.random.default_rng(3).integers(3, 400, size=PROMPT).tolist()
    pre = prefill(lm, ids, SETTINGS, capture_queries=True)
    full = run_mode(lm, pre, Mode("full"), SETTINGS, STEPS, keep_logits=True)
    return lm, pre, full


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_the_untimed_warm_forward_leaves_the_prefill_as_it_was(prefilled):
    # On an accelerator every prefill is preceded by this forward (engine.warm_accelerator): it must change nothing.
    lm, pre, _ = prefilled
    forward_untimed(lm, pre.ids[:SETTINGS.chunk], SETTINGS)
    again = prefill(lm, pre.ids, SETTINGS, capture_queries=True)
    assert torch.equal(again.logits, pre.logits)
    assert set(again.queries) == set(pre.queries) and all(np.array_equal(again.queries[l], pre.queries[l]) for l in pre.queries)


def test_the_kept_prefill_queries_are_every_chunks_in_place(prefilled):
    """The queries an index trains on, kept chunk by chunk in one buffer per layer (since session 45; before, each
    chunk's own tensor, held to the decode's end), equal a one-chunk prefill's, every position in its place (64 tokens
    in chunks of 24: three writes, the last short); a prefill keeping the newest 10 keeps the same last rows."""
    lm, pre, _ = prefilled
    whole = prefill(lm, pre.ids, dataclasses.replace(SETTINGS, chunk=len(pre.ids)), capture_queries=True)
    newest = prefill(lm, pre.ids, SETTINGS, capture_queries=True, newest_queries=10)
    assert set(pre.queries) == set(whole.queries) == set(newest.queries) == set(lm.long_range_layers)
    for layer, q in pre.queries.items():
        assert q.dtype == np.float32 and q.shape == whole.queries[layer].shape and q.shape[1] == len(pre.ids)
        np.testing.assert_allclose(q, whole.queries[layer], rtol=1e-4, atol=1e-5)
        assert np.array_equal(newest.queries[layer], q[:, -10:])



def test_the_kept_queries_are_copies_in_one_buffer_and_a_second_pass_is_refused():
    """Retrieval._keep_queries itself: chunks of 4, 4 and 2 of a 10-token prompt (bfloat16, as a model may give them)
    land in one float32 buffer, copies (the chunks' tensors, changed after, change nothing: until session 45 the
    kept chunk tensors were the model's own on a float32 CPU model), read back contiguous part way and whole; an
    eleventh position is one clear error, not a row dropped."""
    from anns_lab.decode.attention import Retrieval
    from anns_lab.errors import DecodeError

    src = torch.randn(3, 10, 8, dtype=torch.bfloat16)
    ctl = Retrieval([0], "full", Window(0, 0), True, None, n_tokens=10)
    chunks = [src[:, :4].clone(), src[:, 4:8].clone(), src[:, 8:].clone()]
    ctl._keep_queries(0, chunks[0])
    part, buffer = ctl.prefill_queries(0), ctl.queries[0]
    assert part.shape == (3, 4, 8) and part.flags.c_contiguous and buffer.shape == (3, 10, 8)
    for chunk in chunks[1:]:
        ctl._keep_queries(0, chunk)
    for chunk in chunks:
        chunk.zero_()
    got = ctl.prefill_queries(0)
    assert ctl.queries[0] is buffer and got.dtype == np.float32 and got.flags.c_contiguous
    assert np.array_equal(got, src.float().numpy()) and np.shares_memory(got, ctl.prefill_queries(0))
    with pytest.raises(DecodeError, match="positions 10..10 of a 10-token prompt.*attention twice a forward is not"):
        ctl._keep_queries(0, src[:, :1])
    with pytest.raises(ValueError, match="needs the prompt's length"):
        Retrieval([0], "full", Window(0, 0), True)
    newest = Retrieval([0], "full", Window(0, 0), True, 3)
    for i in range(0, 10, 4):
        newest._keep_queries(0, src[:, i:i + 4])
    assert np.array_equal(newest.prefill_queries(0), src[:, -3:].float().numpy())


def test_a_prefill_keeps_only_the_newest_queries_its_indexes_and_calibration_read(prefilled):
    """engine.kept_queries: SnapKV reads its window's newest queries (Index.newest_train_queries), a calibration the
    newest calibrate.QUERIES, an index that may read any keeps them all, and so do a strided subsample of them and
    the training groups that mix or rank a head's rows; a SnapKV mode decoding from a prefill that kept only its
    window's queries (8 of 64) makes the same tokens and logits as from one that kept all."""
    from anns_lab.decode import calibrate as calibration
    from anns_lab.decode.engine import kept_queries
    from anns_lab.errors import IndexConfigError

    if "snapkv" not in registry.available():
        pytest.skip("the snapkv plugin is not installed")
    lm, pre, _ = prefilled
    snap = Mode("snapkv", IndexPlan("snapkv", {"window": 8}, {"budget": 16}))
    calibrated = dataclasses.replace(SETTINGS, calibrate=0.9)
    assert kept_queries([Mode("full"), snap], SETTINGS) == 8
    assert kept_queries([snap, Mode("snapkv", IndexPlan("snapkv", {"window": 20}))], SETTINGS) == 20
    assert kept_queries([snap], calibrated) == kept_queries([Mode("flat", IndexPlan("flat"))], calibrated) \
        == calibration.QUERIES
    assert kept_queries([snap, Mode("roargraph", IndexPlan("roargraph"))], SETTINGS) is None
    assert kept_queries([Mode("flat", IndexPlan("flat"), {lm.long_range_layers[0]: IndexPlan("roargraph")})],
                        SETTINGS) is None
    assert kept_queries([snap], dataclasses.replace(SETTINGS, train_queries=16)) is None
    assert kept_queries([Mode("snapkv", IndexPlan("snapkv", {"window": 100}))], calibrated) == 100
    for group in ("group", "strided", "unlisted"):  # a head's rows mixed or ranked by their count: all of them
        assert kept_queries([snap], dataclasses.replace(SETTINGS, train_group=group)) is None
    cls = registry.get("snapkv")
    for bad in (0, -3, 2.5, "8"):  # a plugin's declaration: one clear error before the prefill, never a wrong slice
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cls, "newest_train_queries", lambda self, bad=bad: bad)
            with pytest.raises(IndexConfigError, match=f"snapkv: newest_train_queries\\(\\) is {bad!r}"):
                kept_queries([snap], SETTINGS)
    newest = prefill(lm, pre.ids, SETTINGS, capture_queries=True, newest_queries=kept_queries([snap], SETTINGS))
    assert all(q.shape[1] == 8 for q in newest.queries.values())
    a = run_mode(lm, newest, snap, SETTINGS, STEPS, keep_logits=True)
    b = run_mode(lm, pre, snap, SETTINGS, STEPS, keep_logits=True)
    assert a.tokens == b.tokens and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    for layer, store in a.stores.items():
        assert all(np.array_equal(x._order, y._order) for x, y in zip(store.indexes, b.stores[layer].indexes))


@pytest.mark.parametrize("device,ids,warmed", [("cpu", 50, None), ("cuda", 50, 17), ("cuda", 10, 10), ("cuda", 1, None),
                                               ("mps", 40, 17)])
def test_the_warm_forward_runs_on_an_accelerator_only_and_covers_a_chunk_and_a_step(monkeypatch, device, ids, warmed):
    """engine.warm_accelerator: no forward on the CPU (nothing to load, and a chunk's forward would cost seconds at 8K);
    on an accelerator one over the first chunk plus the token after it (the decode step's shape), never the whole
    prompt, and none for a prompt of one token."""
    from types import SimpleNamespace

    from anns_lab.decode import engine

    seen = []
    monkeypatch.setattr(engine, "forward_untimed", lambda lm, ids, settings: seen.append(list(ids)))
    lm = SimpleNamespace(model=SimpleNamespace(device=torch.device(device)))
    prompt = list(range(100, 100 + ids))
    engine.warm_accelerator(lm, prompt, dataclasses.replace(SETTINGS, chunk=16))
    assert seen == ([] if warmed is None else [prompt[:warmed]])


@pytest.mark.parametrize("name", index_modes())
def test_topk_covering_every_key_equals_full_attention(prefilled, name):
    lm, pre, full = prefilled
    run = run_mode(lm, pre, Mode(name, IndexPlan(name, {}, thorough(name))), SETTINGS, STEPS, keep_logits=True)
    assert len(run.logits) == len(full.logits) == STEPS
    for step, (a, b) in enumerate(zip(run.logits, full.logits)):
        assert _rel(a, b) < 1e-4, (name, step)
    assert run.tokens == full.tokens
    # Retrieval ran on the long-range layers only (Gemma-3: its global layers).
    assert set(run.stores) == set(lm.long_range_layers)


@pytest.mark.parametrize("group", ["group", "strided"])
def test_one_graph_per_kv_head_serves_its_group_and_equals_full_attention(prefilled, group):
    """--train-group group|strided: one roargraph per KV head, the same object for each query head of its group
    (added to once per step batch), trained on the group's queries; with a top-k covering every key the tokens and
    logits are full attention's, and the CPU bytes count each shared graph once."""
    import dataclasses

    lm, pre, full = prefilled
    settings = dataclasses.replace(SETTINGS, train_group=group)
    run = run_mode(lm, pre, Mode("roargraph", IndexPlan("roargraph", {}, thorough("roargraph"))), settings, STEPS,
                   keep_logits=True)
    assert run.tokens == full.tokens and all(_rel(a, b) < 1e-4 for a, b in zip(run.logits, full.logits))
    for layer, store in run.stores.items():
        t = pre.queries[layer].shape[1]  # prefill queries per query head
        G, d = store.keys.shape[0], store.keys.shape[2]
        per = store.n_heads // G
        assert all(store.indexes[h] is store.indexes[per * (h // per)] for h in range(store.n_heads))
        assert len({id(ix) for ix in store.indexes}) == G
        assert store.indexes[0].n_keys == store.n_indexed
        kept = min(t * (per if group == "group" else 1), store.indexes[0].params["keep_queries"])
        assert len(store.indexes[0]._recent_q) == kept  # trained on the group's rows: all g·t or one head's t
        graphs = sum(ix.nbytes - ix.n_keys * ix.dim * 4 for ix in store.indexes[::per])
        assert store.cpu_bytes() == 4 * G * d * 2 * store.n_rows + graphs


def test_tokens_leaving_the_window_are_inserted_and_found(prefilled):
    lm, pre, full = prefilled
    settings = Settings(Window(4, 8), topk=PROMPT + STEPS - 12, add_batch=1, chunk=24, steps=STEPS)
    run = run_mode(lm, pre, Mode("flat", IndexPlan("flat")), settings, STEPS, keep_logits=True)
    for a, b in zip(run.logits, full.logits):
        assert _rel(a, b) < 1e-4
    # After STEPS-1 decode forwards every position but the window is in the index, not in a side-buffer.
    last = PROMPT + STEPS - 1  # tokens in the cache at the last forward
    for store in run.stores.values():
        assert store.n_rows == last - settings.window.sink - settings.window.recent
        assert store.n_indexed == store.n_rows
        assert store.indexes[0].n_keys == store.n_rows
        # Sized for the prompt's rows plus one per step at the start, so it never had to grow.
        assert store.keys.shape[1] == store.values.shape[1] == PROMPT - 12 + STEPS
    from anns_lab.decode.engine import summarize

    assert summarize(run)["insert_ms"] > 0  # the insert is timed on its own, not hidden in another part


def test_store_grows_past_its_reserve_and_keeps_every_row():
    from anns_lab.decode.placement import LayerStore

    rng = np.random.default_rng(5)
    keys, values = rng.standard_normal((2, 40, 8), np.float32), rng.standard_normal((2, 40, 8), np.float32)
    store = LayerStore(0, 4, keys, values, topk=5, plan=IndexPlan("flat"), add_batch=3, reserve=2)
    store.build(None)
    assert store.keys.shape[1] == 42
    new_k, new_v = rng.standard_normal((2, 7, 8), np.float32), rng.standard_normal((2, 7, 8), np.float32)
    for t in range(7):  # one token per step, as the decoder appends them
        store.extend(new_k[:, t:t + 1], new_v[:, t:t + 1])
    assert store.n_rows == 47 and store.keys.shape[1] >= 47
    np.testing.assert_array_equal(store.keys[:, :47], np.concatenate([keys, new_k], axis=1))
    np.testing.assert_array_equal(store.values[:, :47], np.concatenate([values, new_v], axis=1))
    assert store.n_indexed == 46 and store.indexes[0].n_keys == 46  # two full batches of 3 inserted


def test_index_without_add_keeps_leaving_tokens_in_a_side_buffer(prefilled, monkeypatch):
    from anns_lab.indexes.base import Index
    from anns_lab.indexes.flat import FlatIndex

    class NoAdd(FlatIndex):
        _add = Index._add

    monkeypatch.setattr("anns_lab.decode.placement.registry.get", lambda name: NoAdd)
    lm, pre, full = prefilled
    run = run_mode(lm, pre, Mode("noadd", IndexPlan("noadd")), SETTINGS, STEPS, keep_logits=True)
    for a, b in zip(run.logits, full.logits):
        assert _rel(a, b) < 1e-4
    assert any("side-buffer" in n for n in run.notes)
    store = next(iter(run.stores.values()))
    assert store.n_indexed == PROMPT - 12 and store.n_rows > store.n_indexed


def test_small_topk_differs_but_runs(prefilled):
    lm, pre, full = prefilled
    settings = Settings(Window(4, 8), topk=2, add_batch=4, chunk=24)
    run = run_mode(lm, pre, Mode("flat", IndexPlan("flat")), settings, STEPS, keep_logits=True)
    assert len(run.logits) == STEPS and max(_rel(a, b) for a, b in zip(run.logits, full.logits)) > 1e-4


# -- window and top-k modes against an independent computation ---------------------------------------


def _window_keys(settings):
    """The keys window mode attends, as a mask over a step's n keys (every head the same)."""
    def keep(q, k):
        n = k.shape[1]
        allowed = torch.zeros(q.shape[0], n, dtype=torch.bool)
        allowed[:, : settings.window.sink] = True
        allowed[:, max(0, n - settings.window.recent):] = True
        return allowed

    return keep


def _topk_keys(settings, n_prompt):
    """The keys an exact index mode attends at a step of n keys, from their definition: the window, and of the keys
    outside it the side-buffer whole (tokens that left the window since the prefill, fewer than ``add_batch`` past
    the last insertion) and each query head's ``topk`` largest q·k among the rest (the indexed ones)."""
    sink, recent = settings.window.sink, settings.window.recent
    window = _window_keys(settings)

    def keep(q, k):
        n, group = k.shape[1], q.shape[0] // k.shape[0]
        allowed = window(q, k)
        n0 = n_prompt - settings.window.size  # indexed after the prefill
        left = n - recent - sink - n0  # keys that have left the window since
        indexed = n0 + settings.add_batch * (left // settings.add_batch)
        allowed[:, sink + indexed: n - recent] = True
        for h in range(q.shape[0]):
            scores = k[h // group, sink: sink + indexed].double() @ q[h].double()
            allowed[h, sink + torch.topk(scores, min(settings.topk, indexed)).indices] = True
        return allowed

    return keep


def _masked_reference(lm, pre, steps, keep):
    """Decoding computed independently: sdpa over the keys ``keep(q (H, d), k (G, n, d))`` allows each query head
    at each decode step of a long-range layer (the model's own attention elsewhere)."""
    import copy

    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    from anns_lab.dumps.models import forward_tokens

    long_range = set(lm.long_range_layers)

    def windowed(module, query, key, value, attention_mask, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if module.layer_idx in long_range and query.shape[2] == 1:
            allowed = keep(query[0, :, 0].cpu(), key[0].cpu()).to(key.device)
            rep = query.shape[1] // key.shape[1]
            k = key.repeat_interleave(rep, dim=1)
            v = value.repeat_interleave(rep, dim=1)
            out = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=allowed[None, :, None, :],
                                                                   scale=kwargs.get("scaling") or module.scaling)
            return out.transpose(1, 2).contiguous(), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("test_window_ref", windowed)
    AttentionMaskInterface.register("test_window_ref", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    cache = copy.deepcopy(pre.cache)
    ids, logits, out = list(pre.ids), pre.logits, []
    lm.model.set_attn_implementation("test_window_ref")
    try:
        with torch.inference_mode():
            for _ in range(steps - 1):
                out.append(logits.to("cpu"))  # run_mode keeps its logits on the CPU
                ids.append(int(logits.argmax()))
                logits = forward_tokens(lm, cache, ids, len(ids) - 1, len(ids))[0, -1].float()
            out.append(logits.to("cpu"))
    finally:
        lm.model.set_attn_implementation("sdpa")
    return out


def test_window_mode_equals_independent_window_attention(prefilled):
    lm, pre, full = prefilled
    run = run_mode(lm, pre, Mode("window"), SETTINGS, STEPS, keep_logits=True)
    ref = _masked_reference(lm, pre, STEPS, _window_keys(SETTINGS))
    for a, b in zip(run.logits, ref):
        assert _rel(a, b) < 1e-4
    assert max(_rel(a, b) for a, b in zip(run.logits, full.logits)) > 1e-3  # the window alone is not full attention


@pytest.mark.parametrize("window, topk, add_batch", [((4, 8), 5, 4), ((0, 1), 1, 1), ((1, 16), 7, 3)])
def test_a_topk_short_of_the_keys_equals_attention_over_the_window_buffer_and_exact_top_keys(prefilled, window, topk,
                                                                                             add_batch):
    """Exactness with a top-k covering every key cannot tell k from k - 1, or a window one key short: checked against
    the keys the mode attends by definition, a k far below the keys outside the window (a review's finding)."""
    lm, pre, full = prefilled
    settings = dataclasses.replace(SETTINGS, window=Window(*window), topk=topk, add_batch=add_batch)
    run = run_mode(lm, pre, Mode("flat", IndexPlan("flat")), settings, STEPS, keep_logits=True)
    ref = _masked_reference(lm, pre, STEPS, _topk_keys(settings, len(pre.ids)))
    for a, b in zip(run.logits, ref):
        assert _rel(a, b) < 1e-4
    assert max(_rel(a, b) for a, b in zip(run.logits, full.logits)) > 1e-3  # not full attention


def test_train_query_subsample_is_even_and_keeps_the_last():
    from anns_lab.decode.builds import subsample

    q = np.arange(2 * 10 * 3, dtype=np.float32).reshape(2, 10, 3)
    sub = subsample(q, 4)
    assert sub.shape == (2, 4, 3) and np.array_equal(sub[:, -1], q[:, -1]) and np.array_equal(sub[:, 0], q[:, 0])
    assert subsample(q, 0) is q and subsample(q, 20) is q


@pytest.mark.parametrize("group", ["head", "group", "strided"])
def test_training_lists_on_the_device_give_the_same_graphs(prefilled, group):
    """decode's training lists computed where the prefill's keys are (device_lists: torch on the model's device)
    build the same roargraph indexes as the lists the build computes itself, and decode the same tokens; with one
    graph per KV head (``--train-group``) too, the lists then being those of the group's training queries."""
    import dataclasses

    lm, pre, _ = prefilled
    plan = Mode("roargraph", IndexPlan("roargraph"))
    runs = [run_mode(lm, pre, plan, dataclasses.replace(SETTINGS, lists_on_device=on, train_group=group), STEPS)
            for on in (False, True)]
    assert runs[0].tokens == runs[1].tokens
    for layer, store in runs[0].stores.items():
        for a, b in zip(store.indexes, runs[1].stores[layer].indexes):
            for x, y in zip(a.graph_arrays()[1:], b.graph_arrays()[1:]):
                assert np.array_equal(x, y)


def test_training_lists_on_the_device_give_the_same_ngfix_graphs(prefilled, monkeypatch):
    """The other index that takes the training lists (plugins/ngfix) builds the same graphs from the device's lists
    (and then computes none itself)."""
    import dataclasses

    if "ngfix" not in registry.available():
        pytest.skip("the ngfix plugin is not installed (make test installs it)")
    import anns_lab_ngfix

    own_lists = []
    exact = anns_lab_ngfix.topk_ip
    monkeypatch.setattr(anns_lab_ngfix, "topk_ip", lambda *a: own_lists.append(1) or exact(*a))
    lm, pre, _ = prefilled
    plan = Mode("ngfix", IndexPlan("ngfix"))
    runs, calls = [], []
    for on in (False, True):
        runs.append(run_mode(lm, pre, plan, dataclasses.replace(SETTINGS, lists_on_device=on), STEPS))
        calls.append(len(own_lists))
    assert calls[0] > 0 and calls[1] == calls[0]  # with the device's lists the builds computed none
    assert runs[0].tokens == runs[1].tokens
    for layer, store in runs[0].stores.items():
        for a, b in zip(store.indexes, runs[1].stores[layer].indexes):
            assert np.array_equal(a.nbrs, b.nbrs) and np.array_equal(a.degree, b.degree)


def test_builds_during_the_prefill_give_the_same_indexes_and_tokens(prefilled):
    """Index builds started as the prefill's last chunk passes each long-range layer (builds.EarlyBuilds) make the
    same graphs, logits and tokens as builds after the prefill, and the hidden part is a part of the build."""
    lm, pre, full = prefilled
    modes = [Mode("roargraph", IndexPlan("roargraph")), Mode("flat", IndexPlan("flat"))]
    early = prefill(lm, pre.ids, SETTINGS, capture_queries=True, build_modes=[Mode("full"), *modes])
    assert early.early is not None and set(early.early.ready_at) == set(lm.long_range_layers)
    # every layer was complete, and its builds queued, before the prefill ended (the last chunk still running)
    assert max(early.early.ready_at.values()) <= early.early.prefill_end
    assert torch.equal(early.logits, pre.logits)
    early.early.wait()
    for mode in modes:
        a = run_mode(lm, early, mode, SETTINGS, STEPS, keep_logits=True)
        b = run_mode(lm, pre, mode, SETTINGS, STEPS, keep_logits=True)
        assert a.tokens == b.tokens and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
        assert 0.0 <= a.build_hidden_s <= a.build_s and b.build_hidden_s == 0.0
        for layer, store in a.stores.items():
            for x, y in zip(store.indexes, b.stores[layer].indexes):
                if mode.name == "roargraph":
                    assert all(np.array_equal(u, v) for u, v in zip(x.graph_arrays(), y.graph_arrays()))
        assert not early.early.has(mode.name)  # handed over once


@pytest.mark.parametrize("during", [True, False])
def test_each_index_mode_builds_during_a_prefill_of_its_own(prefilled, monkeypatch, during):
    """With builds during the prefill, ``full`` and ``window`` decode from a prefill that nothing else shares the CPU
    with, and each index mode from its own, overlapped by its builds only; their TTFT takes that prefill's time. With
    builds after it, the index modes share one, and ``full`` and ``window`` still have one that keeps no queries (before,
    every mode shared it and ``full``'s TTFT carried the capture). Every prefill computes the same cache, so each mode
    decodes as it would from one shared prefill."""
    from anns_lab.decode import runner

    lm, pre, _ = prefilled
    settings = dataclasses.replace(SETTINGS, build_during_prefill=during)
    modes = [Mode("full"), Mode("roargraph", IndexPlan("roargraph")), Mode("window"), Mode("flat", IndexPlan("flat"))]
    seen = []

    def spy(*args, **kwargs):
        out = prefill(*args, **kwargs)
        seen.append((out, sorted(out.early.jobs) if out.early is not None else None))
        return out

    monkeypatch.setattr(runner, "prefill", spy)
    res = runner.run_sample(lm, modes, settings, pre.ids, STEPS, set())
    assert list(res["runs"]) == [m.name for m in modes]  # the modes' order, whatever order they ran in
    if during:
        assert [jobs for _, jobs in seen] == [None, ["roargraph"], ["flat"]]
        owner = {"full": 0, "window": 0, "roargraph": 1, "flat": 2}
    else:
        assert [jobs for _, jobs in seen] == [None, None]
        owner = {"full": 0, "window": 0, "roargraph": 1, "flat": 1}
        assert not seen[0][0].queries and seen[1][0].queries  # full's kept nothing, the index modes' their queries
    for name, run in res["runs"].items():
        assert run.prefill_s == seen[owner[name]][0].seconds
        shared = run_mode(lm, pre, next(m for m in modes if m.name == name), SETTINGS, STEPS)
        assert run.tokens == shared.tokens, name
    assert all(torch.equal(out.logits, pre.logits) for out, _ in seen)


def test_cpu_bytes_per_key_counts_the_store_and_each_index_once(prefilled):
    """The table's CPU B/key: keys and values held, plus each distinct index's own arrays (flat: faiss's copy
    of the keys it indexed, at the capacity its adds grew it to; roargraph: its graphs, the keys read from the store
    not counted again)."""
    from anns_lab.decode.engine import summarize

    lm, pre, _ = prefilled
    runs = {name: run_mode(lm, pre, Mode(name, IndexPlan(name)), SETTINGS, STEPS) for name in ("flat", "roargraph")}
    store = runs["flat"].stores[lm.long_range_layers[0]]
    G, d = store.keys.shape[0], store.keys.shape[2]
    flats = list({id(ix): ix for ix in store.indexes}.values())  # one per KV head
    assert len(flats) == G and all(ix.n_keys == store.n_indexed for ix in flats)
    assert all(ix.n_keys <= ix.nbytes // (4 * d) < 2 * ix.n_keys for ix in flats)  # faiss's vector, grown by adds
    assert store.cpu_bytes() == 4 * G * d * 2 * store.n_rows + sum(ix.nbytes for ix in flats)
    for run in runs.values():
        assert run.cpu_keys == sum(s.n_rows for s in run.stores.values())
        assert summarize(run)["cpu_bytes_per_key"] == run.cpu_bytes / run.cpu_keys
    rg = runs["roargraph"].stores[lm.long_range_layers[0]]
    graphs = sum(ix.nbytes - ix.n_keys * ix.dim * 4 for ix in rg.indexes)  # one index per query head
    assert rg.cpu_bytes() == 4 * G * d * 2 * rg.n_rows + graphs


def test_a_gqa_groups_double_sparsity_indexes_share_one_transposed_copy_counted_once(prefilled):
    """double-sparsity is an index per query head (its channels are the head's), each reading rows of the KV head's
    keys transposed: one table per KV head in the store, grown by the adds (the first index of a group to add grows
    it), counted once in the CPU bytes; each was a copy of its own, four per KV head on Gemma-3 (BENCHMARKS "Adds that
    copy only the new keys")."""
    lm, pre, full = prefilled
    run = run_mode(lm, pre, Mode("double-sparsity", IndexPlan("double-sparsity", {}, thorough("double-sparsity"))),
                   SETTINGS, STEPS, keep_logits=True)
    assert run.tokens == full.tokens
    for store in run.stores.values():
        G, d, per = store.keys.shape[0], store.keys.shape[2], store.n_heads // store.keys.shape[0]
        tables = [store.indexes[h]._by_dim for h in range(store.n_heads)]
        assert len({id(t) for t in tables}) == G and all(tables[h] is tables[per * (h // per)] for h in range(store.n_heads))
        assert store.indexes[0].n_keys == store.n_indexed > PROMPT - SETTINGS.window.size  # the adds ran
        for g in range(G):
            np.testing.assert_array_equal(tables[per * g].table[:, :store.n_indexed], store.keys[g, :store.n_indexed].T)
        orders = sum(ix._order.nbytes for ix in store.indexes)
        assert store.cpu_bytes() == 4 * G * d * 2 * store.n_rows + sum(t.buf.nbytes for t in tables[::per]) + orders


def test_device_lists_are_the_exact_top_keys():
    from anns_lab.decode.device_lists import train_topk
    from anns_lab.indexes.topk import topk_ip

    rng = np.random.default_rng(0)
    keys = rng.standard_normal((2, 300, 16)).astype(np.float32)
    queries = rng.standard_normal((4, 50, 16)).astype(np.float32)
    got = train_topk(queries, torch.from_numpy(keys), 20, group=2)
    assert got.shape == (4, 50, 20) and got.dtype == np.int32
    for h in range(4):
        assert np.array_equal(got[h], topk_ip(queries[h], keys[h // 2], 20))


def test_copy_hints_reach_each_search_as_the_store_rows_of_their_positions(prefilled, monkeypatch):
    """A teacher that copies the prompt from position 10 on: at step i (input ids[10 + i] at position PROMPT + i) the
    token to copy next is at position 11 + i, so the rows given to each layer's search name it as row 11 + i − sink,
    whose stored key is that position's key in the prefill cache; no hint names the current token or a row outside
    [0, n_rows); --copy-hints 0 gives none, and so does an index that takes none (flat)."""
    from anns_lab.decode.placement import LayerStore

    lm, pre, _ = prefilled
    teacher = pre.ids[10:10 + STEPS]
    seen = []
    side = LayerStore.side

    def spy(self, q, scaling, hints=None):
        seen.append((self, None if hints is None else hints.copy()))
        return side(self, q, scaling, hints)

    monkeypatch.setattr(LayerStore, "side", spy)
    sink = SETTINGS.window.sink
    plan = IndexPlan("roargraph", {}, thorough("roargraph"))
    run = run_mode(lm, pre, Mode("roargraph", plan), SETTINGS, 0, teacher=teacher)
    per_step = len(run.stores)
    assert len(seen) == per_step * STEPS
    for i in range(STEPS):
        for store, rows in seen[i * per_step:(i + 1) * per_step]:
            assert rows is not None and 11 + i - sink in rows.tolist(), (i, rows)
            assert (rows >= 0).all() and (rows + sink < len(pre.ids) + i).all()
            r = 11 + i - sink
            want = pre.cache.layers[store.layer].keys[0, :, sink + r].to("cpu", torch.float32).numpy()
            np.testing.assert_allclose(store.keys[:, r], want, rtol=1e-6, atol=1e-6)
    seen.clear()
    run_mode(lm, pre, Mode("roargraph", plan), dataclasses.replace(SETTINGS, copy_hints=0), 0, teacher=teacher[:2])
    assert seen and all(rows is None for _, rows in seen)
    seen.clear()  # an index that takes no hints: none computed (their cost is not in its step times)
    run_mode(lm, pre, Mode("flat", IndexPlan("flat")), SETTINGS, 0, teacher=teacher[:2])
    assert seen and all(rows is None for _, rows in seen)


def test_the_set_up_before_the_first_step_is_in_the_time_to_first_token(prefilled, monkeypatch):
    """Before: the time from an index mode's builds ending to its first step (the cache cut to the window, one
    registry lookup per layer: 0.1-0.4 s at 2K on 2 cores) was in no column, TTFT included; `full`'s cache copy too.
    Here the cut is made 0.3 s slower: the first step's time, and so the time to first token, must carry it."""
    from anns_lab.decode import engine

    lm, pre, _ = prefilled
    real = engine.window_cache

    def slow(*args, **kwargs):
        time.sleep(0.3)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "window_cache", slow)
    run = run_mode(lm, pre, Mode("flat", IndexPlan("flat", {}, {})), SETTINGS, STEPS)
    s = engine.summarize(run)
    assert run.setup_s >= 0.3 and s["first_step_s"] == pytest.approx(run.setup_s + run.step_s[0])
    assert run.step_s[0] < s["first_step_s"] - 0.29  # the per-token means keep the step alone


@pytest.mark.parametrize("mode", ["flat", "window"])
def test_each_step_timer_starts_after_the_device_is_synchronized(prefilled, monkeypatch, mode):
    """On an accelerator a timer started with kernels still queued counts them: the insert timer (its copy to the CPU
    waits for the step's earlier layers) and the window side's (its attention waits for this layer's projections)
    carried work that `full`'s timer, started after a sync, leaves to "other". A CPU run logs the order instead:
    entering either section, the device is synchronized before the clock is first read."""
    from anns_lab.decode import attention

    lm, pre, _ = prefilled
    events = []
    monkeypatch.setattr(attention, "sync", lambda device: events.append("sync"))
    clock = time.perf_counter
    monkeypatch.setattr(attention.time, "perf_counter", lambda: events.append("clock") or clock())
    for section in ("evicted", "_retrieval_step"):
        method = getattr(attention.Retrieval, section)

        def logged(self, *args, _method=method, _section=section):
            if self.phase == "decode":
                events.append(_section)
            return _method(self, *args)

        monkeypatch.setattr(attention.Retrieval, section, logged)
    plan = IndexPlan(mode, {}, thorough(mode)) if mode != "window" else None
    run_mode(lm, pre, Mode(mode, plan), SETTINGS, STEPS)
    entered = [i for i, e in enumerate(events) if e in ("evicted", "_retrieval_step")]
    assert entered and (mode == "window" or "evicted" in events)
    for i in entered:
        first_clock = events.index("clock", i)
        assert "sync" in events[i:first_clock], (events[i], events[i:first_clock + 1])
