"""Post-RoPE vectors moved to other positions: the training queries of an attention-aware index placed where it serves.

RoPE turns each frequency pair of a query at position p by p × ω. The same query asked at position t is the
post-RoPE vector turned once more by (t − p) × ω, so a prefill query can be moved to any position without the
model. The prefill queries as captured each sit at their own position, and their top keys lean towards the keys
near them (the high frequencies' local pattern). A decode query's neighbourhood is the static window, which the
index never holds. The same queries moved to the positions the index will serve (the decode steps) rank the
keys as those steps will. A graph trained on them scans 0.62x the keys at recall@100 0.95 on SmolLM2 at 8K
(BENCHMARKS "Query-aware graphs"). Each query gets one position drawn uniformly from the serving range: one fixed
position would fit the steps near it only.

Layout: the rotate-half pairs (x[i], x[i + r/2]) of the first r = 2·len(ω) dimensions, as in transformers'
``apply_rotary_pos_emb`` of Llama, Qwen, Gemma, Phi (other layouts are refused: :data:`OTHER_LAYOUTS`). The
frequencies come from the model's config, per layer type where it has several (Gemma-3: global and sliding layers),
scaled as the model scales them (linear, llama3, yarn: transformers' ``ROPE_INIT_FUNCTIONS``); a layer that skips
RoPE (``no_rope_layers``) has nothing to move. Only the angles are used: yarn's attention factor scales q·k, not the rotation.
dynamic NTK and longrope are refused: the model recomputes their frequencies from the longest position each forward
sees, so a query past the original length was turned by frequencies the config does not give.
"""

from __future__ import annotations

import numpy as np

from anns_lab.errors import AnnsLabError, DumpError

PLACES = ("serving", "own", "mix")
# Rotary layouts other than rotate-half pairs of the first dims (transformers' modeling code): interleaved pairs
# (x[2i], x[2i + 1]) in Cohere, GLM, GPT-J and Llama-4; the rotated dims after the unrotated ones in DeepSeek-V2/V3 (MLA).
OTHER_LAYOUTS = ("cohere", "cohere2", "glm", "glm4", "gptj", "llama4", "llama4_text", "deepseek_v2", "deepseek_v3")
SEQUENCE_DEPENDENT = ("dynamic", "longrope")  # ω follows the forward's sequence length (transformers' dynamic_rope_update)
DEFAULT = "serving"  # "own": each training query at its own prefill position, as captured
HELP = ("Where the attention-aware indexes' training (prefill) queries sit: 'serving' moves each, by RoPE, to a "
        "position drawn from those the index serves (the decode steps); 'own' keeps its prefill position; 'mix' "
        "moves a random half and keeps the other half where it was.")


def head_dim(cfg) -> int:
    """The attention heads' dimension of a transformers config: its ``head_dim``, else hidden size / heads."""
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def kv_heads(cfg) -> int:
    """The key/value heads of a transformers config: ``num_key_value_heads``, else one per query head (GPT-NeoX,
    GPT-J and Persimmon configs name none: multi-head attention)."""
    return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)


def check_place(place: str) -> str:
    """``place`` if it is one of :data:`PLACES`, else one clear error naming them."""
    if place not in PLACES:
        raise AnnsLabError(f"unknown training-query positions {place!r}; choose one of {', '.join(PLACES)}")
    return place


