"""The house rules of the source tree, read from the code itself (``ast``, nothing imported).

Imports go one way, down this list; a package may import only packages below it (and its own modules):

    cluster (package, cli, __main__)     the `swakv` entry point
    cluster.loadtest                      `swakv loadtest`
    cluster.tools                         offline jobs: plan, demo, model training, argparse types
    cluster.serve                         the OpenAI HTTP edge and how it is deployed
    cluster.routing | cluster.ray         data-parallel routing | the Ray runtime (neither imports the other)
    cluster.engine                        the engine without Ray: scheduler, engine, build, LLM, executor
    workers.runtime | workers.sim         the device runtime | simulated devices and models
    workers.attention | workers.models    attention kernels | HF configs -> attention specs, test models
    workers.wire                          the msgpack codec of the step protocol
    workers.protocol                      engine <-> worker messages
    kvmanager                             the KV-cache manager: standard library only

and besides: ``cluster.routing`` reads nothing of the engine but its KV-event schema and the typed
records that cross the Ray boundary; ``cluster.engine`` and everything under ``workers`` import no Ray;
``kvmanager`` imports nothing outside the standard library. No file under ``cluster/`` or ``workers/``
is longer than 600 lines. docs/design.md explains the layout.
"""
from __future__ import annotations

import ast
import gc
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvmanager", "workers", "cluster")
MAX_LINES = 600

# Top to bottom; names in one tuple are siblings that must not import each other.
LAYERS = (
    ("cluster",),
    ("cluster.loadtest",),
    ("cluster.tools",),
    ("cluster.serve",),
    ("cluster.routing", "cluster.ray"),
    ("cluster.engine",),
    ("workers.runtime", "workers.sim"),
    ("workers.attention", "workers.models"),
    ("workers.wire",),
    ("workers.protocol",),
    ("workers",),
    ("kvmanager",),
)
# What a layer may import of a layer below it, when that is narrower than all of it.
ONLY = {"cluster.routing": {"cluster.engine": ("cluster.engine.kv_events", "cluster.engine.types")}}
# Third-party packages a package (and every module under it) must never import.
NO_THIRD_PARTY = {"cluster.engine": ("ray", "fastapi", "starlette", "pydantic", "httpx"), "workers": ("ray",)}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def parse(path: Path) -> ast.Module:
    """``ast.parse`` with the collector paused. CPython 3.11 keeps one AST recursion counter per
    interpreter: a finalizer that runs mid-parse and reports an error formats a traceback, which parses
    source for its carets, and the outer parse then fails with "AST constructor recursion depth
    mismatch" (a CI run, stop 49: an earlier test's SharedMemory collected here)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(path.read_text(encoding="utf-8"), str(path))
    finally:
        if enabled:
            gc.enable()


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, wherever it is (functions included)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            if target == "__future__":
                continue
            subs = [f"{target}.{a.name}" for a in node.names if is_module(f"{target}.{a.name}")]
            out += [(node.lineno, s) for s in subs] or [(node.lineno, target)]
    return out


def layer_of(module: str) -> tuple[int, str] | None:
    """(layer index, the layer's package) of a project module; None for anything else."""
    best = None
    for i, names in enumerate(LAYERS):
        for pkg in names:
            if (module == pkg or module.startswith(pkg + ".")) and (best is None or len(pkg) > len(best[1])):
                best = (i, pkg)
    return best


def violations(path: Path) -> list[str]:
    """Every import in ``path`` that breaks a rule, as 'file:line: why'."""
    me = module_name(path)
    mine = layer_of(me)
    where = path.relative_to(ROOT)
    out = []
    for line, target in imports(path):
        top = target.split(".")[0]
        theirs = layer_of(target)
        if top not in PACKAGES:
            if mine[1] == "kvmanager" and top not in sys.stdlib_module_names:
                out.append(f"{where}:{line}: kvmanager imports {target}, which is not in the standard library")
            for pkg, banned in NO_THIRD_PARTY.items():
                if (me == pkg or me.startswith(pkg + ".")) and top in banned:
                    out.append(f"{where}:{line}: {pkg} must not import {top} (it imports {target})")
            continue
        if not is_module(target):
            out.append(f"{where}:{line}: imports {target}, which is no module of the project")
            continue
        if theirs is None:
            continue
        if theirs[1] == mine[1]:
            continue                                            # within its own package
        if theirs[0] < mine[0]:
            out.append(f"{where}:{line}: {mine[1]} imports {target}, which lies above it ({theirs[1]})")
        elif theirs[0] == mine[0]:
            out.append(f"{where}:{line}: {mine[1]} imports its sibling {theirs[1]} ({target})")
        else:
            allowed = ONLY.get(mine[1], {}).get(theirs[1])
            if allowed is not None and not any(target == a or target.startswith(a + ".") for a in allowed):
                out.append(f"{where}:{line}: {mine[1]} may import only {', '.join(allowed)} of {theirs[1]}, "
                           f"not {target}")
    return out


def test_every_module_belongs_to_a_layer():
    assert [module_name(p) for p in source_files() if layer_of(module_name(p)) is None] == []


def test_imports_go_one_way_only():
    found = [v for p in source_files() for v in violations(p)]
    assert found == [], "\n".join(found)


def test_no_file_under_cluster_or_workers_is_longer_than_600_lines():
    long = {str(p.relative_to(ROOT)): n for pkg in ("cluster", "workers") for p in (ROOT / pkg).rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}


def test_the_checker_sees_a_forbidden_import(tmp_path, monkeypatch):
    """The rules bite: an engine module that imports the router, or Ray, is reported with its line."""
    fake_root = tmp_path
    (fake_root / "cluster" / "engine").mkdir(parents=True)
    (fake_root / "cluster" / "routing").mkdir(parents=True)
    for d in ("cluster", "cluster/engine", "cluster/routing"):
        (fake_root / d / "__init__.py").write_text("")
    (fake_root / "cluster" / "routing" / "policies.py").write_text("")
    bad = fake_root / "cluster" / "engine" / "bad.py"
    bad.write_text("import os\nfrom ..routing import policies\n\ndef f():\n    import ray\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake_root)
    assert violations(bad) == [
        "cluster/engine/bad.py:2: cluster.engine imports cluster.routing.policies, which lies above it "
        "(cluster.routing)",
        "cluster/engine/bad.py:5: cluster.engine must not import ray (it imports ray)",
    ]


def test_the_distribution_ships_every_sub_package():
    """A non-editable install carries every sub-package: pyproject finds them (a plain list of the three
    top-level names would ship none of cluster.engine, workers.runtime, ...)."""
    import tomllib

    from setuptools import find_packages
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    assert "packages" not in config or isinstance(config["packages"], dict)
    shipped = set(find_packages(where=str(ROOT), include=config["packages"]["find"]["include"]))
    on_disk = {module_name(p.parent / "__init__.py") for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    assert on_disk <= shipped and {"cluster.engine", "workers.runtime", "cluster.serve"} <= shipped
