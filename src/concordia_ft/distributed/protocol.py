"""The keys the coordinator and the ranks exchange through the coordinator's TCPStore, and the plan.

Everything a process needs to act is in the store, written by one side and read by the other; nothing is
sent rank to rank outside torch.distributed's own groups. The layout (DESIGN.md §2):

- ``ctl/gen``: the current generation (a new one per repair); ``plan/<gen>``: its ``Plan`` (JSON).
- ``prep/<gen>/<cut>/<rank>``: that rank's prepare record for that cut is durable in its own log.
- ``commit/<cut>``: the coordinator's commit record for that cut is durable in the coordinator's log.
- ``hb/<wid>``: a process's heartbeat (health.Beat); ``err/<n>`` + counter ``ctl/errors``: error reports.
- ``assign/<wid>``: a hot standby's assignment (the plan it joins); ``standby/<wid>``: a hot standby is ready.
- ``spare/<gen>``: the spare groups to build at a boundary (the hot standby, the cut); ``sparefor/<wid>``: the
  same, told to that standby; ``spareok/<gen>/<wid>``: that process holds its spare groups (DESIGN.md §5c).
- ``adopt/<wid>``: a rank that outlived the previous coordinator offers itself (its rank and slot cuts).
- ``timing/<gen>/<wid>``: one process's phase timings for that generation; ``done/<rank>``: its result.
- ``fired/<i>``: an injected fault already fired (faults fire once per job, also across replacements).
  A replicated workload's record also says how much work the rank had left at that cut (``ms,left``): the
  first committed cut with nothing left on any rank is the job's final cut.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

GEN = "ctl/gen"
ERRORS = "ctl/errors"


def plan_key(gen: int) -> str:
    return f"plan/{gen}"


def prep_key(gen: int, cut: int, rank: int) -> str:
    return f"prep/{gen}/{cut}/{rank}"


def commit_key(cut: int) -> str:
    return f"commit/{cut}"


def hb_key(wid: str) -> str:
    return f"hb/{wid}"


def err_key(n: int) -> str:
    return f"err/{n}"


def assign_key(wid: str) -> str:
    return f"assign/{wid}"


def standby_key(wid: str) -> str:
    return f"standby/{wid}"


def spare_key(gen: int) -> str:
    return f"spare/{gen}"


def spare_for_key(wid: str) -> str:
    return f"sparefor/{wid}"


def spare_ok_key(gen: int, wid: str) -> str:
    return f"spareok/{gen}/{wid}"


def spare_prefix(gen: int, standby: str, failed: int) -> str:
    return f"sparepg/{gen}/{standby}/{failed}"


def spare_members(members: tuple[str, ...] | list[str], standby: str, failed: int) -> list[str]:
    """Who holds each rank of the spare group that replaces rank ``failed`` by ``standby``."""
    return [standby if r == failed else w for r, w in enumerate(members)]


def adopt_key(wid: str) -> str:
    return f"adopt/{wid}"


def timing_key(gen: int, wid: str) -> str:
    return f"timing/{gen}/{wid}"


def done_key(rank: int) -> str:
    return f"done/{rank}"


def fired_key(i: int) -> str:
    return f"fired/{i}"


@dataclass(frozen=True)
class Plan:
    """One generation: who holds each rank, and the committed cut every member resumes from (-1: none yet,
    every member starts from the workload's initial state)."""

    gen: int
    cut: int
    members: tuple[str, ...]  # worker id per rank
    reason: str = "start"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return len(self.members)

    def rank_of(self, wid: str) -> int | None:
        return self.members.index(wid) if wid in self.members else None

    def encode(self) -> str:
        d = asdict(self)
        d["members"] = list(self.members)
        return json.dumps(d, sort_keys=True)

    @classmethod
    def decode(cls, raw: bytes | str) -> Plan:
        d = json.loads(raw)
        return cls(int(d["gen"]), int(d["cut"]), tuple(d["members"]), d.get("reason", ""), d.get("extra", {}))
