"""``anns-lab dump``: chunked prefill and decode steps of a real model, captured into a dump folder.

The decode steps' tokens are the model's greedy choices (``--continuation greedy``, the default: what a decoder serves),
or the text's own next tokens after the prompt (``text``: teacher forcing; a small model's greedy continuation of a
long text tends to repeat a line of it, and the steps' queries then repeat too).

Work is resumable by layer: the token ids are saved first, each layer's Parquet file is recorded
in ``.staging/progress.json`` as soon as it is renamed into place, and a re-run with the same
settings (``--layers`` as the layers it selects, however spelled) keeps those files and captures
only the missing layers. With every token known in advance (a resume, a text continuation, or no decode steps) the
forward pass stops after the deepest missing layer.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from anns_lab import stops
from anns_lab.dumps import checkpoint, rope, store
from anns_lab.dumps.models import RopeScaling
from anns_lab.dumps.prompts import CONTINUATION_WORDS, CONTINUATIONS
from anns_lab.errors import DumpError, PromptError
from anns_lab.io import atomic_write_json, new_map, read_json, sole_writer
from anns_lab.version import __version__

STAGING = ".staging"
OURS = ("layer_*.parquet", store.TOKENS_FILE, store.MANIFEST)  # the files of a dump folder this tool writes
PROGRESS = "progress.json"
DONE_NAME = re.compile(rf"layer_\d{{3,}}\.parquet|{re.escape(store.TOKENS_FILE)}")  # the files a progress record lists
DTYPES = {name: np.dtype(name).type for name in store.VECTOR_DTYPES}


def parse_layers(spec: str, n_layers: int | None, default: list[int]) -> list[int]:
    """``all``, ``default``, ``2,15,28``, ``0:30:2`` (start:stop:step), ``3-7``, or a mix, → sorted layers.

    With ``n_layers`` None (the model not known yet) only the syntax is checked and [] is returned.
    """
    return parse_selection(spec, n_layers, default)


LAYER_FORMS = "all, default, a list (2,15,28) or a range (0:30:2)"


def parse_selection(spec: str, n: int | None, default: list[int], option: str = "--layers", noun: str = "layers",
                    owner: str = "the model", forms: str = LAYER_FORMS) -> list[int]:
    """:func:`parse_layers`' syntax for any numbered parts (``option``, e.g. ``--heads``: ``noun`` 0..n-1 of ``owner``;
    ``forms``: the spellings an unreadable one is told)."""
    spec = spec.strip().lower()
    if spec == "all":
        return list(range(n or 0))
    if spec == "default":
        return list(default)
    out: set[int] = set()
    try:
        for part in (p.strip() for p in spec.split(",")):
            if not part:
                raise DumpError(f"{option} {spec!r} has an empty item between commas; use {forms}")
            if ":" in part:
                bounds = [int(x) if x else None for x in part.split(":")]
                if len(bounds) > 3 or (len(bounds) == 3 and bounds[2] == 0):
                    raise ValueError(part)
                # Python's slices clip 0:100 and read -1: from the end; a range says what it selects
                outside = [b for b in bounds[:2] if b is not None and n is not None and not 0 <= b <= n]
                if outside:
                    raise DumpError(f"{option} {spec!r}: the bound {outside[0]} lies outside 0..{n} ({owner} "
                                    f"has {noun} 0..{n - 1})")
                out.update(range(n or 0)[slice(*bounds)])
            elif "-" in part[1:]:
                a, b = (int(x) for x in part.split("-", 1))
                # checked before the range is built: 0-100000000000 would fill memory first
                outside = [x for x in (a, b) if n is not None and not 0 <= x < n]
                if outside:
                    raise DumpError(f"{option} {spec!r}: {outside[0]} lies outside {owner}'s {noun} 0..{n - 1}")
                if n is not None:
                    out.update(range(a, b + 1))
            else:
                out.add(int(part))
    except ValueError:
        raise DumpError(f"cannot read {option} {spec!r}; use {forms}") from None
    if n is None:
        return []
    bad = sorted(x for x in out if not 0 <= x < n)
    if bad or not out:
        raise DumpError(f"{option} {spec!r} selects {bad or 'no ' + noun}; {owner} has {noun} 0..{n - 1}")
    return sorted(out)


class DumpInterrupted(KeyboardInterrupt):
    """Ctrl-C during a dump, saying what was kept and how to resume (still a KeyboardInterrupt to callers)."""


class StagingSink:
    """Captured rows go straight into ``.npy`` memory maps, one per layer and tensor, so memory stays bounded.
    ``staged`` (layer -> its softmax scaling): layers a finished forward left complete in the maps (the progress record
    says so), opened as they are: a resume killed while writing the layer files need not run the model again.
    ``resume``: the maps hold the rows before a prefill checkpoint's (checkpoint.py), opened to take the rest."""

    def __init__(self, folder: Path, layers: list[int], n_rows: int, n_heads: int, n_kv: int, d: int, dtype,
                 staged: dict[int, float] | None = None, resume: bool = False):
        from numpy.lib.format import open_memmap

        self.layers = set(layers)
        self.row = 0
        self.scaling: dict[int, float] = dict(staged or {})
        shapes = {"q": (n_heads, n_rows, d), "k": (n_kv, n_rows, d), "v": (n_kv, n_rows, d)}
        self.folder = folder
        self.arrays = {
            layer: {name: checkpoint.reopen_map(self.path(layer, name)) if resume else
                    open_memmap(self.path(layer, name), mode="r") if staged else
                    new_map(self.path(layer, name), dtype, shape)
                    for name, shape in shapes.items()}
            for layer in layers
        }
        if (staged or resume) and any(a.shape != shapes[name] or a.dtype != np.dtype(dtype)
                                      for maps in self.arrays.values() for name, a in maps.items()):
            raise ValueError("the staged maps are not this capture's")

    def path(self, layer: int, name: str) -> Path:
        """The map of ``layer``'s ``name`` (q, k or v)."""
        return self.folder / f"layer_{layer:03d}.{name}.npy"

    def maps(self):
        """Each map with its file, as (path, array)."""
        return [(self.path(layer, name), a) for layer in sorted(self.arrays) for name, a in self.arrays[layer].items()]

    def digests(self) -> dict[str, str]:
        """Each map's sha256 by file name: a resume writes the layer files from maps that are still these."""
        return {path.name: store.sha256_file(path) for path, _ in self.maps()}

    def flush(self) -> None:
        """Every map's rows on disk (a kill after this keeps them: the progress record may then say so)."""
        for maps in self.arrays.values():
            for a in maps.values():
                a.flush()

    def record(self, layer, q, k, v, scaling) -> None:
        if layer not in self.layers:
            return
        import torch

        t = q.shape[1]
        for name, x in (("q", q), ("k", k), ("v", v)):
            if not torch.isfinite(x).all():
                raise DumpError(f"the model produced non-finite {name.upper()} values at layer {layer}, "
                                f"positions {self.row}..{self.row + t - 1}")
            dst = self.arrays[layer][name]
            if (x.shape[0], x.shape[-1]) != (dst.shape[0], dst.shape[-1]):
                # the config's heads or head dimension are not the attention's (multi-head latent attention's
                # compressed cache, a KV-head count the weights do not have): the dump would not be the model's
                raise DumpError(f"layer {layer}'s attention gives {name.upper()} as {x.shape[0]} heads of {x.shape[-1]} "
                                f"dimensions where the model's config says {dst.shape[0]} of {dst.shape[-1]}: its "
                                "attention is not the multi-head softmax attention the lab records; such models are "
                                "not supported")
            with np.errstate(over="ignore"):  # an overflow is reported below, as one error
                dst[:, self.row:self.row + t] = x.detach().to("cpu", dtype=torch.float32).numpy()
            # A finite value past float16's range is stored as inf: the dump would no longer be the model's.
            if dst.dtype == np.float16 and np.isinf(dst[:, self.row:self.row + t]).any():
                raise DumpError(f"the model produced {name.upper()} values beyond float16's range (±65504) at layer "
                                f"{layer}, positions {self.row}..{self.row + t - 1}; pass --dtype float32")
        self.scaling[layer] = float(scaling)


