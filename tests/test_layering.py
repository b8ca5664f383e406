"""The package's layers, measured from its imports: no import circle, no import from a lower layer to a higher
one (DESIGN.md section 1), core/ never imports torch or a CUDA binding, and the package and the runtime import
without them.

The import graph counts every import statement (module level, function-local and ``if TYPE_CHECKING``: a type
named across a boundary is a dependency too). ``python tests/test_layering.py`` prints the counts.
"""

from __future__ import annotations

import ast
import subprocess
from dataclasses import dataclass
from pathlib import Path

from support import PYTHON, SRC, subprocess_env

BANNED = ("torch", "cuda", "cupy", "triton")
CORE = SRC / "concordia_ft" / "core"

_BLOCKER = r'''
import importlib.abc, sys
BANNED = {banned!r}
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BANNED:
            raise ImportError(f"{{name}} is hidden by test_layering")
        return None
sys.meta_path.insert(0, Blocker())
for m in list(sys.modules):
    if m.split(".")[0] in BANNED:
        del sys.modules[m]
'''


def _run_hidden(body: str) -> subprocess.CompletedProcess[str]:
    code = _BLOCKER.format(banned=set(BANNED)) + body
    return subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=120)


def test_package_core_and_runtime_import_with_torch_and_cuda_hidden(tmp_path: Path) -> None:
    modules = sorted(f"concordia_ft.core.{p.stem}" for p in CORE.glob("*.py") if p.stem != "__init__")
    body = (
        "import importlib\n"
        "import concordia_ft\n"
        f"for m in {modules!r} + ['concordia_ft.core', 'concordia_ft.runtime', 'concordia_ft.cpu.trackers']:\n"
        "    importlib.import_module(m)\n"
        "import numpy as np\n"
        "rt = concordia_ft.Runtime(sys.argv[1] if len(sys.argv) > 1 else " + repr(str(tmp_path / "log")) + ")\n"
        "a = np.arange(10000, dtype=np.float32)\n"
        "rt.register('a', a)\n"
        "assert rt.checkpoint() == 1\n"
        "a[5] = -1\n"
        "assert rt.checkpoint() == 2\n"
        "rt.close()\n"
        "rec = concordia_ft.recover(" + repr(str(tmp_path / "log")) + ")\n"
        "assert rec.epoch == 2 and (rec.array('a') == a).all()\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in BANNED]\n"
        "assert not bad, bad\n"
        "print('OK')\n"
    )
    p = _run_hidden(body)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stderr[-3000:]


def test_the_blocker_really_hides_torch() -> None:
    """Guards the test above: with the finder in place, importing torch fails."""
    p = _run_hidden("import torch\n")
    assert p.returncode != 0 and "hidden by test_layering" in p.stderr


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            out.append(str(node.args[0].value))
    return out


def test_no_file_under_core_imports_torch_or_cuda() -> None:
    files = sorted(CORE.rglob("*.py"))
    assert len(files) >= 8
    offenders = {str(f.relative_to(SRC)): m for f in files for m in _imports(f) if m.split(".")[0] in BANNED}
    assert not offenders, f"core/ must not import torch/cuda: {offenders}"
    # relative imports must stay inside the package, and core must not reach up into cuda/ or integrations/
    for f in files:
        tree = ast.parse(f.read_text(), str(f))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level >= 2 and node.module:
                assert node.module.split(".")[0] not in ("cuda", "integrations", "cpu", "runtime", "session"), (
                    f"{f.name} imports ..{node.module}: core must not depend on upper layers")


def test_public_runtime_names_still_import() -> None:
    """The runtime is split into modules; every name users imported from concordia_ft.runtime still works."""
    import concordia_ft
    from concordia_ft import runtime

    for name in runtime.__all__:
        assert getattr(runtime, name) is not None, name
    for name in ("Runtime", "recover", "Recovered", "PendingEpoch"):
        assert getattr(concordia_ft, name) is getattr(runtime, name)


