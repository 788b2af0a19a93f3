"""``anns-lab dump``: the command-line face of :func:`anns_lab.dumps.run.run_dump`."""

from __future__ import annotations

import click

from anns_lab.cli_types import given_flags
from anns_lab.dumps.checkpoint import EVERY as CHECKPOINT_EVERY
from anns_lab.dumps.models import RopeScaling
from anns_lab.dumps.prompts import CONTINUATIONS, SOURCES


class RopeScalingType(click.ParamType):
    """``KIND:FACTOR``: RoPE position scaling of the model's long-range layers, every layer where its config has one RoPE
    set (:class:`dumps.models.RopeScaling`);
    ``anns-lab decode`` takes it too."""

    name = "KIND:FACTOR"

    def convert(self, value, param, ctx) -> RopeScaling:
        if isinstance(value, RopeScaling):
            return value
        try:
            return RopeScaling.parse(value)
        except ValueError as err:
            self.fail(str(err), param, ctx)


ROPE_SCALING = RopeScalingType()
ROPE_HELP = ("scale the RoPE positions of the model's long-range layers (every layer where its config has one RoPE "
             "set): linear:4 maps 4x the trained context into "
             "it (dynamic, yarn also; the model was not trained so: still an extrapolation)")


@click.command(short_help="Capture post-RoPE Q/K/V of a model on a prompt into a dump folder.")
@click.option("--model", default="smollm2", show_default=True,
              help="smollm2, gemma3-270m, llama3, yi-6b, yi-9b, a local model folder or .gguf file, or a Hugging Face id.")
@click.option("--source", type=click.Choice(SOURCES), default="text", show_default=True,
              help="Built-in prompt: real offline text, or a synthetic long-context task.")
@click.option("--prompt", "prompt_path", type=click.Path(), default=None, help="A UTF-8 text file to use as the prompt instead.")
@click.option("--tokens", type=int, default=None, help="Prompt length in tokens [default: 8192; with --prompt, the whole file, up to 1,048,576 tokens: --tokens N reads the first N of any file].")
@click.option("--decode-tokens", type=int, default=64, show_default=True, help="Decode steps captured as phase 'decode'.")
@click.option("--continuation", type=click.Choice(CONTINUATIONS), default="greedy", show_default=True,
              help="The decode steps' tokens: the model's greedy choices, or the text's own next tokens after the prompt "
                   "(teacher forcing; --source text or --prompt with --tokens).")
@click.option("--layers", default="default", show_default=True,
              help="all | default (the full-attention layers: every layer of Llama/SmolLM2, Gemma-3's global ones) | "
                   "2,15,28 | 0:30:2 | 3-7.")
@click.option("--dtype", type=click.Choice(["float16", "float32"]), default="float16", show_default=True)
@click.option("--chunk", type=int, default=2048, show_default=True, help="Prefill chunk length (bounds memory).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the synthetic task prompts.")
@click.option("--out", type=click.Path(), default=None, help="Dump folder [default: dumps/<model>-<source>-<tokens>].")
@click.option("--overwrite", is_flag=True, help="Replace an existing dump (finished or not), once the new one's checks pass.")
@click.option("--allow-extrapolation", is_flag=True, help="Allow more tokens than the model's context length.")
@click.option("--rope-scaling", type=ROPE_SCALING, default=None, help=ROPE_HELP)
@click.option("--allow-download", is_flag=True, help="Let transformers fetch weights from a hub (off: offline only).")
@click.option("--device", default="cpu", show_default=True, help="Torch device for the model (cpu, cuda).")
@click.option("--checkpoint-every", type=float, default=CHECKPOINT_EVERY, show_default=True, metavar="SECONDS",
              help="Save the prefill's state this often, so that an interrupted dump resumes its prefill there (0: never).")
def dump(model, source, prompt_path, tokens, decode_tokens, continuation, layers, dtype, chunk, seed, out, overwrite,
         allow_extrapolation, rope_scaling, allow_download, device, checkpoint_every) -> None:
    """Capture post-RoPE Q/K/V of a model's prefill and decode steps into a Parquet dump."""
    from anns_lab.dumps.run import DumpInterrupted, run_dump
    from anns_lab.errors import DumpError

    given = given_flags(click.get_current_context(), "source", "seed")
    if prompt_path is not None and given:  # the file is the prompt: a task or seed beside it was silently dropped
        raise DumpError(f"--prompt takes the prompt from a file; {' and '.join(given)} choose a built-in prompt: "
                        "give one or the other")
    if tokens is None and prompt_path is None:
        tokens = 8192
    try:
        result = run_dump(model, source=source, prompt_path=prompt_path, tokens=tokens, decode_tokens=decode_tokens,
                          layers=layers, dtype=dtype, chunk=chunk, seed=seed, out=out, overwrite=overwrite,
                          allow_extrapolation=allow_extrapolation, rope_scaling=rope_scaling,
                          allow_download=allow_download, device=device, continuation=continuation,
                          checkpoint_every=checkpoint_every)
    except DumpInterrupted as stop:
        click.echo(str(stop), err=True)
        raise SystemExit(130) from None
    click.echo(result.summary())