@dataclass
class DumpResult:
    """What ``run_dump`` did: the dump, how long it took, and whether it was already complete."""

    dump: store.Dump
    seconds: float
    already_complete: bool = False
    resumed_layers: int = 0

    def summary(self) -> str:
        m = self.dump.manifest
        n = m["n_tokens"]
        total = sum(e["bytes"] for e in m["files"].values())
        head = "already complete" if self.already_complete else f"done in {self.seconds:.1f} s"
        lines = [
            f"dump {self.dump.path} ({head})",
            f"  model     {m['model']['name']}  ({m['model']['source']})",
            f"  prompt    {m['prompt']['source']}  {json.dumps({k: v for k, v in m['prompt']['params'].items() if k != 'corpus_sha256'})}",
            f"  tokens    prefill {n['prefill']}, decode {n['decode']}"
            + (f" ({CONTINUATION_WORDS[self.dump.continuation]})" if n["decode"] else ""),
            f"  layers    {len(m['layers'])}: {compact_layers(m['layers'])}",
            f"  heads     {m['n_heads']} query / {m['n_kv_heads']} KV, head_dim {m['head_dim']}, {m['dtype']}",
            f"  bytes     {total / 2**20:.1f} MiB in {len(m['files'])} files",
        ]
        if "timing" in m and not self.already_complete:
            t = m["timing"]
            ran = (f"prefill {t['prefill_s']:.1f} s ({n['prefill'] / max(t['prefill_s'], 1e-9):.0f} tok/s), decode "
                   f"{t['decode_s']:.1f} s" if t.get("prefill_s") is not None else "no forward pass (resumed from a complete capture)")
            lines.append(f"  time      load {t['load_s']:.1f} s, {ran}, write {t['write_s']:.1f} s")
        if self.resumed_layers:
            lines.append(f"  resumed   {self.resumed_layers} layer files kept from the interrupted run")
        if (at := m.get("timing", {}).get("prefill_resumed_at")) and not self.already_complete:
            lines.append(f"  resumed   the prefill at token {at}, from the interrupted run's checkpoint (its seconds "
                         "before it counted)")
        return "\n".join(lines)


def compact_layers(layers: list[int]) -> str:
    if len(layers) > 2 and layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}..{layers[-1]}"
    return ",".join(map(str, layers))


def default_out(model: str, source: str, tokens: int | None) -> Path:
    from anns_lab.dumps.models import canonical_name

    return Path("dumps") / f"{canonical_name(model)}-{source}-{tokens if tokens is not None else 'all'}"


UNSET = {"continuation": "greedy"}  # settings recorded only when not their default: a missing one reads as the default


def _settings_diff(a: dict, b: dict) -> str:
    keys = sorted(set(a) | set(b))
    return ", ".join(f"{k}: {a.get(k, UNSET.get(k))!r} there vs {b.get(k, UNSET.get(k))!r} now" for k in keys
                     if a.get(k) != b.get(k))


def _layer_resolver(facts: tuple[int, list[int]] | None) -> Callable[[str], list[int] | None]:
    """A ``--layers`` spelling → the layers it selects of this model (``facts``: its layer count and long-range layers,
    :func:`models.config_layers`); None where the config is not at hand or the spelling selects no valid layer."""

    def resolve(spec: str) -> list[int] | None:
        if facts is None:
            return None
        try:
            return parse_layers(spec, *facts) or None
        except DumpError:  # a spelling an older version took (0:100) selects nothing now, so it matches nothing
            return None

    return resolve


def _as_now(old, new: dict, was: list[int] | None, resolve: Callable[[str], list[int] | None]):
    """``old`` settings with their layers spelled as in ``new`` when both select the same layers of this model
    (``1:3``, ``1-2``, ``1,2``; ``all`` and the full list), else as they are: a spelling is no other setting.
    ``was``: the layers ``old`` selected where they were recorded (a finished dump's manifest)."""
    if not isinstance(old, dict) or not isinstance(old.get("layers"), str) or old["layers"] == new["layers"]:
        return old
    now = resolve(new["layers"])
    if now is not None and now == (was if was is not None else resolve(old["layers"])):
        return old | {"layers": new["layers"]}
    return old


def _progress_ok(progress) -> bool:
    """Whether a progress file read as JSON has the shapes a resume reads (JSON of other shapes is as corrupt as none:
    read on, it ended in a raw TypeError or a manifest refused later)."""
    if not isinstance(progress, dict) or not isinstance(progress.get("done"), dict):
        return False
    ids, scaling, staged = progress.get("token_ids"), progress.get("scaling", {}), progress.get("staged", {})
    # names a resume deletes when their file is damaged: only a dump's own (a "../x" deleted a file outside the folder)
    return (all(DONE_NAME.fullmatch(name) for name in progress["done"])
            and all(isinstance(rec, dict) for rec in progress["done"].values())
            and (ids is None or (isinstance(ids, list) and all(type(i) is int for i in ids)))
            and all(isinstance(s, dict) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in s.values())
                    for s in (scaling, staged))
            and isinstance(progress.get("provenance", {}), dict)
            and isinstance(sums := progress.get("staged_sha256", {}), dict)
            and all(isinstance(v, str) for v in sums.values()))


def _prepare_folder(out: Path, settings: dict, overwrite: bool,
                    resolve: Callable[[str], list[int] | None]) -> tuple[dict | None, bool]:
    """Decide what to do with ``out``: (None, False) when the dump is already complete, else the progress to resume or
    start and whether the folder's dump must be replaced (``--overwrite``): that waits until the new capture's checks
    have passed (model, context, memory), so a refused command never costs the dump that was there. Settings compare
    with the layers as the list they select (``resolve``), however spelled."""
    progress_path = out / STAGING / PROGRESS
    fresh = {"settings": settings, "done": {}}
    if (out / store.MANIFEST).is_file():
        if _foreign_manifest(out):  # someone else's manifest.json: not ours to replace, even with --overwrite
            raise DumpError(f"{out} exists and is not a dump folder ({store.MANIFEST} is not an anns-lab dump's); "
                            "refusing to write into it (choose another --out)")
        try:
            m = store.read_manifest(out)
            old, was = m["settings"], m["layers"]
        except (DumpError, KeyError) as err:
            if not overwrite:  # its settings unknown: "other settings, every one None there" would mislead
                raise DumpError(f"{out} holds a dump whose manifest cannot be read ({err}); pass --overwrite to replace "
                                "it, or choose another --out") from None
            old = was = None
        old = _as_now(old, settings, was, resolve)
        if old == settings and not overwrite:
            return None, False
        if not overwrite:
            raise DumpError(f"{out} already holds a dump made with other settings ({_settings_diff(old or {}, settings)}); "
                            "pass --overwrite to replace it, or choose another --out")
        return fresh, True
    if progress_path.is_file():
        try:
            progress = read_json(progress_path)
            if not _progress_ok(progress):  # not an assert: `python -O` would resume from it
                raise ValueError("not a progress record")
        except (OSError, ValueError):
            if not overwrite:
                raise DumpError(f"{progress_path} is corrupt; pass --overwrite to discard the unfinished dump") from None
            progress = {}
        old = _as_now(progress.get("settings"), settings, None, resolve)
        if old == settings and not overwrite:
            return progress, False
        if old == settings and not progress.get("done"):  # nothing captured, nothing for --overwrite to discard (as
            return fresh, False  # where this command made the folder and prepares it again under its lock)
        if not overwrite:
            raise DumpError(f"{out} holds an unfinished dump with other settings ({_settings_diff(old or {}, settings)}); "
                            "pass --overwrite to discard it, or choose another --out")
        return fresh, True
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DumpError(f"{out} exists and is not a dump folder; refusing to write into it (choose another --out)")
    _start(out, fresh)
    return fresh, False


def _foreign_manifest(out: Path) -> bool:
    """Whether ``out``'s manifest is JSON of something else than a dump (one that is not JSON at all may be ours, cut
    short: ``--overwrite`` may replace that)."""
    try:
        manifest = read_json(out / store.MANIFEST)
    except (OSError, ValueError):
        return False
    return not (isinstance(manifest, dict) and manifest.get("format") == store.FORMAT)


def _start(out: Path, state: dict) -> None:
    """Make the staging folder and write the first progress record."""
    try:
        (out / STAGING).mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / STAGING / PROGRESS, state)
    except OSError as err:
        raise DumpError(f"cannot write the dump into {out}: {err.strerror or err} ({err.filename or out}); "
                        "choose another --out") from None


def _clear(out: Path) -> None:
    # Only files this tool writes are removed (with the temp files of writes a kill cut short); anything else stays.
    for p in [f for pattern in OURS for f in out.glob(pattern)] + _temp_files(out):
        p.unlink(missing_ok=True)
    shutil.rmtree(out / STAGING, ignore_errors=True)


