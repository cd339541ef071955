"""Record FeynRL's own P4O loss (``algs/P4O/p4o.py``, ``P4O.compute_policy_loss``) on fixed
float64 inputs into a JSON fixture that tests/unit/test_peer_p4o.py compares the project's P4O
against (issue 65, item 2).

Run once by a developer, by hand, NOT in CI (CI reads the JSON). The peer's class and its base's
helpers (``algs/RL/common.py``, ``COMMON.compute_kl_distance``) are cut out of the peer's source
with ``ast`` (``tools/peer_mismatch/sources.py``, line numbers kept), the ``ray.remote``
decorator dropped, and the method called on an instance made without ``__init__`` (no model, no
DeepSpeed: ``kl_coeff`` and ``ent_coeff`` 0, one process, so its ESS all-reduce is a no-op).
Written per case: the inputs' seed and noise levels, the peer's loss (its ``loss_total_sum /
denom``, the token mean), the gradient of that loss w.r.t. the current log-probs, and its e_b,
e_prox; with the repository, commit, file and line spans read.

    python tools/record_peer_p4o.py --feynrl /path/to/FeynRL.git[@REV] [--out FILE]

The peer casts its ratios, the mixture and k3 to float32 inside (for bf16 training): it runs
here with ``torch.float32`` meaning float64 in its module (``_Float64Torch``), so the fixture holds
its formula's numbers in float64, comparable to 1e-9.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peer_mismatch.sources import PeerSource, _def_record, load_defs, new_module  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "peer_p4o_feynrl.json"
P4O_FILE, COMMON_FILE = "algs/P4O/p4o.py", "algs/RL/common.py"
B, T, SEED = 4, 12, 20261207
# (noise of ℓb against ℓθ, noise of ℓprox against ℓθ): mismatch on either anchor, a fresh
# proximal anchor (e_prox = 1: the mixture is πb alone), a fresh behaviour anchor, both far
CASES = [(0.3, 0.2), (0.8, 0.1), (0.5, 0.0), (0.0, 0.4), (1.2, 0.6), (0.15, 0.15)]


def inputs(k: int, sb: float, sp: float) -> dict:
    """Seeded float64 inputs of case ``k``: ℓθ, ℓb, ℓprox ``[B, T]`` (log-probs ≤ 0), per-token
    advantages (one per sequence), a mask of varied lengths."""
    g = torch.Generator().manual_seed(SEED + k)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3.0 - 0.05
    lb = (lp + sb * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp_max(-1e-3)
    lprox = (lp + sp * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp_max(-1e-3)
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).contiguous()
    lengths = [T, T - 3, T - 7, 5]
    mask = torch.zeros(B, T, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1.0
    return {"lp": lp, "lb": lb, "lprox": lprox, "adv": adv, "mask": mask}


class _Float64Torch:
    """``torch`` for the peer's module, with ``torch.float32`` meaning float64: the peer casts
    its ratios, the mixture and k3 to float32 (for bf16 training); run in float64, its numbers
    are its formula's, not float32's rounding, and can be compared to 1e-9."""

    def __getattr__(self, name):
        return torch.float64 if name == "float32" else getattr(torch, name)


def feynrl_p4o(src: PeerSource):
    """The peer's ``compute_policy_loss`` bound to an instance, and the spans read."""
    mod = new_module("peer_feynrl", torch=_Float64Torch(), math=math, np=None, tqdm=None)
    spans = load_defs(src, COMMON_FILE, ["COMMON"], mod)
    spans.update(load_defs(src, P4O_FILE, ["P4O"], mod, strip_decorators=("ray.remote",)))
    obj = object.__new__(mod.P4O)
    obj.kl_coeff, obj.ent_coeff, obj.clip_low, obj.clip_high = 0.0, 0.0, 0.2, 0.2
    return obj.compute_policy_loss, spans


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--feynrl", required=True, help="FeynRL git dir (bare or checkout)[@REV]")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    a = ap.parse_args()
    src = PeerSource(a.feynrl, "FeynRL-project/FeynRL")
    loss_fn, spans = feynrl_p4o(src)
    cases = []
    for k, (sb, sp) in enumerate(CASES):
        x = inputs(k, sb, sp)
        lp = x["lp"].clone().requires_grad_()
        total, denom, metrics = loss_fn(logprobs=lp, old_logprobs=x["lb"], advantages=x["adv"],
                                        mask=x["mask"], entropies=None, ref_logprobs=None,
                                        prox_logprobs=x["lprox"])  # fmt: skip
        loss = total / denom
        (grad,) = torch.autograd.grad(loss, lp)
        cases.append({
            "case": k, "noise_b": sb, "noise_prox": sp, "seed": SEED + k,
            "loss": float(loss.detach()), "grad": grad.tolist(),
            "ess_b": float(metrics["ess_b"]), "ess_prox": float(metrics["ess_prox"]),
        })  # fmt: skip
    out = {
        "recorded_by": "tools/record_peer_p4o.py",
        "peer": _def_record(src, P4O_FILE, "P4O.compute_policy_loss", spans),
        "shape": [B, T],
        "cases": cases,
    }
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {len(cases)} cases from {src.repo}@{src.commit[:12]} to {a.out}")


if __name__ == "__main__":
    main()
