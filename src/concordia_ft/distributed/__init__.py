"""Distributed fault tolerance on torch.distributed: a coordinator outside the ranks, distributed epochs
committed in two phases at collective boundaries, repair of a dead rank without restarting the job, and
hot / warm / cold standbys. DESIGN.md beside this file says how, and what was measured.

Importing this package imports no torch; the modules that need it (group, worker, workloads, coordinator)
import it themselves.
"""

from .health import Action, FailureKind, Timeouts, Verdict, plan_timeouts
from .launch import JobError, JobResult, run_job
from .options import DistOptions, StandbyOptions
from .workload import Workload

__all__ = ["Action", "DistOptions", "FailureKind", "JobError", "JobResult", "StandbyOptions", "Timeouts",
           "Verdict", "Workload", "plan_timeouts", "run_job"]