def test_the_registry_dispatches_on_no_backend_type() -> None:
    """One backend interface: runtime.py and the epoch pipeline never ask which tracker or device a region has
    (the CPU/CUDA choice lives in backends.py)."""
    offenders = []
    for mod in ("runtime.py", "checkpoint.py", "recovery.py"):
        tree = ast.parse((SRC / "concordia_ft" / mod).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id in ("CpuTracker", "CpuDenseBatch", "make_cuda_tracker"):
                offenders.append(f"{mod}:{node.lineno} {node.id}")
            if isinstance(node, ast.alias) and node.name in ("CpuTracker", "CpuDenseBatch", "make_cuda_tracker"):
                offenders.append(f"{mod}: imports {node.name}")
            if isinstance(node, ast.Attribute) and node.attr == "is_cuda":
                offenders.append(f"{mod}:{node.lineno} .is_cuda")
    assert not offenders, offenders


# ------------------------------------------------------------------------------------------- the import graph
PKG = SRC / "concordia_ft"
# (prefix, layer): the longest matching prefix decides; a module may import its own layer and lower ones
LAYERS = (
    ("concordia_ft.errors", 0), ("concordia_ft.core", 0),
    ("concordia_ft.cpu", 1), ("concordia_ft.cuda", 1),
    ("concordia_ft.runtime", 3), ("concordia_ft.buffers", 3), ("concordia_ft.backends", 3),
    ("concordia_ft.checkpoint", 3), ("concordia_ft.recovery", 3),
    ("concordia_ft.integrations", 4), ("concordia_ft.models", 4),
    ("concordia_ft.session", 5),
    ("concordia_ft.serve", 6), ("concordia_ft.client", 6),  # the server and its HTTP client
    ("concordia_ft.distributed", 7),
    ("concordia_ft.cli", 8),
)
FACADE = "concordia_ft"  # the package's __init__: re-exports the public names (lazily), so it may name any layer
ALLOWED_CYCLES: list[set[str]] = []  # none: a new circle is a module split in two, or a missing lower layer
ALLOWED_UPWARD: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int
    where: str  # "top", "local" (inside a function) or "typing" (under if TYPE_CHECKING)


def package_modules(pkg: Path = PKG) -> dict[str, Path]:
    """Dotted name -> file of every module of the package at ``pkg``."""
    out = {}
    for p in pkg.rglob("*.py"):
        parts = list(p.relative_to(pkg.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def import_graph() -> tuple[dict[str, Path], list[Edge]]:
    mods = package_modules()
    edges = []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        where: dict[int, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                for sub in node.body:
                    for n in ast.walk(sub):
                        where[id(n)] = "typing"
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for n in ast.walk(node):
                    where.setdefault(id(n), "local")
        base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                pkg = ".".join(base[: len(base) - node.level + 1] + [node.module or ""]).strip(".") if node.level \
                    else node.module or ""
                targets = [f"{pkg}.{a.name}" if f"{pkg}.{a.name}" in mods else pkg for a in node.names]
            else:
                continue
            for t in targets:
                while t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in mods and t != mod:
                    edges.append(Edge(mod, t, node.lineno, where.get(id(node), "top")))
    return mods, edges


def layer_of(mod: str) -> int:
    best = max((p for p, _ in LAYERS if mod == p or mod.startswith(p + ".")), key=len, default=None)
    if best is None:
        raise AssertionError(f"{mod} is in no layer: add it to LAYERS (and to DESIGN.md section 1)")
    return dict(LAYERS)[best]


def cycles(mods: dict[str, Path], edges: list[Edge]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    adj: dict[str, list[str]] = {m: [] for m in mods}
    for e in edges:
        adj[e.src].append(e.dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in sorted(mods):
        if root in index:
            continue
        work = [(root, iter(adj[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(adj[w])))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.add(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def upward(edges: list[Edge], *, allowed: bool = False) -> list[Edge]:
    """Imports from a lower layer to a higher one (``allowed``: the allow-listed ones too)."""
    return [e for e in edges if e.src != FACADE and e.dst != FACADE and layer_of(e.dst) > layer_of(e.src)
            and (allowed or (e.src, e.dst) not in ALLOWED_UPWARD)]


def test_every_module_has_a_layer() -> None:
    mods, _ = import_graph()
    assert len(mods) > 50
    for m in mods:
        if m != FACADE:
            layer_of(m)


def test_the_graph_sees_function_local_and_typing_imports(tmp_path: Path) -> None:
    """Guards the tests below: known imports of each kind are in the graph."""
    _, edges = import_graph()
    got = {(e.src, e.dst, e.where) for e in edges}
    assert ("concordia_ft.runtime", "concordia_ft.recovery", "top") in got
    assert ("concordia_ft.cli.doctor", "concordia_ft.core.slotlog", "local") in got
    assert any(e.where == "typing" for e in edges)
    fake = [Edge("a", "b", 1, "local"), Edge("b", "c", 1, "typing"), Edge("c", "a", 1, "top"), Edge("c", "d", 1, "top")]
    assert cycles({m: tmp_path for m in "abcd"}, fake) == [{"a", "b", "c"}]


def test_no_import_circles() -> None:
    mods, edges = import_graph()
    found = [c for c in cycles(mods, edges) if c not in ALLOWED_CYCLES]
    detail = [sorted(f"{e.src} -> {e.dst} (line {e.line}, {e.where})" for e in edges if e.src in c and e.dst in c)
              for c in found]
    assert not found, f"import circles: {detail}"


def test_no_import_from_a_lower_layer_to_a_higher_one() -> None:
    _, edges = import_graph()
    bad = [f"{e.src} (layer {layer_of(e.src)}) imports {e.dst} (layer {layer_of(e.dst)}), line {e.line}"
           for e in upward(edges)]
    assert not bad, bad


def report() -> str:
    mods, edges = import_graph()
    found = cycles(mods, edges)
    lines = [f"modules: {len(mods)}, import edges: {len(edges)} "
             f"({sum(e.where == 'local' for e in edges)} function-local, "
             f"{sum(e.where == 'typing' for e in edges)} under TYPE_CHECKING)",
             f"import circles: {len(found)}" + "".join(f"\n  {' <-> '.join(sorted(c))}" for c in found),
             f"upward imports: {len(upward(edges, allowed=True))} ({len(upward(edges))} not allow-listed)"]
    lines += [f"  {e.src} -> {e.dst} (line {e.line})" for e in upward(edges, allowed=True)]
    found_r = reach_ins()
    lines.append(f"private reach-ins: {len(found_r)} ({sum((m, n) not in ALLOWED_REACH_INS for m, n, _ in found_r)} "
                 "not allow-listed)")
    lines += [f"  {m}:{line} {n}" for m, n, line in found_r]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ private reach-ins
# Cross-module uses of another module's private names (``obj._x`` where only other modules of the package
# define ``_x``, or ``from .m import _x``). None: the owning module gives the name a public spelling instead.
ALLOWED_REACH_INS: set[tuple[str, str]] = set()


def private_names(tree: ast.Module) -> set[str]:
    """The private names a module defines: functions, classes, module globals, attributes stored on self."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and n.name.startswith("_") \
                and not n.name.startswith("__"):
            out.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name) \
                and n.value.id in ("self", "cls") and n.attr.startswith("_"):
            out.add(n.attr)
        elif isinstance(n, ast.Assign | ast.AnnAssign):
            for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                if isinstance(t, ast.Name) and t.id.startswith("_"):
                    out.add(t.id)
    return out


def reach_ins(pkg: Path = PKG) -> list[tuple[str, str, int]]:
    """(module, private name, line) of every cross-module private use in the package at ``pkg``."""
    mods = package_modules(pkg)
    trees = {m: ast.parse(p.read_text(), str(p)) for m, p in mods.items()}
    defined: dict[str, set[str]] = {}
    for m, tree in trees.items():
        for name in private_names(tree):
            defined.setdefault(name, set()).add(m)
    found = []
    for m, tree in trees.items():
        mine = private_names(tree)
        foreign = set()  # names bound to modules outside the package (os._exit, torch._C are not ours)
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                foreign |= {(a.asname or a.name).split(".")[0] for a in n.names if not a.name.startswith("concordia_ft")}
            elif isinstance(n, ast.ImportFrom) and not n.level and not (n.module or "").startswith("concordia_ft"):
                foreign |= {a.asname or a.name for a in n.names}
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__"):
                base = n.value
                if isinstance(base, ast.Name) and (base.id in ("self", "cls") or base.id in foreign):
                    continue
                if n.attr not in mine and defined.get(n.attr, set()) - {m}:
                    found.append((m, n.attr, n.lineno))
            elif isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("concordia_ft")):
                for a in n.names:
                    if a.name.startswith("_") and not a.name.startswith("__") and a.name not in mods_tail(mods, pkg):
                        found.append((m, a.name, n.lineno))
    return found


def mods_tail(mods: dict[str, Path], pkg: Path = PKG) -> set[str]:
    """Last components of the package's modules (``from . import _x`` of a module or a C extension is fine)."""
    return {m.rsplit(".", 1)[-1] for m in mods} | {p.name.split(".")[0] for p in pkg.rglob("*.c")}


def test_no_module_reaches_into_another_modules_private_names() -> None:
    bad = [f"{m}:{line} uses {name}" for m, name, line in reach_ins() if (m, name) not in ALLOWED_REACH_INS]
    assert not bad, "add a public method or function instead: " + "; ".join(bad)


def test_the_reach_in_check_sees_a_private_attribute_and_a_private_import(tmp_path: Path) -> None:
    """Guards the test above: in a small package written here, the walk finds exactly the cross-module uses of
    private names (an attribute stored by another module's class, a private function imported from a sibling),
    and none of a module's own private names nor of a module outside the package."""
    pkg = tmp_path / "fakepkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "owner.py").write_text("class Owner:\n    def __init__(self):\n        self._state = 0\n"
                                  "    def bump(self):\n        self._state += 1\n\n"
                                  "def _helper():\n    return 1\n")
    (pkg / "sub" / "user.py").write_text("import os\nfrom ..owner import Owner, _helper\n\n"
                                         "def use(o: Owner):\n    o._state = _helper()\n    os._exit\n")
    (pkg / "clean.py").write_text("class Mine:\n    def __init__(self):\n        self._own = 1\n"
                                  "def f(m: Mine):\n    return m._own\n")
    got = sorted((m, name) for m, name, _ in reach_ins(pkg))
    assert got == [("fakepkg.sub.user", "_helper"), ("fakepkg.sub.user", "_state")], got
    tree = ast.parse("class A:\n    def __init__(self):\n        self._x = 1\n_G = 2\ndef _f(): pass\n")
    assert private_names(tree) == {"_x", "_G", "_f"}


if __name__ == "__main__":
    print(report())
