"""CPU CI: the dispatch-level boundary trigger fires at collectives (a real gloo process group) in eager and
compiled code, and does not make Dynamo skip the frame."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from concordia_lab.instrument.boundaries import BoundaryTrigger  # noqa: E402


@pytest.fixture(scope="module")
def gloo(tmp_path_factory: pytest.TempPathFactory):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_eager_collectives_are_boundaries_and_plain_ops_are_not(gloo) -> None:
    seen: list[str] = []
    t = torch.randn(16)
    with BoundaryTrigger(seen.append) as trig:
        y = t * 2 + 1
        dist.all_reduce(y)
        z = y.sum()
    assert seen == ["c10d::allreduce_"]
    assert trig.ops_seen >= 4 and trig.boundaries == 1
    assert torch.allclose(z, (t * 2 + 1).sum())  # world size 1: the reduction is the identity


def test_extern_ops_can_be_boundaries(gloo) -> None:
    seen: list[str] = []
    a = torch.randn(8, 8)
    with BoundaryTrigger(seen.append, extern_ops={"aten::mm"}, collectives=False):
        (a @ a).relu()
        dist.all_reduce(a)
    assert seen == ["aten::mm"]


def test_compiled_code_keeps_compiling_and_fires_at_its_collective(gloo, tmp_path: Path) -> None:
    import torch._dynamo
    import torch.distributed._functional_collectives as fc

    torch._dynamo.reset()

    def step(x: torch.Tensor) -> torch.Tensor:
        y = torch.sin(x) * 3
        y = fc.all_reduce(y, "sum", gloo)
        return y.cos()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    seen: list[str] = []
    x = torch.randn(32)
    with BoundaryTrigger(seen.append):
        out = compiled(x)
    assert torch.allclose(out, step(x))
    assert any(s.startswith("_c10d_functional::all_reduce") for s in seen), seen
    assert any("wait_tensor" in s for s in seen), seen
    # the frame was compiled, not skipped: a second call outside the mode runs the compiled graph
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames >= 1
    compiled(x)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames
