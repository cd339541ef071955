"""GPU check, round 6 (issue 63), without TE or SGLang: what of items 1–3 one GPU can show.

1. ``padded_chunks``: the fused log-prob kernel (``logprob/fused.py``) on the GPU over a padded
   vocabulary (290 of 320 rows) with the chunk budget cut to 1,500 logits (chunks of ~5 tokens):
   ℓ, H, lse and the gradients against float64 on the CPU. One GPU is TP 1, so the rule the fix
   is about (every TP rank cuts the same chunks) is the CPU test's (TP 2 and 4, gloo); this
   checks the CUDA path of the same chunking.
2. ``colocated_fraction``: the trainer holds 2 GiB, ``torch.cuda.mem_get_info`` is read as the
   launch reads it, and the ``--mem-fraction-static`` it would pass gives the planned share
   (SGLang's own pool is not measured: SGLang cannot be installed on the lent machine).
3. ``payload_aliasing``: a colocated bucket made on the GPU at TP 1 (``weight_sync.colocated._take``
   from the export's own view of a parameter) shares no storage with the parameter.

``--device cpu`` runs all three on the CPU. One ``RESULT`` line; exit 0 only if all passed.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def padded_chunks(dev: torch.device) -> dict:
    from megatron_p3o.logprob import fused

    g = torch.Generator().manual_seed(0)
    n, d, vpad, vocab = 48, 16, 320, 290
    h = torch.randn(1, n, d, generator=g)
    w = 0.4 * torch.randn(vpad, d, generator=g)
    w[vocab:] = 3.0  # padding rows: large, and must not count
    t = torch.randint(0, vocab, (1, n), generator=g)
    old = dict(fused._CHUNK_ELEMS)
    fused._CHUNK_ELEMS.update(cpu=1500, cuda=1500)
    try:
        hd, wd = (x.clone().to(dev).requires_grad_() for x in (h, w))
        lp, ent, lse = fused.fused_vocab_parallel_logprobs(hd, wd, t.to(dev), None, 0.7, None,
                                                           True, vocab, True)  # fmt: skip
        (lp.sum() + 0.5 * ent.sum() + 0.25 * lse.sum()).backward()
    finally:
        fused._CHUNK_ELEMS.clear()
        fused._CHUNK_ELEMS.update(old)
    h64, w64 = h.double().clone().requires_grad_(), w.double().clone().requires_grad_()
    z = (h64 @ w64[:vocab].t()) / 0.7
    logp = torch.log_softmax(z, -1)
    lp64 = logp.gather(-1, t[..., None])[..., 0]
    ent64 = -(logp.exp() * logp).sum(-1)
    (lp64.sum() + 0.5 * ent64.sum() + 0.25 * torch.logsumexp(z, -1).sum()).backward()

    def rel(a, b):
        a, b = a.detach().double().cpu(), b.detach().double()
        return float((a - b).norm() / b.norm().clamp_min(1e-30))

    errs = {"lp": rel(lp, lp64), "ent": rel(ent, ent64), "grad_h": rel(hd.grad, h64.grad),
            "grad_w": rel(wd.grad[:vocab], w64.grad[:vocab])}  # fmt: skip
    pad_grad = float(wd.grad[vocab:].abs().max())
    return {"ok": max(errs.values()) < 1e-4 and pad_grad == 0.0, "rel": errs,
            "padding_grad": pad_grad}  # fmt: skip


def colocated_fraction(dev: torch.device) -> dict:
    from megatron_p3o.rollout.sglang.launch import colocated_fraction as frac

    if dev.type != "cuda":
        return {"ok": True, "skipped": "no CUDA memory to read"}
    held = torch.empty(2 * 2**30, dtype=torch.uint8, device=dev)
    free, total = torch.cuda.mem_get_info(dev)
    f = frac(0.3, total, free)
    pool = free * f  # what SGLang 0.5.23 sizes as weights + KV (free − free·(1 − f))
    del held
    return {"ok": abs(pool - 0.3 * total) < 2**20, "free_gib": free / 2**30,
            "total_gib": total / 2**30, "fraction": f}  # fmt: skip


def payload_aliasing(dev: torch.device) -> dict:
    from megatron_p3o.weight_sync.colocated import _take

    lin = torch.nn.Linear(16, 32, bias=False).to(dev)
    params = {p.untyped_storage().data_ptr() for p in lin.parameters()}
    view = lin.weight.detach()  # what the TP-1 export yields: the parameter's own storage
    ((name, t),) = _take(iter([("w", view)]), [("w", tuple(view.shape), view.dtype)], 0, params)
    shared = t.untyped_storage().data_ptr() in params
    return {"ok": not shared and torch.equal(t, view), "shares_storage": shared}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    dev = torch.device(a.device)
    res = {}
    for name, fn in (("padded_chunks", padded_chunks), ("colocated_fraction", colocated_fraction),
                     ("payload_aliasing", payload_aliasing)):  # fmt: skip
        try:
            res[name] = fn(dev)
        except Exception:  # noqa: BLE001 - recorded, the other checks still run
            res[name] = {"ok": False, "error": traceback.format_exc()[-2000:]}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "round6.json").write_text(json.dumps(res, indent=2))
    ok = all(r["ok"] for r in res.values())
    print("RESULT round6 " + " ".join(f"{k}={'ok' if v['ok'] else 'FAIL'}" for k, v in res.items()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
