"""The package's floors (``anns_lab`` docstring): no module imports a module on a floor above its own."""

from __future__ import annotations

import ast
from pathlib import Path

import anns_lab

ROOT = Path(anns_lab.__file__).parent
# Bottom to top; a module not named here takes the floor of its sub-package.
FLOORS = {"errors": 0, "version": 0, "io": 0, "window": 0, "cli_types": 0, "processes": 0, "stops": 0, "kernel_cache": 0,
          "dumps": 1, "indexes": 2, "testing": 2, "eval": 3, "decode": 4, "cli": 5, "__init__": 5}


def _name(path: Path) -> str:
    return ".".join(("anns_lab", *path.relative_to(ROOT).with_suffix("").parts))


def _floor(module: str) -> int:
    parts = module.split(".")
    return FLOORS["__init__" if len(parts) == 1 else parts[1]]


def _imports(path: Path) -> set[str]:
    """Every anns_lab module ``path`` imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "anns_lab"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "anns_lab":
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _resolve(name: str) -> str:
    """``anns_lab.eval.table.load_results`` → ``anns_lab.eval.table`` (the longest prefix that is a module)."""
    parts = name.split(".")
    while len(parts) > 1 and not ((ROOT.parent / "/".join(parts)).with_suffix(".py").is_file()
                                  or (ROOT.parent / "/".join(parts)).is_dir()):
        parts.pop()
    return ".".join(parts)


def test_no_import_runs_up_a_floor():
    modules = sorted(ROOT.rglob("*.py"))
    assert len(modules) > 30
    bad = []
    for path in modules:
        me = _name(path)
        for target in map(_resolve, _imports(path)):
            if _floor(target) > _floor(me):
                bad.append(f"{me} (floor {_floor(me)}) imports {target} (floor {_floor(target)})")
    assert not bad, "\n".join(bad)


def test_decoder_uses_models_and_prompts_not_the_capture():
    """The decoder loads models and builds prompts without the dump's capture orchestrator or Parquet store."""
    for path in sorted((ROOT / "decode").rglob("*.py")):
        used = set(map(_resolve, _imports(path)))
        assert not used & {"anns_lab.dumps.run", "anns_lab.dumps.capture", "anns_lab.dumps.store"}, path
        # Indexes are reached through the protocol (Index.search_group), never their kernels or attributes.
        assert not any(m.startswith("anns_lab.indexes.graph") for m in used), path
        assert not any(word in path.read_text() for word in ("entries_for", "graph_arrays", "GraphGroup")), path


def test_floor_table_knows_every_package():
    tops = {p.stem for p in ROOT.glob("*.py")} | {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert tops <= set(FLOORS), tops - set(FLOORS)
