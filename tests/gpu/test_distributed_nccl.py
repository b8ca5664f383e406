"""concordia_ft.distributed with NCCL, every rank on the one GPU (a host id per process: NCCL then runs over
sockets): a function test of the same repair path the CPU tests drive with gloo, not a speed test."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from concordia_ft.distributed import run_job
from concordia_ft.distributed.timeline import load_faults, recovery_phases

pytestmark = pytest.mark.gpu


@pytest.fixture
def job_root() -> Iterator[Path]:
    """$CONCORDIA_TEST_KEEP names a directory to keep the jobs' logs in (device runs bring them back)."""
    keep = os.environ.get("CONCORDIA_TEST_KEEP")
    root = Path(keep) if keep else Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path("/tmp")
    p = root / f"cft-nccl-{uuid.uuid4().hex[:8]}"
    p.mkdir(parents=True)
    yield p
    if not keep:
        shutil.rmtree(p, ignore_errors=True)


def test_nccl_rank_killed_gives_the_uninterrupted_result(job_root: Path) -> None:
    base = {"workload": "dp_lora", "world": 2, "steps": 12, "backend": "nccl", "device": "cuda:0",
            "standby": {"hot": 0}, "collective_timeout_ms": 20000, "min_progress_timeout_ms": 20000}
    ref = run_job(job_root / "ref", base, timeout_s=240).same_on_every_rank()
    faults = [{"rank": 1, "cut": 3, "point": "collective"}, {"rank": 0, "cut": 7, "point": "uncommitted"}]
    r = run_job(job_root / "faults", {**base, "standby": {"hot": 1}, "faults": faults}, timeout_s=300)
    assert r.same_on_every_rank() == ref
    assert [rep["kind"] for rep in r.repairs].count("process-death") == 2
    assert any(s == "hot" for rep in r.repairs for s in rep["standby"].values())


def test_nccl_hot_standby_connected_ahead_repairs_without_building_a_group(job_root: Path) -> None:
    """The hot standby and the ranks build the spare communicators (survivor + standby for each rank) at a
    boundary ahead of any failure, connected (NCCL_RUNTIME_CONNECT=0 and a warm-up allreduce); a rank SIGKILLed
    by the coordinator is then replaced through the spare: no communicator is built during the repair, and
    the result is bitwise the uninterrupted run's. Writes the repairs' phases to $OUT when set."""
    base = {"workload": "dp_lora", "world": 2, "steps": 40, "backend": "nccl", "device": "cuda:0",
            "standby": {"hot": 0}}
    ref = run_job(job_root / "ref", base, timeout_s=240).same_on_every_rank()
    kills = [{"rank": 1, "after_cut": 5}, {"rank": 0, "after_cut": 20}]
    r = run_job(job_root / "spare", {**base, "standby": {"hot": 1, "order": ["hot", "cold"]}, "kills": kills},
                timeout_s=300)
    assert r.same_on_every_rank() == ref
    assert [rep["spare"] for rep in r.repairs] == [True, True], r.repairs
    phases = recovery_phases(r.repairs, r.timings, r.events, load_faults(r.job_dir))
    out = os.environ.get("OUT")
    if out:
        import json

        Path(out, "nccl_spare_phases.json").write_text(json.dumps(phases, indent=1))
    for p in phases:
        print(p)
        assert not p["note"], p
        assert p["rebuild_ms"] < 20, p  # nothing built: the spare was connected ahead
