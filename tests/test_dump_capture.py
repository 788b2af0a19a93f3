"""The dump holds exactly what the model's attention sees: attention recomputed from it equals the model's own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from anns_lab.dumps.models import load_model
from anns_lab.dumps.store import open_dump
from anns_lab.dumps.run import StagingSink, run_dump
from anns_lab.errors import DumpError


def _output_projection(model, layer: int):
    """A layer's attention output projection: Llama-like models' ``o_proj``, GPT-NeoX's ``dense``."""
    if hasattr(model, "gpt_neox"):
        return model.gpt_neox.layers[layer].attention.dense
    return model.model.layers[layer].self_attn.o_proj


def model_attention_outputs(model_name: str, ids: list[int], layers: list[int]) -> dict[int, np.ndarray]:
    """The input of each layer's output projection (the attention output per head), from one plain forward pass."""
    lm = load_model(model_name)
    seen: dict[int, np.ndarray] = {}
    hooks = []
    for layer in layers:
        hooks.append(_output_projection(lm.model, layer).register_forward_pre_hook(
            lambda mod, args, layer=layer: seen.__setitem__(layer, args[0][0].double().numpy())))
    with torch.inference_mode():
        lm.model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return seen


def attention_from_dump(dump, layer: int, window: int | None) -> np.ndarray:
    """Causal softmax(q·kᵀ·scaling)·v of every position and query head, from the dump alone, in float64."""
    n, d = len(dump.positions()), dump.head_dim
    out = np.zeros((n, dump.n_heads * d))
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    allowed = (j <= i) if window is None else (j <= i) & (i - j < window)
    for h in range(dump.n_heads):
        q = dump.queries(layer, h, phase="all").astype(np.float64)
        g = dump.kv_head_of(h)
        k = dump.keys(layer, g).astype(np.float64)
        v = dump.values(layer, g).astype(np.float64)
        s = np.where(allowed, q @ k.T * dump.scaling(layer), -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, h * d:(h + 1) * d] = (p / p.sum(axis=1, keepdims=True)) @ v
    return out


def check_against_model(model: str, tmp_path, layers: list[int], tokens: int, chunk: int, decode: int) -> None:
    result = run_dump(model, tokens=tokens, decode_tokens=decode, layers=",".join(map(str, layers)), dtype="float32",
                      chunk=chunk, out=tmp_path / "dump", progress=False)
    dump = result.dump
    assert dump.layers == layers
    assert len(dump.positions("prefill")) == tokens and len(dump.positions("decode")) == decode
    cfg = load_model(model).config  # the model's own scale: Gemma's query_pre_attn_scalar (the tiny one's is not d)
    for layer in layers:
        assert dump.scaling(layer) == pytest.approx(getattr(cfg, "query_pre_attn_scalar", dump.head_dim) ** -0.5)
    ref = model_attention_outputs(model, dump.tokens().tolist(), layers)
    for layer in layers:
        window = dump.manifest["sliding_window"][str(layer)]
        ours = attention_from_dump(dump, layer, window)
        rel = np.linalg.norm(ours - ref[layer]) / np.linalg.norm(ref[layer])
        assert rel < 1e-4, f"layer {layer}: relative error {rel:.2e}"
        assert np.abs(ours - ref[layer]).max() < 1e-4 * np.abs(ref[layer]).max()


def test_tiny_llama_gqa_chunked_prefill_and_decode(tiny_llama, tmp_path):
    check_against_model(str(tiny_llama), tmp_path, [0, 1, 2, 3], tokens=45, chunk=16, decode=5)


def test_a_text_continuation_is_the_texts_next_tokens_and_steps_as_a_prefill_of_them(tiny_llama, tmp_path):
    # Teacher forcing: the decode steps take the text's own tokens after the prompt, so a dump of 30 + 6 of them is,
    # row for row, a 36-token prefill of the same text (which the model's own attention check covers).
    result = run_dump(str(tiny_llama), tokens=30, decode_tokens=6, continuation="text", layers="0,3", dtype="float32",
                      chunk=8, out=tmp_path / "forced", progress=False)
    assert "decode 6 (the text's own next tokens, teacher-forced)" in result.summary()
    forced = result.dump
    whole = run_dump(str(tiny_llama), tokens=36, decode_tokens=0, layers="0,3", dtype="float32", chunk=8,
                     out=tmp_path / "whole", progress=False).dump
    greedy = run_dump(str(tiny_llama), tokens=30, decode_tokens=6, layers="0", dtype="float32", chunk=8,
                      out=tmp_path / "greedy", progress=False).dump
    assert forced.manifest["continuation"] == "text" and greedy.manifest["continuation"] == "greedy"
    assert len(forced.positions("decode")) == 6
    np.testing.assert_array_equal(forced.tokens(), whole.tokens())
    np.testing.assert_array_equal(forced.tokens("prefill"), greedy.tokens("prefill"))
    assert not np.array_equal(forced.tokens("decode"), greedy.tokens("decode"))  # a random model's argmax is not the text
    with pytest.raises(DumpError, match="continuation: 'greedy' there vs 'text' now"):  # not resumed as the other kind
        run_dump(str(tiny_llama), tokens=30, decode_tokens=6, continuation="text", layers="0", dtype="float32", chunk=8,
                 out=tmp_path / "greedy", progress=False)
    for layer in (0, 3):
        for h in range(forced.n_heads):
            np.testing.assert_allclose(forced.queries(layer, h, "all"), whole.queries(layer, h, "all"), atol=1e-5)
        for g in range(forced.n_kv_heads):
            np.testing.assert_allclose(forced.keys(layer, g), whole.keys(layer, g), atol=1e-5)
            np.testing.assert_allclose(forced.values(layer, g), whole.values(layer, g), atol=1e-5)


def test_a_text_continuation_past_the_texts_end_names_both_counts(tiny_llama, tmp_path):
    from anns_lab.errors import PromptError

    text = tmp_path / "p.txt"
    text.write_text(open(__file__).read()[:400])
    n = len(load_model(str(tiny_llama)).tokenizer(text.read_text())["input_ids"])
    with pytest.raises(PromptError, match=r"--tokens 20 of prompt and --decode-tokens .* of the text after it"):
        run_dump(str(tiny_llama), prompt_path=text, tokens=20, decode_tokens=n, continuation="text",
                 out=tmp_path / "d", progress=False)
    assert not (tmp_path / "d").exists()
    dump = run_dump(str(tiny_llama), prompt_path=text, tokens=20, decode_tokens=4, continuation="text", layers="0",
                    out=tmp_path / "d", progress=False).dump
    assert len(dump.tokens()) == 24


def test_tiny_gemma3_sliding_and_global_layers(tiny_gemma3, tmp_path):
    check_against_model(str(tiny_gemma3), tmp_path, [0, 1, 2, 3], tokens=40, chunk=12, decode=4)


def test_tiny_mistral_sliding_window_on_every_layer(tmp_path):
    from conftest import make_tiny_model

    # Its config has a sliding_window but no layer_types: the manifest must still give each layer its window.
    model = make_tiny_model(tmp_path / "mistral", "mistral")
    check_against_model(str(model), tmp_path, [0, 1, 2, 3], tokens=40, chunk=12, decode=3)