def inv_freq(config, layer: int) -> np.ndarray | None:
    """RoPE's angular frequencies ω (float64, one per rotated pair) of ``layer`` of a transformers config, or
    None when the config has no RoPE parameters or the layer skips RoPE (nothing to move)."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    params = getattr(cfg, "rope_parameters", None)
    no_rope = getattr(cfg, "no_rope_layers", None)  # SmolLM3, Llama-4: 0 marks a layer that skips RoPE
    if not params or (no_rope and not no_rope[layer]):
        return None
    if getattr(cfg, "model_type", None) in OTHER_LAYOUTS:
        raise DumpError(f"{cfg.model_type} turns its queries in another rotary layout than the rotate-half pairs these "
                        "moves assume: use the training queries' own positions (--train-positions own)")
    layer_types = getattr(cfg, "layer_types", None)
    layer_type = layer_types[layer] if layer_types and layer_types[layer] in params else None
    own = params[layer_type] if layer_type is not None else params
    kind = own.get("rope_type", "default")
    if kind in SEQUENCE_DEPENDENT:
        raise DumpError(f"RoPE type {kind!r} of layer {layer} turns each position by frequencies that follow the "
                        "sequence length, not the config: its queries cannot be moved exactly; use the training "
                        "queries' own positions (--train-positions own)")
    if kind == "default":
        dim = int(head_dim(cfg) * own.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None) or 1.0))
        with np.errstate(all="ignore"):  # a theta of 0 or below: refused by dump_inv_freq, by name
            return 1.0 / float(own["rope_theta"]) ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind not in ROPE_INIT_FUNCTIONS:
        raise DumpError(f"RoPE type {kind!r} of layer {layer} is not one transformers knows "
                        f"({', '.join(ROPE_INIT_FUNCTIONS)}): use the training queries' own positions "
                        "(--train-positions own)")
    return ROPE_INIT_FUNCTIONS[kind](cfg, layer_type=layer_type)[0].double().numpy()


def dump_inv_freq(manifest: dict, layer: int) -> np.ndarray | None:
    """:func:`inv_freq` of a dump's layer, from the model config its manifest records."""
    config = manifest.get("model", {}).get("config")
    if not isinstance(config, dict) or "model_type" not in config:
        raise DumpError("the dump's manifest records no model config, so its queries cannot be moved to other "
                        "positions: use the training queries' own positions (--train-positions own)")
    from transformers import AutoConfig

    fields = dict(config)
    try:
        freqs = inv_freq(AutoConfig.for_model(fields.pop("model_type"), **fields), layer)
    except DumpError:
        raise
    except Exception as err:  # noqa: BLE001 -- an edited config fails in transformers' validators, whatever they raise
        first = (str(err).strip().splitlines() or [""])[0][:160]
        raise DumpError(f"the model config the dump's manifest records cannot be read back ({type(err).__name__}: "
                        f"{first}), so its queries cannot be moved to other positions: use the training queries' "
                        "own positions (--train-positions own)") from None
    head_dim = manifest.get("head_dim")
    problem = None  # an edited config (rope_theta <= 0, another head_dim or rotary share) the validators let through
    if freqs is not None and not (np.all(np.isfinite(freqs)) and np.all(freqs >= 0)):  # 0: a pair left unturned
        problem = "not all finite and non-negative"
    elif freqs is not None and isinstance(head_dim, int) and 2 * len(freqs) > head_dim:
        problem = f"{2 * len(freqs)} rotated dimensions of the dump's {head_dim}"
    if problem:
        raise DumpError(f"the model config the dump's manifest records gives layer {layer} RoPE frequencies {problem}, "
                        "so its queries cannot be moved to other positions: use the training queries' own positions "
                        "(--train-positions own)")
    return freqs


def move(vectors: np.ndarray, positions: np.ndarray, targets: np.ndarray, freqs: np.ndarray | None) -> np.ndarray:
    """Post-RoPE ``vectors`` (..., n, d) at ``positions`` as they would be at ``targets`` (float32); unchanged
    without RoPE (``freqs`` None). Leading axes (a layer's heads) share the n angles, computed once; the float64 turn
    runs one (n, d) block at a time (a layer's at once held ~5x its queries: GBs per layer of a large model at 128K)."""
    vectors = np.asarray(vectors, dtype=np.float32)
    if freqs is None:
        return vectors
    half = len(freqs)
    angle = (np.asarray(targets, np.float64) - np.asarray(positions, np.float64))[:, None] * freqs[None, :]
    cos, sin = np.cos(angle), np.sin(angle)
    out = np.array(vectors, order="C")  # a copy: the unrotated dimensions stay as they are
    for block in out.reshape(-1, *out.shape[-2:]):  # views into out
        a, b = block[:, :half].astype(np.float64), block[:, half:2 * half].astype(np.float64)
        block[:, :half] = a * cos - b * sin
        block[:, half:2 * half] = b * cos + a * sin
    return out


def to_serving(vectors: np.ndarray, positions: np.ndarray, first: int, last: int, freqs: np.ndarray | None,
               seed: int = 0, rows: np.ndarray | None = None) -> np.ndarray:
    """``vectors`` (..., n, d) moved each to a position drawn uniformly from ``first..last`` (the positions an index
    serves; row i at the same one along the leading axes); ``rows``: only those rows of the result, the same as among
    all (the positions are drawn for every row)."""
    targets = np.random.default_rng(seed).integers(first, max(first, last) + 1, vectors.shape[-2])
    if rows is not None:  # only the rows asked for are turned (a build keeps a quarter of the prefill queries)
        vectors, positions, targets = vectors[..., rows, :], np.asarray(positions)[rows], targets[rows]
    return move(vectors, positions, targets, freqs)


def placed(vectors: np.ndarray, positions: np.ndarray, first: int, last: int, freqs: np.ndarray | None, place: str,
           seed: int = 0, rows: np.ndarray | None = None) -> np.ndarray:
    """Training queries ``vectors`` (..., n, d; at ``positions``) where ``place`` puts them (float32): ``own`` as they are,
    ``serving`` each moved into ``first..last`` (:func:`to_serving`), ``mix`` a random half moved, the rest kept;
    ``rows``: only those rows of the result, each placed as among all.

    Why ``mix``: queries at their own positions rank each key among its neighbours in the text, which gives every
    stretch of the context neighbourhoods in the graph; moved ones rank keys as the decode steps will. On a 128K
    needle prompt some heads lose half their recall at the decode queries with ``serving`` alone (BENCHMARKS)."""
    check_place(place)
    own = np.asarray(vectors if rows is None else vectors[..., rows, :], dtype=np.float32)
    if place == "own":
        return own
    moved = to_serving(vectors, positions, first, last, freqs, seed, rows)
    if place == "serving":
        return moved
    keep = np.random.default_rng(seed + 1).random(vectors.shape[-2]) < 0.5
    return np.where((keep if rows is None else keep[rows])[:, None], own, moved)
