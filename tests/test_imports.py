"""Dependencies go one way: abft.kernels <- abft <- abft.eval and abft.bench (the CLI sits on top), no
cycle anywhere, counting the imports inside functions too (a lazy import hides a cycle, it does
not remove it). Read from the source, so the test sees every module whether or not it loads."""
import ast
import os

import pytest

from paths import ROOT
PACKAGES = {"abft": "abft", "abft.kernels": "kernels", "abft.eval": "eval", "abft.bench": "bench"}


def _modules():
    """{module name: path} of every module of the packages, their subpackages included."""
    out = {}
    for pkg, folder in PACKAGES.items():
        for dp, dirs, files in os.walk(os.path.join(ROOT, folder)):
            dirs[:] = sorted(d for d in dirs if os.path.exists(os.path.join(dp, d, "__init__.py")))
            sub = os.path.relpath(dp, os.path.join(ROOT, folder))
            base = pkg if sub == "." else pkg + "." + sub.replace(os.sep, ".")
            for fn in sorted(files):
                if fn.endswith(".py"):
                    out[base if fn == "__init__.py" else f"{base}.{fn[:-3]}"] = os.path.join(dp, fn)
    return out


def _edges(mods):
    """{module: {imported module of ours: lineno}}: ``from abft import policy`` is an edge to
    abft.policy, ``from abft.kernels.layout import X`` to abft.kernels.layout; a package's own
    __init__ run as the parent of a submodule is not counted."""
    edges = {}
    for name, path in mods.items():
        tree = ast.parse(open(path).read(), path)
        pkg = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
        out = edges[name] = {}
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    out.setdefault(t, node.lineno)
    return edges


def _layer(name):
    if name.startswith("abft.kernels"):
        return 0
    if name.startswith(("abft.eval", "abft.bench")) or name == "abft.cli":
        return 2
    return 1


MODS = _modules()
EDGES = _edges(MODS)


def test_the_walk_sees_every_package_and_its_imports():
    assert {"abft.kernels.layout", "abft.policy", "abft.eval.campaign", "abft.cli", "abft.detectors.outputs",
            "abft.guard.ledger", "abft.integrations.hf"} <= set(MODS)
    assert "abft.kernels.layout" in EDGES["abft.policy"]
    assert "abft.kernels.threshold" in EDGES["abft.kernels.reference"]


@pytest.mark.parametrize("name", sorted(MODS))
def test_no_module_imports_a_layer_above_its_own(name):
    up = {t: line for t, line in EDGES[name].items() if _layer(t) > _layer(name)}
    assert not up, f"{name} imports {up} (module: line), a layer above it"


def test_no_import_cycles():
    """Tarjan's strongly connected components of the module graph: each must be one module."""
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in EDGES[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            comps.append(comp)

    for v in sorted(EDGES):
        if v not in index:
            visit(v)
    cycles = [sorted(c) for c in comps if len(c) > 1]
    detail = [{m: {t: line for t, line in EDGES[m].items() if t in c} for m in c} for c in cycles]
    assert not cycles, f"import cycles (module: {{imports in the cycle: line}}): {detail}"


def _package(name):
    """The installed package a module belongs to (abft's subpackages are abft's)."""
    return max((p for p in PACKAGES if name == p or name.startswith(p + ".")), key=len)


def test_no_module_takes_a_private_name_from_another_package():
    """A name with a leading underscore is its package's own: another package gets a public one."""
    bad = []
    for name, path in MODS.items():
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "") in MODS:
                for a in node.names:
                    if a.name.startswith("_") and _package(node.module) != _package(name):
                        bad.append(f"{name}:{node.lineno} {node.module}.{a.name}")
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                    and not node.attr.startswith("__") and isinstance(node.value, ast.Name):
                target = _aliases(path).get(node.value.id)
                if target and _package(target) != _package(name):
                    bad.append(f"{name}:{node.lineno} {target}.{node.attr}")
    assert not bad, bad


def _aliases(path, cache={}):
    """{local name: module of ours} for the modules a file imports by name."""
    if path not in cache:
        out = cache[path] = {}
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                for a in node.names:
                    if f"{node.module}.{a.name}" in MODS:
                        out[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in MODS and a.asname:
                        out[a.asname] = a.name
    return cache[path]


HERE = {folder: os.path.join(ROOT, folder) + os.sep for folder in PACKAGES.values()}


def _from_root(code):
    """``python -c code`` from the repository's root, the root on sys.path as it is there."""
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_transformers_llama_imports_from_the_repository_root():
    """transformers 5.25 imports the ``kernels`` distribution; the root's kernels/ folder must not be
    found in its place (``ImportError: cannot import name 'CUDAProperties'``)."""
    pytest.importorskip("kernels", reason="the kernels distribution (transformers >= 5.25 needs it)")
    r = _from_root("import kernels, transformers.models.llama.modeling_llama, abft.kernels\n"
                   f"assert not kernels.__file__.startswith({HERE['kernels']!r}), kernels.__file__\n"
                   f"assert abft.kernels.__file__.startswith({HERE['kernels']!r}), abft.kernels.__file__\n"
                   "print('ok')")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


@pytest.mark.parametrize("folder", ["kernels", "eval", "bench"])
def test_a_top_level_folder_is_not_importable_under_its_own_name(folder):
    """``import eval`` from the root fails as it does elsewhere, or gives the installed
    distribution of that name; never the folder (installed as abft.<folder>) or its modules."""
    mods = [fn[:-3] for fn in os.listdir(os.path.join(ROOT, folder)) if fn.endswith(".py") and fn != "__init__.py"]
    r = _from_root("import importlib, sys\n"
                   f"for name in [{folder!r}] + [{folder!r} + '.' + m for m in {mods!r}]:\n"
                   "    try:\n"
                   "        m = importlib.import_module(name)\n"
                   "    except ModuleNotFoundError:\n"
                   "        continue\n"
                   f"    assert not (getattr(m, '__file__', None) or '').startswith({HERE[folder]!r}), name\n"
                   f"assert not any((getattr(m, '__file__', None) or '').startswith({HERE[folder]!r})\n"
                   f"               for k, m in sys.modules.items() if k.split('.')[0] == {folder!r})\n"
                   "print('ok')")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_alarms_are_built_by_their_kinds_factories():
    """``Alarm(...)`` is called in abft/alarms.py only (one factory per kind of alarm): a detector,
    and the policy for a product's checksums, take their kind's factory, with the fields it has."""
    calls = {}
    for name, path in MODS.items():
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Alarm":
                calls.setdefault(name, []).append(node.lineno)
    assert set(calls) == {"abft.alarms"}, calls


def test_the_public_api_is_this_list():
    """abft's public names: one added or lost is a change users see."""
    import abft
    assert sorted(abft.__all__) == sorted([
        "StepGuard", "GuardHalt", "RestCheck", "RecomputeCheck", "CommCheck", "Ledger", "OutputCheck",
        "matmul", "mm", "bmm", "addmm", "baddbmm", "linear", "grouped_mm", "scope", "config", "inject",
        "flush", "alarms", "stats", "margin", "coverage", "reset", "protect", "unprotect", "checked",
        "nn", "Alarm", "AlarmLog", "SilentCorruptionError", "__version__"])
    assert all(hasattr(abft, n) for n in abft.__all__)