def _temp_files(out: Path) -> list[Path]:
    """The temp files (``io.atomic_path``'s) of this tool's files that a killed write left in ``out``."""
    return [f for pattern in OURS for f in out.glob(f".{pattern}.*.tmp")]


def run_dump(model: str = "smollm2", *, source: str = "text", prompt_path: str | None = None, tokens: int | None = 8192,
             decode_tokens: int = 64, layers: str = "default", dtype: str = "float16", chunk: int = 2048, seed: int = 0,
             out: str | Path | None = None, overwrite: bool = False, allow_extrapolation: bool = False,
             rope_scaling: RopeScaling | str | None = None, allow_download: bool = False, device: str = "cpu",
             progress: bool = True, continuation: str = "greedy", checkpoint_every: float = checkpoint.EVERY) -> DumpResult:
    """Capture a dump (see module doc); returns the opened dump and timings. ``checkpoint_every``: seconds between
    the prefill's checkpoints (checkpoint.py; 0: none)."""
    from anns_lab.dumps.models import config_layers, resolve
    from anns_lab.dumps.prompts import read_prompt_file

    if dtype not in DTYPES:
        raise DumpError(f"--dtype must be one of {', '.join(DTYPES)}")
    if chunk < 1:
        raise DumpError(f"--chunk must be at least 1, got {chunk}")
    if decode_tokens < 0:
        raise DumpError(f"--decode-tokens must be 0 or more, got {decode_tokens}")
    if not checkpoint_every >= 0:  # a NaN too
        raise DumpError(f"--checkpoint-every must be 0 (none) or more seconds, got {checkpoint_every}")
    # Everything checkable without the weights fails here, before the model load and before any folder is touched.
    if tokens is not None and tokens < 1:
        raise PromptError("--tokens must be a positive number of tokens")
    if seed < 0:
        raise DumpError(f"--seed must be a non-negative integer, got {seed}")
    _check_continuation(continuation, source, prompt_path, tokens)
    if isinstance(rope_scaling, str):
        try:
            rope_scaling = RopeScaling.parse(rope_scaling)
        except ValueError as err:
            raise DumpError(f"--rope-scaling {err}") from None
    if prompt_path:
        read_prompt_file(prompt_path)
    src = "file" if prompt_path else source
    out = Path(out) if out is not None else default_out(model, src, tokens)
    store.check_utf8(out, "--out")
    canon, where, _ = resolve(model)  # fails fast on unknown models
    facts = config_layers(where, canon)  # the config alone, before any weight loads (None: not at hand yet)
    parse_layers(layers, facts[0] if facts else None, [])  # the syntax always; the range when the config is at hand
    settings = {"model": canon, "model_source": str(where), "source": src, "prompt_path": str(Path(prompt_path).resolve()) if prompt_path else None,
                "tokens": tokens, "decode_tokens": decode_tokens, "layers": layers, "dtype": dtype, "chunk": chunk, "seed": seed}
    if rope_scaling is not None:  # only when set: dumps made before the option resume as they are
        settings["rope_scaling"] = str(rope_scaling)
    if continuation != "greedy":  # likewise: a greedy dump made before the option resumes as it is
        settings["continuation"] = continuation
    t_start = time.perf_counter()
    existed = out.exists()
    with sole_writer(out, lambda: _prepare_folder(out, settings, overwrite, _layer_resolver(facts))) as prepared:
        state, replace = prepared
        if state is None:
            _check_inputs_unchanged(out, prompt_path, where)
            return DumpResult(store.open_dump(out), time.perf_counter() - t_start, already_complete=True)
        began = not replace

        def begin() -> None:  # the new capture's checks passed: only now does --overwrite replace the folder's dump
            nonlocal began
            began = True  # from here on the folder's old dump is being replaced: a failure must not say it is as it was
            if replace:
                _clear(out)
                _start(out, state)

        try:
            return _capture(out, settings, state, begin, model, prompt_path, allow_extrapolation, allow_download, device,
                            progress, t_start, rope_scaling, checkpoint_every)
        except BaseException as err:
            at = state.get(checkpoint.PREFILL_AT)
            at = at if checkpoint.well_formed(at) else None
            if began and not state["done"] and at is None:  # nothing captured: leave the folder as it was, so a corrected command runs
                shutil.rmtree(out / STAGING, ignore_errors=True)
                if not existed and out.is_dir() and not any(out.iterdir()):
                    out.rmdir()
            if isinstance(err, KeyboardInterrupt):
                recorded = _recorded(out, state) if began else {}
                layers_kept = sum(name != store.TOKENS_FILE for name in recorded)
                raise DumpInterrupted(
                    f"interrupted before the capture began: {out} is as it was" if not began else
                    f"interrupted: {layers_kept} layer file(s) kept in {out}; run the same command again to resume"
                    if recorded else
                    f"interrupted: the prefill's first {at['row']} tokens kept in {out / STAGING} (its checkpoint); "
                    "run the same command again to resume from there" if at is not None else
                    "interrupted before any file was written: nothing was kept") from None
            raise


