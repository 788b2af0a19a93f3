"""Where an index mode's first token waits: each layer's builds on a time axis, from `anns-lab decode --json`.

    anns-lab decode --model smollm2 --task passkey --context 8184 --mode full,roargraph --json run.json
    python benchmarks/plot_build_timeline.py run.json --mode roargraph --out timeline.png [--sample 0]

One bar per long-range layer (the sample's ``build_layers``: queued, started, ended, seconds from the prefill's end):
a thin line from the moment the prefill's last chunk completed the layer to the moment its builds started, a bar while
they ran. Time 0 is the prefill's end; the first decode step waits for the last bar. Left of 0 the builds shared the
cores with the prefill (below its priority), right of it they had them. A mode built after the prefill
(``--build-after-prefill``, ``--eval fidelity``) counts from its own build start instead.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", type=Path, help="an `anns-lab decode --json` result")
    ap.add_argument("--mode", required=True, help="an index mode of that run")
    ap.add_argument("--sample", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = ap.parse_args()
    if not args.json.is_file():
        raise SystemExit(f"{args.json}: no such file (an `anns-lab decode --json` result)")
    data = json.loads(args.json.read_text())
    if args.mode not in data.get("modes", {}):
        raise SystemExit(f"no mode {args.mode!r} in {args.json} (modes: {', '.join(data.get('modes', {}))})")
    samples = data["modes"][args.mode]["samples"]
    if not 0 <= args.sample < len(samples):
        raise SystemExit(f"--sample {args.sample}: {args.json} has samples 0-{len(samples) - 1} of {args.mode!r}")
    row = samples[args.sample]
    if "build_layers" not in row:
        raise SystemExit(f"mode {args.mode!r} of {args.json} records no build timeline (not an index mode, or a run "
                         "before the field existed)")
    spans = sorted((int(layer), *span) for layer, span in row["build_layers"].items())
    summary = data["modes"][args.mode]["summary"]
    fig, ax = plt.subplots(figsize=(8, 0.18 * len(spans) + 1.5))
    for y, (layer, queued, start, end) in enumerate(spans):
        ax.plot([queued, start], [y, y], color="0.7", lw=1)
        ax.barh(y, end - start, left=start, height=0.7, color="tab:orange" if start < 0 else "tab:blue")
    ax.axvline(0, color="k", lw=1)
    ax.set_yticks(range(len(spans)), [str(s[0]) for s in spans], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the prefill's end (orange: started during the prefill)")
    ax.set_ylabel("layer")
    ax.set_title(f"{args.mode}: prefill {summary['prefill_s']:.1f} s, build {summary['build_s']:.1f} s "
                 f"({summary['build_hidden_s']:.1f} hidden), TTFT {summary.get('ttft_s', float('nan')):.1f} s",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
