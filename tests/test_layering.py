"""core/ never imports torch or a CUDA binding; the package and the runtime import without them."""

from __future__ import annotations

import ast
import subprocess
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