def _capture(out, settings, state, begin, model_name, prompt_path, allow_extrapolation, allow_download, device, progress,
             t_start, rope_scaling, checkpoint_every):
    import torch
    from tqdm.auto import tqdm

    from anns_lab.dumps.capture import StopForward, capturing
    from anns_lab.dumps.models import forward_tokens, load_model, weights_fingerprint

    staging = out / STAGING
    lm = load_model(model_name, device=device, allow_download=allow_download, rope_scaling=rope_scaling)
    cfg = lm.config
    _check_provenance(out, state, {"weights": weights_fingerprint(lm.model), "device": torch.device(device).type})
    t_loaded = time.perf_counter()
    layers = parse_layers(settings["layers"], cfg.num_hidden_layers, lm.long_range_layers)
    if not layers:  # `default` on a model whose every layer slides: a dump of no layers is no dump
        raise DumpError(f"--layers {settings['layers']} selects {lm.name}'s full-attention layers, and it has "
                        "no full-attention layers; name the layers to capture (e.g. --layers all)")
    _check_layer_types(lm, layers)
    n_decode = settings["decode_tokens"]
    if settings["tokens"] is not None:  # before the prompt is built: 10^9 tokens' ids alone were more than memory held
        _check_fits(lm, settings["tokens"], n_decode, settings["chunk"], allow_extrapolation)
    prompt, forced = _prompt_and_continuation(settings, lm.tokenizer, n_decode, prompt_path)
    n_prefill = len(prompt.ids)
    _check_fits(lm, n_prefill, n_decode, settings["chunk"], allow_extrapolation)  # a whole --prompt file's, now known
    n_heads, n_kv = cfg.num_attention_heads, rope.kv_heads(cfg)
    d = rope.head_dim(cfg)
    saved_ids = state.get("token_ids")
    if saved_ids is not None and (saved_ids[:n_prefill] != prompt.ids or forced and saved_ids[n_prefill:] != forced):
        raise DumpError(f"{out}: the saved tokens differ from the prompt built now (tokenizer or corpus changed); pass --overwrite")
    begin()
    done = state["done"]
    _drop_damaged(out, state)
    if checkpoint.PREFILL_AT in state and not checkpoint.well_formed(state[checkpoint.PREFILL_AT]):
        _forget_checkpoint(out, state, "its progress record is damaged")
    missing = [layer for layer in layers if store.layer_file(layer) not in done]
    sink = _staged_sink(staging, state, missing, n_prefill + n_decode, n_heads, n_kv, d, DTYPES[settings["dtype"]])
    if sink is not None:
        tqdm.write(f"{out}: the capture of {len(missing)} layer(s) is complete in {STAGING}: writing their files")
        missing_forward = []
    else:
        if state.pop("staged", None) is not None:  # the maps are written anew: a kill in this forward must not find
            atomic_write_json(staging / PROGRESS, state)  # them listed as complete (zeros past its last chunk)
        sink = None
        if state.get(checkpoint.PREFILL_AT) is not None:  # the maps hold the rows before the checkpoint
            try:
                sink = StagingSink(staging, missing, n_prefill + n_decode, n_heads, n_kv, d, DTYPES[settings["dtype"]],
                                   resume=True)
            except (OSError, ValueError):
                _forget_checkpoint(out, state, "its capture's maps are gone or another capture's")
        if sink is None:  # the maps begin anew: no checkpoint on disk may outlive them (the record said nothing of an
            # old one after --overwrite of the same settings, and a kill before the first new one resumed from it onto
            # zeroed maps)
            state.pop(checkpoint.PREFILL_AT, None)
            atomic_write_json(staging / PROGRESS, state)
            checkpoint.delete(staging)
            try:
                sink = StagingSink(staging, missing, n_prefill + n_decode, n_heads, n_kv, d, DTYPES[settings["dtype"]])
            except OSError as err:  # a full disk: the maps' space is reserved as they are made (io.new_map)
                row = (n_heads + 2 * n_kv) * d * np.dtype(DTYPES[settings["dtype"]]).itemsize
                need = (n_prefill + n_decode) * row * len(missing) / 2**20
                size = f"{need / 1024:,.2f} GiB" if need >= 1024 else f"{need:,.1f} MiB"
                raise DumpError(f"cannot stage the capture in {staging}: {err.strerror or err}; its maps take {size} "
                                "(fewer --layers or --tokens take less): free space there, or choose another --out") from None
        missing_forward = missing

    # Logits are needed only to choose decode tokens; once every token is known the forward can stop early.
    all_known = saved_ids is not None or n_decode == 0 or bool(forced)
    stop_after = max(missing) if (all_known and missing) else None
    ids = list(saved_ids) if saved_ids is not None else list(prompt.ids) + forced
    model = lm.model
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    t_prefill = t_decode = c_prefill = 0.0 if missing_forward else None  # no forward: no prefill time to report
    checkpoints, first = None, 0
    if missing_forward:
        checkpoints, first, cache = _checkpoints(out, state, lambda: DynamicCache(config=model.config), ids[:n_prefill],
                                                 checkpoint_every, sink, stop_after, model)
    # Two bars: a decode step costs about as much as a whole prefill chunk, so one bar over all tokens would
    # sit at 99% for the whole of the decode steps.
    quiet = not progress or not missing_forward
    bar = tqdm(total=n_prefill, initial=first, unit="tok", desc=f"dump {lm.name} prefill", disable=quiet)

    def forward(start: int, end: int):
        sink.row = start
        try:
            return forward_tokens(lm, cache, ids, start, end)
        except StopForward:
            return None

    if missing_forward:
        try:
            with torch.inference_mode(), capturing(model, sink, stop_after=stop_after):
                at = state.get(checkpoint.PREFILL_AT) or {}  # the seconds of the prefill before its checkpoint count too
                t0, c0 = time.perf_counter() - at.get("seconds", 0.0), time.process_time() - at.get("cpu_seconds", 0.0)
                logits = None
                for start in range(first, n_prefill, settings["chunk"]):
                    end = min(start + settings["chunk"], n_prefill)
                    logits = forward(start, end)
                    bar.update(end - start)
                    if checkpoints is not None and checkpoints.due(end):
                        checkpoints.save(cache, end, state, lambda: atomic_write_json(staging / PROGRESS, state), sink,
                                         time.perf_counter() - t0, time.process_time() - c0, ids[:n_prefill])
                    stops.check()  # a Ctrl-C a finalizer swallowed (stops.py): stop between chunks
                t_prefill, c_prefill = time.perf_counter() - t0, time.process_time() - c0
                bar.close()
                bar = tqdm(total=n_decode, unit="step", desc=f"dump {lm.name} decode", disable=quiet or not n_decode)
                t0 = time.perf_counter()
                for step in range(n_decode):
                    pos = n_prefill + step
                    if pos >= len(ids):
                        ids.append(int(logits[0, -1].argmax()))
                    logits = forward(pos, pos + 1)
                    bar.update(1)
                    stops.check()
                t_decode = time.perf_counter() - t0
        finally:
            bar.close()  # an interrupt's message then starts on a line of its own
        sink.flush()  # the layers captured: recorded below, a kill while their files are written keeps them
        state["staged"] = {str(layer): sink.scaling[layer] for layer in missing}
        state["staged_sha256"] = sink.digests()  # a map damaged since is captured again, not sealed into the dump
        state.pop(checkpoint.PREFILL_AT, None)  # the staged maps supersede it: its files go once that is recorded
    if store.TOKENS_FILE not in done:
        state["token_ids"] = ids
        done[store.TOKENS_FILE] = store.write_table(out / store.TOKENS_FILE, store.tokens_table(ids, n_prefill))
    atomic_write_json(staging / PROGRESS, state)
    checkpoint.delete(staging)

    t_write = _write_layers(out, missing, sink, state, progress)

    manifest = _manifest(settings, lm, prompt, layers, n_prefill, n_decode, n_heads, n_kv, d, state, {
        "load_s": t_loaded - t_start, "prefill_s": t_prefill, "prefill_cpu_s": c_prefill, "decode_s": t_decode, "write_s": t_write,
        "total_s": time.perf_counter() - t_start} | ({"prefill_resumed_at": first} if first else {}))
    atomic_write_json(out / store.MANIFEST, store.sealed(manifest))
    shutil.rmtree(staging, ignore_errors=True)
    kept = len(layers) - len(missing)
    return DumpResult(store.open_dump(out), time.perf_counter() - t_start, resumed_layers=kept)


