"""GPU check, round 4 (issue 42), without TE or SGLang: what one GPU can show of the colocated
push and the weight group.

1. A real CUDA-IPC round trip of a weight bucket between two processes on the one GPU, in the
   colocated payload format (:func:`megatron_p3o.weight_sync.ipc.serialize_named_tensors`:
   ForkingPickler with the device sent as its UUID). The receiver decodes it as SGLang 0.5.23's
   patched reductions do (UUID → its own device index) and checks every tensor bit for bit, on
   the GPU it expects.
2. NCCL with 2 processes on the one GPU, where NCCL allows it (it may refuse two ranks on one
   device: recorded, not a failure).

``--device cpu`` runs only what needs no GPU (the import and the payload format), for a smoke
test of this script. Writes ``round4.json`` in ``--out`` and one ``RESULT`` line.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _bucket(device: str):
    g = torch.Generator().manual_seed(0)
    named = [
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(256, 128, generator=g)),
        ("model.layers.0.mlp.experts.3.down_proj.weight", torch.randn(64, 96, generator=g)),
        ("model.norm.weight", torch.randn(128, generator=g)),
    ]
    return [(n, t.to(device=device, dtype=torch.bfloat16)) for n, t in named]


def _decode_like_sglang(blob: str):
    """SGLang 0.5.23 patches ``rebuild_cuda_tensor`` so that a UUID in the device slot maps to
    this process's device index (``sglang/srt/utils/patch_torch.py``); the same here."""
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    real = reductions.rebuild_cuda_tensor

    def rebuild(*args):
        args = list(args)
        dev = args[6]
        if isinstance(dev, str):
            idx = [
                str(torch.cuda.get_device_properties(i).uuid)
                for i in range(torch.cuda.device_count())
            ]
            args[6] = idx.index(dev)
        return real(*args)

    reductions.rebuild_cuda_tensor = rebuild
    try:
        return ForkingPickler.loads(base64.b64decode(blob))
    finally:
        reductions.rebuild_cuda_tensor = real


def _receiver(q_in, q_out):
    torch.cuda.set_device(0)
    blob = q_in.get()
    named = _decode_like_sglang(blob)
    want = _bucket("cpu")
    ok = all(
        n == wn and t.is_cuda and t.device.index == 0 and torch.equal(t.cpu(), wt)
        for (n, t), (wn, wt) in zip(named, want)
    ) and len(named) == len(want)
    q_out.put({"ok": bool(ok), "names": [n for n, _ in named]})


def ipc_round_trip(device: str) -> dict:
    from megatron_p3o.weight_sync.ipc import serialize_named_tensors

    if device != "cuda":
        blob = serialize_named_tensors(_bucket("cpu"))
        return {"skipped": "no GPU", "cpu_payload_bytes": len(blob)}
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_receiver, args=(q_in, q_out))
    p.start()
    named = _bucket("cuda")  # alive until the receiver has checked them
    t0 = time.time()
    q_in.put(serialize_named_tensors(named))
    got = q_out.get(timeout=120)
    p.join(timeout=30)
    return {**got, "seconds": round(time.time() - t0, 3)}


def _nccl_rank(rank, port, q):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=rank, world_size=2)
        t = torch.full((4,), float(rank + 1), device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        q.put((rank, "ok", t[0].item()))
        dist.destroy_process_group()
    except Exception as e:  # NCCL may refuse two ranks on one GPU
        q.put((rank, "refused", " ".join(str(e).split())[:300]))


def nccl_two_ranks(device: str) -> dict:
    if device != "cuda":
        return {"skipped": "no GPU"}
    from megatron_p3o.runtime.ports import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_nccl_rank, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in range(2):
            r, status, value = q.get(timeout=90)
            out[f"rank{r}"] = {"status": status, "value": value}
    except Exception as e:  # a hang: recorded
        out["error"] = f"no answer: {e!r}"
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    ok = all(v.get("status") == "ok" and v.get("value") == 3.0 for v in out.values()
             if isinstance(v, dict))  # fmt: skip
    out["allreduce_ok"] = ok and "error" not in out
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    report = {"ipc": ipc_round_trip(a.device), "nccl_2_ranks_1_gpu": nccl_two_ranks(a.device)}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "round4.json").write_text(json.dumps(report, indent=2))
    ipc_ok = report["ipc"].get("ok", a.device != "cuda")
    print(f"RESULT ipc_round_trip={'ok' if ipc_ok else 'FAILED'} nccl_1gpu="
          f"{report['nccl_2_ranks_1_gpu'].get('allreduce_ok', 'skipped')}")  # fmt: skip
    return 0 if ipc_ok else 1


if __name__ == "__main__":
    sys.exit(main())