def test_a_config_without_kv_heads_is_multi_head_attention(tmp_path):
    """GPT-NeoX's config names no num_key_value_heads (one KV head per query head), and its RoPE turns a quarter of
    each head: the dump had failed with an AttributeError; now it reproduces the model's attention."""
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    from conftest import _tiny_tokenizer

    torch.manual_seed(0)
    cfg = GPTNeoXConfig(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        rotary_pct=0.25, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    assert not hasattr(cfg, "num_key_value_heads")
    folder = tmp_path / "neox"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    _tiny_tokenizer(folder)
    check_against_model(str(folder), tmp_path, [0, 1], tokens=30, chunk=12, decode=3)
    assert open_dump(tmp_path / "dump").n_kv_heads == 4


def test_an_attention_of_other_heads_or_width_than_the_config_is_refused(tmp_path):
    """Where the attention's tensors are not the config's heads × head_dim (multi-head latent attention's 16-wide
    queries where its config's head_dim is the RoPE part's 8; a KV-head count the weights lack), the capture refuses
    the layer rather than broadcast or fail inside numpy."""
    sink = StagingSink(tmp_path, [0], n_rows=8, n_heads=4, n_kv=2, d=8, dtype=np.float32)
    with pytest.raises(DumpError, match="Q as 4 heads of 16 dimensions where the model's config says 4 of 8"):
        sink.record(0, torch.zeros(4, 8, 16), torch.zeros(2, 8, 8), torch.zeros(2, 8, 8), 0.25)
    with pytest.raises(DumpError, match="K as 1 heads of 8 dimensions where the model's config says 2 of 8"):
        sink.record(0, torch.zeros(4, 8, 8), torch.zeros(1, 8, 8), torch.zeros(2, 8, 8), 0.25)
    sink.record(0, torch.ones(4, 8, 8), torch.ones(2, 8, 8), torch.ones(2, 8, 8), 0.25)  # the config's shapes pass
    assert sink.arrays[0]["k"].sum() == 2 * 8 * 8


@pytest.mark.parametrize("config, says", [
    (dict(model_type="falcon", alibi=True), "ALiBi position biases"),
    (dict(model_type="jais", position_embedding_type="alibi"), "ALiBi position biases"),  # a remote-code config
    (dict(model_type="deepseek_v3", kv_lora_rank=512), "compressed latents .*kv_lora_rank=512"),
    (dict(model_type="diffllama"), "difference of two softmaxes"),
    (dict(model_type="gemma3n_text", num_kv_shared_layers=10), "last 10 layers .*num_kv_shared_layers=10"),
])
def test_attention_that_is_not_softmax_over_the_cached_keys_is_refused(config, says):
    """Each passed transformers' SDPA check and ran: Falcon's ALiBi dumped Q/K that do not give its attention (the
    bias is in the mask), DeepSeek-V3 decoded from its compressed cache as if it held keys (flat's top-1 0.44), and
    DiffLlama's dump kept half-values; refused by the config before any weight loads."""
    from transformers import PretrainedConfig

    from anns_lab.dumps.models import check_attention
    from anns_lab.errors import ModelNotAvailable

    cfg = PretrainedConfig(**config)
    with pytest.raises(ModelNotAvailable, match=f"model 'm' .*{says}.*not supported"):
        check_attention("m", cfg)
    check_attention("m", PretrainedConfig(model_type="llama", alibi=False, kv_lora_rank=None,
                                          num_kv_shared_layers=0))  # the usual passes


def test_a_config_with_per_layer_attention_shapes_is_refused_before_any_weight_loads():
    """Gemma-4's global layers are wider (``global_head_dim``) than its sliding ones: transformers then refuses to give
    one ``head_dim`` (a traceback from the dump's memory estimate before); the same config with one width passes."""
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    from anns_lab.dumps.models import check_attention
    from anns_lab.errors import ModelNotAvailable

    shapes = dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], head_dim=16)
    with pytest.raises(ModelNotAvailable, match="model 'g' sets head_dim per layer .*one value for all.*not supp"):
        check_attention("g", Gemma4TextConfig(**shapes, global_head_dim=32))
    check_attention("g", Gemma4TextConfig(**shapes, global_head_dim=16))


def test_chunked_attention_layers_are_refused_and_the_full_ones_dump(tmp_path):
    from conftest import make_tiny_model

    from anns_lab.dumps.run import run_dump
    from anns_lab.errors import DumpError

    model = make_tiny_model(tmp_path / "llama4", "llama4")  # chunked, chunked, chunked, full (without RoPE)
    with pytest.raises(DumpError, match=r"layers 0\.\.2 of .* chunked_attention.*--layers default: 3"):
        run_dump(str(model), tokens=30, decode_tokens=0, layers="all", out=tmp_path / "all", progress=False)
    assert not (tmp_path / "all").exists()
    check_against_model(str(model), tmp_path, [3], tokens=40, chunk=12, decode=3)


def test_a_model_whose_every_layer_slides_has_no_long_range_layer_and_decode_says_so(tmp_path):
    from click.testing import CliRunner
    from conftest import make_tiny_model

    from anns_lab.cli import main
    from anns_lab.dumps.models import load_model

    model = make_tiny_model(tmp_path / "mistral", "mistral")
    assert load_model(str(model)).long_range_layers == []  # every layer attends within its window of 8
    r = CliRunner().invoke(main, ["decode", "--model", str(model), "--prompt", "one two three", "--mode", "full,flat",
                                  "--max-new-tokens", "2"])
    assert r.exit_code != 0 and "no full-attention layer" in r.output and "Traceback" not in r.output
    import json
    import shutil

    wide = shutil.copytree(model, tmp_path / "wide")  # a window as long as the trained context never binds
    cfg = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps(cfg | {"sliding_window": cfg["max_position_embeddings"]}))
    assert load_model(str(wide)).long_range_layers == [0, 1, 2, 3]

def test_gqa_map_follows_model_grouping(tiny_llama, tmp_path):
    dump = run_dump(str(tiny_llama), tokens=20, decode_tokens=0, layers="1", out=tmp_path / "d", progress=False).dump
    assert [dump.kv_head_of(h) for h in range(dump.n_heads)] == [0, 0, 1, 1]
    assert dump.keys(1, 1).shape == (20, 16)


@pytest.mark.realmodel
def test_smollm2_capture_equals_model_attention(tmp_path):
    check_against_model("smollm2", tmp_path, [0, 15, 29], tokens=96, chunk=40, decode=4)


