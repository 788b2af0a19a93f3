"""Shared fixtures: tiny random models saved as local folders (fast), and one short real SmolLM2 dump."""

from __future__ import annotations

import faulthandler
import os
import shutil
import sys
from pathlib import Path

import pytest

# Tests never reach a hub; a missing model must fail at once.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Decode tests run the model on this device (e.g. ANNS_LAB_TEST_DEVICE=cuda on a GPU machine; CI has none).
TEST_DEVICE = os.environ.get("ANNS_LAB_TEST_DEVICE", "cpu")


@pytest.hookimpl(tryfirst=True)  # before pytest's faulthandler plugin, which then keeps it on after the session
def pytest_configure(config) -> None:
    """Refuse a Ray driver in the test process: each ``ray.init`` ... ``ray.shutdown`` leaves gRPC threads behind,
    and a process carrying many to its exit can die there (tests/ray_driver.py drives Ray from a subprocess).
    A pytest-xdist worker (``make test``) gets the faulthandler that ``python -X faulthandler`` gives the main
    process, so that a worker's crash, even at its exit, says where."""
    faulthandler.enable()
    try:
        import ray
    except ImportError:
        return

    def refuse(*args, **kwargs):
        raise RuntimeError("a test started a Ray driver in the test process: drive Ray from a subprocess "
                           "(tests/ray_driver.py, or the anns-lab command)")

    ray.init = refuse


@pytest.hookimpl(hookwrapper=True)
def pytest_sessionfinish(session):
    """Under pytest-xdist (``make test``), a worker that dies at its exit, after its last test, fails the run as one
    process's crash there does: xdist itself reports only a worker lost during a test. Its exit status is read from
    execnet's process handle once xdist has ended the workers."""
    dsession = session.config.pluginmanager.getplugin("dsession")
    group = getattr(getattr(dsession, "nodemanager", None), "group", None)
    workers = [(gw.id, gw._io.popen) for gw in list(group or []) if hasattr(getattr(gw, "_io", None), "popen")]
    yield
    died = [f"{name} (exit status {p.returncode})" for name, p in workers if p.returncode not in (0, None)]
    if died:
        print(f"\npytest-xdist worker(s) ended abnormally after their tests: {', '.join(died)}; the traceback above "
              "(faulthandler) says where", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _tiny_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from anns_lab.dumps.tasks import PASSKEY_FILLER

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = [PASSKEY_FILLER * 3, "The pass key is 12345. Remember it. What is the pass key?",
            "One of the special magic numbers for apple is: 1234567.", '{"a": "b"} Key: value 0123456789 - abcdef']
    tok.train_from_iterator(text, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(folder)


def make_tiny_model(folder: Path, arch: str, seed: int = 0, **config) -> Path:
    """A randomly initialised Llama (GQA 4 q / 2 kv), Mistral (sliding window everywhere), Llama-4 (chunked + global
    layers) or Gemma-3 (sliding + global layers) saved to ``folder``; ``config``: entries that replace the common ones
    (``head_dim=8``)."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

    torch.manual_seed(seed)
    common = dict(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2) | config
    if arch == "llama":
        cfg = LlamaConfig(**common, rope_theta=10000.0)
    elif arch == "llama4":  # chunked attention on three layers of four (layer_types), no RoPE on the fourth
        from transformers import Llama4TextConfig

        cfg = Llama4TextConfig(**common, attention_chunk_size=8, num_local_experts=2, intermediate_size_mlp=128)
    elif arch == "mistral":  # a sliding window on every layer, without layer_types
        from transformers import MistralConfig

        cfg = MistralConfig(**common, sliding_window=8)
    else:
        cfg = Gemma3TextConfig(**common, query_pre_attn_scalar=64, sliding_window=8,  # a scale of 1/8, not 1/sqrt(16)
                               layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])
    model = AutoModelForCausalLM.from_config(cfg)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    _tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-gemma3"), "gemma3")


@pytest.fixture
def broken_index(monkeypatch) -> str:
    """The name of a registered index ("broken": flat whose every build raises RuntimeError "no memory for its
    graph"), for the paths a plugin's failing build takes."""
    from anns_lab.indexes import registry

    flat = registry.get("flat")

    class Broken(flat):
        def _build(self, keys, train_queries=None):
            raise RuntimeError("no memory for its graph")

    real_get = registry.get
    monkeypatch.setattr(registry, "get", lambda name: Broken if name == "broken" else real_get(name))
    return "broken"


@pytest.fixture
def lost_ctrl_c():
    """A call that does what a Ctrl-C landing in a finalizer does (pyarrow's ParquetWriter.__del__, seen in CI): the
    handler records the stop and raises, and Python prints and drops the raise. The handlers are a command's
    (``stops.install``, as the CLI's) for the test, restored after it."""
    import signal

    from anns_lab import stops

    class Finalized:
        def __del__(self):
            stops._stop(signal.SIGINT, None)

    restore = stops.install()
    yield lambda: Finalized()  # made and dropped at once: its finalizer runs, its KeyboardInterrupt is lost
    restore()


@pytest.fixture(scope="session")
def smollm2_dump(tmp_path_factory):
    """A real SmolLM2-135M dump: 2048 tokens of offline text, 16 decode steps, layers 2 and 15, float32."""
    from anns_lab.dumps.run import run_dump

    out = tmp_path_factory.mktemp("smollm2-dump") / "dump"
    return run_dump("smollm2", tokens=2048, decode_tokens=16, layers="2,15", dtype="float32", out=out, progress=False).dump


@pytest.fixture(scope="session")
def plugin_dir(tmp_path_factory) -> Path:
    """A folder that registers the ``faulty`` index (tests/faulty_indexes.py) when on sys.path / PYTHONPATH (spawned
    workers inherit both)."""
    d = tmp_path_factory.mktemp("faulty-plugin")
    shutil.copy(Path(__file__).parent / "faulty_indexes.py", d / "faulty_indexes.py")
    info = d / "anns_lab_faulty-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: anns-lab-faulty\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[anns_lab.indexes]\nfaulty = faulty_indexes:FaultyIndex\n")
    return d
