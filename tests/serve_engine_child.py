"""Child process: drive the workload on a new engine (or one recovered from the log), printing every step's
committed tokens as a JSON line, until the parent SIGKILLs it. ``argv[3]`` (optional): a step after which the
child stops and waits to be killed (its log then ends at that step; pipelined epochs: at that step or a
few after it)."""

from __future__ import annotations

import json
import sys
import time

from concordia_ft.serve import Engine
from llm_helpers import tiny_model
from serve_workload import OPTIONS, SHARED_OPTIONS, drive, shared_workload, state_digest, workload


def main() -> None:
    log_dir, mode = sys.argv[1], sys.argv[2]  # new | recover, optionally -c (step epochs), -async, -shared
    pause = int(sys.argv[3]) if len(sys.argv) > 3 else None
    model = tiny_model("llama")
    opts = dict(SHARED_OPTIONS if "-shared" in mode else OPTIONS)
    arrivals = shared_workload() if "-shared" in mode else workload()
    if "-c" in mode:
        opts["step_epochs"] = "c"
    if "-async" in mode:
        opts["async_epochs"] = True
    eng = Engine.recover(log_dir, model, opts) if mode.startswith("recover") else Engine(model, log_dir, opts)
    have = {r.id: len(r.generated) for r in [*eng.running.values(), *eng.finished.values(), *eng.waiting]}
    print(json.dumps({"ev": "start", "step": eng.step_no, "have": have, "state": state_digest(eng)}), flush=True)

    def on_step(o: object) -> None:
        print(json.dumps({"ev": "step", "step": o.step, "new": o.new_tokens}), flush=True)  # type: ignore[attr-defined]
        if pause is not None and o.step >= pause:  # type: ignore[attr-defined]
            time.sleep(3600)

    drive(eng, arrivals, on_step=on_step)
    print(json.dumps({"ev": "done"}), flush=True)


if __name__ == "__main__":
    main()
