"""Child process: successive waves on a new engine (or one recovered from the log) with step epochs on a DRAM
log that compacts every few waves, printing every step's committed tokens and whether a compaction is running,
as JSON lines, until the parent SIGKILLs it."""

from __future__ import annotations

import json
import sys

from concordia_ft.serve import Engine
from llm_helpers import tiny_model
from serve_waves import OPTIONS, compact_often, drive_waves, waves


def main() -> None:
    log_dir, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model = tiny_model("llama")
    opts = {**OPTIONS, "step_epochs": "c"}
    eng = Engine.recover(log_dir, model, opts) if mode == "recover" else Engine(model, log_dir, opts)
    compact_often(eng)
    have = {r.id: len(r.generated) for r in [*eng.running.values(), *eng.finished.values()]}
    print(json.dumps({"ev": "start", "step": eng.step_no, "have": have}), flush=True)
    rt = eng.runtime
    assert rt is not None

    def report(o):
        print(json.dumps({"ev": "step", "step": o.step, "new": o.new_tokens, "compacting": rt.compacting,
                          "compactions": rt.compaction_stats()["count"]}), flush=True)

    drive_waves(eng, waves(n), on_step=report)
    print(json.dumps({"ev": "done"}), flush=True)


if __name__ == "__main__":
    main()