def _check_continuation(continuation: str, source: str, prompt_path: str | None, tokens: int | None) -> None:
    """Refuse a ``--continuation`` the prompt cannot give, before any model loads: ``text`` reads the decode steps'
    tokens from the text after the prompt, which a synthetic task (its prompt ends at its question) and a prompt of no
    set length (a whole file: nothing after it) do not have."""
    if continuation not in CONTINUATIONS:
        raise DumpError(f"--continuation must be one of {', '.join(CONTINUATIONS)}, got {continuation!r}")
    if continuation != "text":
        return
    if prompt_path is None and source != "text":
        raise DumpError(f"--continuation text takes the decode steps' tokens from the text after the prompt, and the "
                        f"{source} task's prompt has none: use --source text or --prompt FILE, or --continuation greedy")
    if tokens is None:  # a file's prompt is then all of it; the built-in text has no length to stop at
        raise DumpError("--continuation text takes the decode steps' tokens from the text after the prompt, and without "
                        "--tokens the prompt is the whole text: give --tokens (fewer than the text's)")


def _prompt_and_continuation(settings: dict, tokenizer, n_decode: int, prompt_path: str | None):
    """The prompt, and with ``--continuation text`` the ``n_decode`` tokens of its text right after it (the decode
    steps', teacher-forced); [] for greedy steps (chosen as the model goes)."""
    from anns_lab.dumps.prompts import build_prompt

    source, tokens, seed = settings["source"], settings["tokens"], settings["seed"]
    if settings.get("continuation", "greedy") != "text" or n_decode == 0:
        return build_prompt(source, tokenizer, tokens, seed, prompt_path), []
    try:
        whole = build_prompt(source, tokenizer, tokens + n_decode, seed, prompt_path)
    except PromptError as err:
        raise PromptError(f"{err} (--continuation text: --tokens {tokens} of prompt and --decode-tokens {n_decode} of "
                          "the text after it)") from None
    return dataclasses.replace(whole, ids=whole.ids[:tokens]), whole.ids[tokens:]


def _staged_sink(staging: Path, state: dict, missing: list[int], n_rows: int, n_heads: int, n_kv: int, d: int,
                 dtype) -> StagingSink | None:
    """A sink over the maps of ``missing`` when the progress record holds them all as staged by a finished forward (the
    tokens written with it) and the maps are there with this capture's shapes; else None: the model runs again."""
    staged = state.get("staged", {})
    if not missing or store.TOKENS_FILE not in state["done"] or not all(str(layer) in staged for layer in missing):
        return None
    try:
        sink = StagingSink(staging, missing, n_rows, n_heads, n_kv, d, dtype, {layer: staged[str(layer)] for layer in missing})
    except (OSError, ValueError):  # gone, cut short or another capture's: captured again
        return None
    sums = state.get("staged_sha256")  # a record from before they were kept: trusted as then
    if isinstance(sums, dict) and (changed := sorted(n for n, h in sink.digests().items() if sums.get(n) != h)):
        from tqdm.auto import tqdm

        tqdm.write(f"{staging / changed[0]} changed since the capture staged it: capturing again")
        return None
    return sink


