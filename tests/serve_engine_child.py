"""Child process: drive the workload on a new engine (or one recovered from the log), printing every step's
committed tokens as a JSON line, until the parent SIGKILLs it."""

from __future__ import annotations

import json
import sys

from concordia_ft.serve import Engine
from llm_helpers import tiny_model
from serve_workload import OPTIONS, drive, workload


def main() -> None:
    log_dir, mode = sys.argv[1], sys.argv[2]  # new | recover, optionally -c (step epochs) and -async
    model = tiny_model("llama")
    opts = dict(OPTIONS)
    if "-c" in mode:
        opts["step_epochs"] = "c"
    if "-async" in mode:
        opts["async_epochs"] = True
    eng = Engine.recover(log_dir, model, opts) if mode.startswith("recover") else Engine(model, log_dir, opts)
    have = {r.id: len(r.generated) for r in [*eng.running.values(), *eng.finished.values()]}
    print(json.dumps({"ev": "start", "step": eng.step_no, "have": have}), flush=True)
    drive(eng, workload(), on_step=lambda o: print(json.dumps({"ev": "step", "step": o.step, "new": o.new_tokens}),
                                                    flush=True))
    print(json.dumps({"ev": "done"}), flush=True)


if __name__ == "__main__":
    main()