@pytest.mark.realmodel
def test_smollm2_fixture_dump_is_real_and_shaped(smollm2_dump):
    d = smollm2_dump
    assert (d.n_heads, d.n_kv_heads, d.head_dim) == (9, 3, 64)
    q = d.queries(15, 4, phase="decode")
    k = d.keys(15, d.kv_head_of(4), phase="prefill")
    assert q.shape == (16, 64) and k.shape == (2048, 64) and q.dtype == np.float32
    # Post-RoPE keys differ in direction across positions; the first token is an attention sink for most queries.
    top1 = np.argmax(q @ k.T, axis=1)
    assert np.isfinite(k).all() and len(set(top1.tolist())) >= 1


def test_gemma3_default_layers_are_the_global_ones(tiny_gemma3, tmp_path):
    dump = run_dump(str(tiny_gemma3), tokens=20, decode_tokens=1, out=tmp_path / "d", progress=False).dump
    assert dump.layers == [1, 3]  # layer_types: sliding, full, sliding, full
    assert dump.manifest["sliding_window"] == {"1": None, "3": None}


def test_default_layers_of_a_model_without_global_layers_is_one_error(tiny_gemma3, tmp_path):
    import json
    import shutil

    from anns_lab.errors import DumpError

    model = tmp_path / "all-sliding"
    shutil.copytree(tiny_gemma3, model)
    config = json.loads((model / "config.json").read_text())
    config["layer_types"] = ["sliding_attention"] * 4
    (model / "config.json").write_text(json.dumps(config))
    # It wrote a manifest of no layers (and no decode tokens), then refused its own dump as corrupt.
    with pytest.raises(DumpError, match="no full-attention layers"):
        run_dump(str(model), tokens=20, decode_tokens=1, out=tmp_path / "d", progress=False)
    assert not (tmp_path / "d").exists()
    assert run_dump(str(model), tokens=20, decode_tokens=1, layers="all", out=tmp_path / "d",
                    progress=False).dump.layers == [0, 1, 2, 3]


@pytest.mark.parametrize("extra, what", [({"s_aux": torch.zeros(4)}, "attention-sink logits"),
                                         ({"softcap": 30.0}, "soft-capping")])
def test_attention_terms_the_lab_does_not_model_are_refused_in_capture_and_decode(extra, what):
    from types import SimpleNamespace

    from anns_lab.decode.attention import Retrieval
    from anns_lab.dumps.capture import _capture_attention
    from anns_lab.errors import DecodeError, DumpError
    from anns_lab.window import Window

    module = SimpleNamespace(layer_idx=1, scaling=0.25)
    q = k = v = torch.zeros(1, 4, 3, 16)
    # Without the term both pass the call on to SDPA (the shapes are a plain attention call's).
    assert _capture_attention(module, q, k, v, None, scaling=0.25)[0].shape == (1, 3, 4, 16)
    with pytest.raises(DumpError, match=what):
        _capture_attention(module, q, k, v, None, scaling=0.25, **extra)
    retrieval = Retrieval([1], "full", Window(4, 16), capture_queries=False)
    for phase in ("prefill", "decode"):
        retrieval.phase = phase
        with pytest.raises(DecodeError, match=what):
            retrieval.attend(module, q[:, :, :1], k, v, None, scaling=0.25, **extra)


def test_sdpa_masks_are_additive_on_the_cpu_and_attend_as_the_boolean_ones():
    """SDPA's CPU kernels make a float mask of a boolean one on every call (chunks of 2048 over 8K keys: 64 MB mapped
    and page-faulted per layer); the capture and the decoder register masks built additive once per forward."""
    import torch.nn.functional as F
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    from anns_lab.dumps.models import attention_masks

    build = attention_masks("sdpa")
    chunk = dict(batch_size=1, q_length=5, kv_length=12, q_offset=7, device="cpu", allow_is_causal_skip=True)
    boolean = sdpa_mask(**chunk)
    additive = build(**chunk, dtype=torch.float32)
    assert boolean.dtype == torch.bool and additive.dtype == torch.float32
    assert torch.equal(additive == 0, boolean) and bool((additive[~boolean] == torch.finfo(torch.float32).min).all())
    q, k, v = torch.randn(3, 1, 2, 12, 8).unbind(0)
    q = q[:, :, 7:]
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, attn_mask=additive),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=boolean), rtol=0, atol=1e-6)
    first = dict(chunk, q_length=12, q_offset=0)
    assert sdpa_mask(**first) is None and build(**first, dtype=torch.float32) is None  # SDPA's own causal path
    assert attention_masks("eager") is ALL_MASK_ATTENTION_FUNCTIONS["eager"]