def _drop_damaged(out: Path, state: dict) -> None:
    """Forget and delete every file the progress record holds as finished (a resume's) that is gone or no longer the
    one written (size, sha256), so it is captured again instead of sealed into a dump every reader then refuses; and
    delete the temp files of writes a kill cut short."""
    for name, rec in list(state["done"].items()):
        f = out / name
        if not f.is_file() or f.stat().st_size != rec.get("bytes") or store.sha256_file(f) != rec.get("sha256"):
            from tqdm.auto import tqdm

            tqdm.write(f"{f} is missing or damaged since it was written: capturing it again")
            del state["done"][name]
            f.unlink(missing_ok=True)  # a failure before it is written again leaves no stray file behind
    for f in _temp_files(out):
        f.unlink(missing_ok=True)


def _check_inputs_unchanged(out: Path, prompt_path: str | None, where: Path | str) -> None:
    """Refuse to hand back a finished dump as "already complete" when its prompt file, its model's files or its
    tokenizer's changed since it was made (same settings, other inputs: the dump would silently be the old ones')."""
    from anns_lab.dumps.models import files_stamp, tokenizer_stamp
    from anns_lab.dumps.prompts import read_prompt_file

    m = store.read_manifest(out)
    was = m["prompt"]["params"].get("sha256")
    if prompt_path and was is not None:
        now = hashlib.sha256(read_prompt_file(prompt_path)[1]).hexdigest()
        if now != was:
            raise DumpError(f"{out} was dumped from another version of {prompt_path} (sha256 {was[:12]}… there, "
                            f"{now[:12]}… now); pass --overwrite to dump the file as it is now, or choose another --out")
    was = m["model"].get("files_stamp")  # dumps made before it was recorded: not checked
    if was is not None and (now := files_stamp(where)) != was:
        raise DumpError(f"{out} was dumped from other model files than those at {where} now (config.json or weight files "
                        "changed); pass --overwrite to dump the model as it is now, or choose another --out")
    was = m["model"].get("tokenizer_stamp")  # dumps made before it was recorded: not checked
    if was is not None and (now := tokenizer_stamp(where)) != was:
        raise DumpError(f"{out} was dumped with other tokenizer files than those at {where} now (tokenizer.json, "
                        "tokenizer_config.json, vocabulary or merges changed: the prompt's token ids may differ); pass "
                        "--overwrite to dump with the tokenizer as it is now, or choose another --out")


def _check_layer_types(lm, layers: list[int]) -> None:
    """Refuse layers whose attention is neither full nor a sliding window (Llama-4's ``chunked_attention``: each query
    sees only its own chunk): the manifest, the sweep's ground truth and the decoder know those two kinds only, so
    such a layer would be read as attending to every key before it."""
    types = getattr(lm.config, "layer_types", None) or []
    other = [(i, types[i]) for i in layers if i < len(types) and types[i] not in ("full_attention", "sliding_attention")]
    if other:
        kinds = ", ".join(sorted({t for _, t in other}))
        raise DumpError(f"layers {compact_layers([i for i, _ in other])} of {lm.name} use {kinds}, which the lab does "
                        "not model (it knows full and sliding-window attention); dump the full-attention layers "
                        f"(--layers default: {compact_layers(lm.long_range_layers) or 'none'}) or name others")


def _checkpoints(out: Path, state: dict, new_cache, prompt: list[int], every: float, sink, stop_after: int | None, model):
    """The prefill's checkpoints (None: off, or the model's cache cannot be restored exactly), the row its forward
    starts at (the checkpoint's, or 0) and the cache it starts with (``new_cache()``, the checkpoint's restored; the
    forward runs the layers up to ``stop_after``, or all)."""
    from tqdm.auto import tqdm

    at, cache = state.get(checkpoint.PREFILL_AT), new_cache()
    if (why := checkpoint.unsupported(cache)) is not None:
        if at is not None:
            _forget_checkpoint(out, state, why)
        if every > 0 and len(prompt) > 1:
            tqdm.write(f"{out}: no prefill checkpoints ({why}): an interrupted prefill starts again")
        return None, 0, cache
    checkpoints = checkpoint.PrefillCheckpoints(out / STAGING, len(prompt), every)
    if at is None:
        return checkpoints, 0, cache
    try:
        checkpoints.restore(cache, at, prompt, sink, len(cache.layers) if stop_after is None else stop_after + 1,
                            checkpoint.dtype_name(model.dtype), model.device)
    except Exception as err:  # noqa: BLE001 - whatever is wrong with it: a checkpoint only saves time, start again
        _forget_checkpoint(out, state, str(err) or type(err).__name__)
        return checkpoint.PrefillCheckpoints(out / STAGING, len(prompt), every), 0, new_cache()
    tqdm.write(f"{out}: resuming the prefill at token {at['row']} of {len(prompt)} from its checkpoint")
    return checkpoints, at["row"], cache


def _forget_checkpoint(out: Path, state: dict, why: str) -> None:
    """Drop an unusable prefill checkpoint (said, recorded, its files deleted): the prefill starts again."""
    from tqdm.auto import tqdm

    tqdm.write(f"{out}: the prefill's checkpoint cannot be used ({why}): the prefill starts again")
    state.pop(checkpoint.PREFILL_AT, None)
    atomic_write_json(out / STAGING / PROGRESS, state)
    checkpoint.delete(out / STAGING)


