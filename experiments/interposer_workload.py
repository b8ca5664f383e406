"""One process of the interposer benchmark (run by bench_interposer.py, never on its own in CI).

  python3 experiments/interposer_workload.py --workload qwen3|launch|load --mode none|interposer|profiler|both

The process itself is unmodified PyTorch + Triton + cuBLAS code; "interposer" means the parent started it
with CUDA_INJECTION64_PATH set (concordia_lab.instrument.interposer.child_env). Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "experiments"))  # concordia_lab: the instrumentation and the executor


def qwen3_workload() -> dict:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048)
    model = Qwen3ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 32), device="cuda")
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=16, do_sample=False, min_new_tokens=16)
    # a training step (autograd kernels, cuBLAS backward)
    model.train()
    loss = model(ids, labels=ids).loss
    loss.backward()
    # a torch.compile'd decoder layer MLP (Inductor -> Triton kernels, static launcher)
    mlp = torch.compile(model.model.layers[0].mlp)
    x = torch.randn(2, 32, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):
            y = mlp(x)
    torch.cuda.synchronize()
    return {"tokens": int(out.shape[1] - ids.shape[1]), "loss": float(loss), "y": float(y.float().abs().sum())}


def launch_workload(n: int = 20000) -> dict:
    import torch

    x = torch.zeros(1, device="cuda")
    for _ in range(2000):
        x.add_(1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return {"launches": n, "us_per_launch": 1e6 * dt / n, "value": float(x.item())}


def load_workload(n: int = 300) -> dict:
    from cuda.bindings import driver as drv

    from concordia_ft.cuda.driver import ensure_context
    from concordia_lab.instrument.ptxas import assemble

    ptx = (".version 8.7\n.target sm_90a\n.address_size 64\n.visible .entry cft_probe_load(.param .u64 p)\n"
           "{\n\t.reg .b64 %rd<2>;\n\tld.param.u64 %rd1, [p];\n\tret;\n}\n")
    cubin = assemble(ptx).cubin
    ensure_context()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        err, mod = drv.cuModuleLoadData(cubin)
        times.append(time.perf_counter() - t0)
        assert int(err) == 0, err
        drv.cuModuleUnload(mod)
    times.sort()
    return {"loads": n, "us_per_load_median": 1e6 * times[n // 2]}


def profiler_kernels(prof) -> dict[str, int]:
    from torch.autograd import DeviceType

    counts: collections.Counter[str] = collections.Counter()
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")):
            counts[e.name] += 1
    return dict(counts)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", choices=["qwen3", "launch", "load"], required=True)
    ap.add_argument("--mode", choices=["none", "interposer", "profiler", "both"], required=True)
    ns = ap.parse_args()
    work = {"qwen3": qwen3_workload, "launch": launch_workload, "load": load_workload}[ns.workload]
    res: dict = {"workload": ns.workload, "mode": ns.mode}
    t0 = time.perf_counter()
    if ns.mode in ("profiler", "both"):
        import torch
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            res["result"] = work()
            torch.cuda.synchronize()
        res["profiler_kernels"] = profiler_kernels(prof)
    else:
        res["result"] = work()
    res["wall_s"] = time.perf_counter() - t0
    if ns.mode in ("interposer", "both"):
        from concordia_lab.instrument import interposer as ip

        inv = ip.inventory()
        res["interposer"] = {"summary": inv.summary(), "shared_subscriber": inv.shared_subscriber,
                             "launches": {ip.demangle(k): v for k, v in inv.launches.items()},
                             "load_calls": inv.load_calls, "load_images": inv.load_images,
                             "modules": [{"api": m.api, "image": m.image, "ptx": m.ptx, "bytes": m.bytes,
                                          "kernels": len(m.kernels)} for m in inv.modules]}
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