def _check_provenance(out: Path, state: dict, now: dict[str, str]) -> None:
    """Refuse to resume an unfinished dump with other weights (the same path or model name holding another checkpoint)
    or on another kind of device than its finished layers came from: the dump would mix two models' or two numerics'
    Q/K/V without a trace. A first run, or a resume of a dump begun before these were recorded, records them."""
    before = state.get("provenance", {})
    resumes = state["done"] or state.get(checkpoint.PREFILL_AT) is not None
    if resumes and before.get("weights") not in (None, now["weights"]):
        raise DumpError(f"{out} holds an unfinished dump captured from other weights than those of this model now "
                        f"(weights fingerprint {before['weights']} there vs {now['weights']} now): the files at its "
                        "path changed; restore them, or pass --overwrite to start the dump again")
    if resumes and before.get("device") not in (None, now["device"]):
        raise DumpError(f"{out} holds an unfinished dump captured on {before['device']}; resume it with --device "
                        f"{before['device']} (finishing it on {now['device']} would mix two devices' numerics), "
                        "or pass --overwrite to start again")
    state["provenance"] = now


def _check_fits(lm, n_prefill: int, n_decode: int, chunk: int, allow_extrapolation: bool) -> None:
    """Refuse a prompt beyond the model's context (unless extrapolation is allowed) or a prefill that would not fit in memory."""
    from anns_lab.dumps.memory import check_prefill

    # The prompt must fit the trained context; a few decode steps past its end are the usual long-context setting.
    if lm.context and n_prefill > lm.context and not allow_extrapolation:
        raise PromptError(f"{n_prefill} prompt tokens exceed {lm.name}'s context of {lm.context} tokens; "
                          "use fewer --tokens, or pass --allow-extrapolation to go beyond it")
    check_prefill(lm.config, n_prefill + n_decode, chunk, f"a dump of {n_prefill} + {n_decode} tokens of {lm.name}",
                  "--decode-tokens" if n_decode > n_prefill else "--tokens")


def _recorded(out: Path, state: dict) -> dict:
    """The files the progress record on disk lists as done (what a resume keeps): ``state``'s may hold one more, a
    stop having landed between a layer's file and its record (an interrupt fuzz: "12 kept", then 11 resumed)."""
    try:
        done = read_json(out / STAGING / PROGRESS).get("done")
    except (OSError, ValueError, AttributeError):
        return state["done"]
    return done if isinstance(done, dict) else state["done"]


def _write_layers(out, missing: list[int], sink, state: dict, progress: bool) -> float:
    """Write each captured layer's Parquet file (recording it in the progress file), drop its staging maps; seconds taken."""
    from tqdm.auto import tqdm

    staging, done, t0 = out / STAGING, state["done"], time.perf_counter()
    for layer in tqdm(missing, desc="write layers", unit="layer", disable=not progress or len(missing) < 2):
        arrays = sink.arrays[layer]
        name = store.layer_file(layer)
        done[name] = store.write_table(out / name, store.layer_table(arrays["q"], arrays["k"], arrays["v"]))
        state.setdefault("scaling", {})[str(layer)] = sink.scaling[layer]
        state.get("staged", {}).pop(str(layer), None)  # its maps are deleted next
        atomic_write_json(staging / PROGRESS, state)
        del sink.arrays[layer]
        for part in "qkv":
            sink.path(layer, part).unlink(missing_ok=True)
            state.get("staged_sha256", {}).pop(sink.path(layer, part).name, None)
        stops.check()  # this layer's file is recorded: a lost Ctrl-C (a Parquet writer's finalizer) stops here
    return time.perf_counter() - t0


def _manifest(settings, lm, prompt, layers, n_prefill, n_decode, n_heads, n_kv, d, state, timing) -> dict:
    from anns_lab.dumps.models import files_stamp, tokenizer_stamp

    cfg = lm.config
    group = n_heads // n_kv
    types = getattr(cfg, "layer_types", None)
    window = getattr(cfg, "sliding_window", None)
    tok = lm.tokenizer
    files = {store.TOKENS_FILE: state["done"][store.TOKENS_FILE]}
    files |= {store.layer_file(layer): state["done"][store.layer_file(layer)] for layer in layers}
    return {
        "format": store.FORMAT,
        "format_version": store.FORMAT_VERSION,
        "tool": f"anns-lab {__version__}",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": settings,
        "model": {"name": lm.name, "source": lm.source, "architecture": type(lm.model).__name__,
                  "weights_fingerprint": state["provenance"]["weights"], "device": state["provenance"]["device"],
                  "files_stamp": files_stamp(settings["model_source"]),
                  "tokenizer_stamp": tokenizer_stamp(settings["model_source"]),
                  "context": lm.context, "long_range_layers": lm.long_range_layers,
                  "rope_scaling": settings.get("rope_scaling"), "config": json.loads(cfg.to_json_string(use_diff=False))},
        "tokenizer": {"class": type(tok).__name__, "vocab_size": len(tok), "bos_token_id": tok.bos_token_id,
                      "eos_token_id": tok.eos_token_id},
        "prompt": {"source": prompt.source, "params": prompt.params},
        "continuation": settings.get("continuation", "greedy"),
        "dtype": settings["dtype"],
        "n_tokens": {"prefill": n_prefill, "decode": n_decode},
        "phases": {"prefill": [0, n_prefill], "decode": [n_prefill, n_prefill + n_decode]},
        "layers": layers,
        "n_layers": cfg.num_hidden_layers,
        "n_heads": n_heads,
        "n_kv_heads": n_kv,
        "head_dim": d,
        "gqa": [h // group for h in range(n_heads)],
        "scaling": {str(layer): state["scaling"][str(layer)] for layer in layers},
        # Without layer_types a config's sliding_window holds for every layer (Mistral, Phi-3, Starcoder2).
        "sliding_window": {str(layer): (window if types is None or types[layer] == "sliding_attention" else None)
                           for layer in layers},
        "rope": getattr(cfg, "rope_parameters", None),
        "files": files,
        "timing": timing,
    }
