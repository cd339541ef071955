"""Record peer implementations of IcePop / seq-mask-TIS (and AReaL's M2PO) into a JSON fixture.

Run once by a developer, by hand, NOT in CI: CI and the tests only read the JSON this writes
(tests/fixtures/peer_mismatch_corrections.json by default). The numbers are computed by the
peers' own code: each peer function or class is cut out of the peer's source file with ``ast``
(original line numbers kept, so tracebacks point into the peer file), exec'd into a scratch
module whose unrelated imports (megatron, ray, pydantic, the peers' logging and stats helpers,
the model forward) are replaced by small stand-ins, and then called on fixed float64 inputs
built from a seeded ``torch.Generator``. For every case the peer's loss, the autograd gradient
of that loss w.r.t. the current log-probs, and the peer's masked-fraction metrics are written,
together with the peer repo, commit, file, function and line span that produced them.
docs/notes/peer_mismatch_corrections.md says what each peer computes.

How to run (in a scratch venv outside the repo; nothing of the peers is installed anywhere):

    python3 -m venv /tmp/peervenv
    /tmp/peervenv/bin/pip install torch==2.13.0 numpy
    /tmp/peervenv/bin/python tools/record_peer_mismatch.py \\
        --nemo-rl /path/to/NVIDIA-NeMo/RL.git \\
        --areal /path/to/inclusionAI/AReaL.git \\
        --slime /path/to/THUDM/slime.git

Each peer argument is a git directory (bare mirror or checkout) of that repository, optionally
``DIR@REV`` (default HEAD); the commit actually read is written into the fixture. A peer that is
left out is skipped (its cases are not written). ``--out`` changes the output path.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from peer_mismatch.areal import areal_cases, areal_m2po_edge_cases
from peer_mismatch.exp_edges import ExpAtEdges, band_edges, kept_here, kept_states
from peer_mismatch.inputs import (
    EDGE_LENGTHS,
    SEED,
    SEQ_EDGES,
    TOKEN_EDGES,
    check_design,
    check_edge_design,
    make_edge_inputs,
    make_inputs,
    make_m2po_microbatch_inputs,
    make_m2po_rho_inputs,
    make_m2po_tie_inputs,
)
from peer_mismatch.nemo import NEMO_EDGE_VARIANTS, nemo_cases, nemo_edge_cases
from peer_mismatch.slime import SLIME_EDGE_VARIANTS, slime_cases, slime_edge_cases
from peer_mismatch.sources import PeerSource

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "peer_mismatch_corrections.json"

# --------------------------------------------------------------------------------------------


def with_outcomes(cases: list[dict], run_one, bands: list[tuple], x) -> list[dict]:
    """Issue 51: each edge case's peer outputs for every kept/dropped combination of its edges.

    ``run_one(i)`` runs the peer on variant i (returns its case); ``bands[i]`` is
    (level, low, high). The edges are put on their bounds or one ulp outside by
    ``ExpAtEdges`` around the peer's own code; the all-kept outcome must equal the case as
    recorded without the mode (this host's ``exp`` lands every edge on its bound)."""
    for i, case in enumerate(cases):
        level, low, high = bands[i]
        edges = band_edges(TOKEN_EDGES, SEQ_EDGES, level, low, high)
        assert edges and kept_here(x, edges, low, high) == (True,) * len(edges), case["name"]
        outcomes = []
        for kept in kept_states(len(edges)):
            with ExpAtEdges(edges, kept):
                c = run_one(i)
            outcomes.append(
                {
                    "kept": list(kept),
                    "loss": c["loss"],
                    "grad_logprobs": c["grad_logprobs"],
                    "metrics": c["metrics"],
                }
            )
        assert outcomes[0]["loss"] == case["loss"], (case["name"], outcomes[0]["loss"])
        assert outcomes[0]["grad_logprobs"] == case["grad_logprobs"], case["name"]
        assert len({o["loss"] for o in outcomes}) == len(outcomes), case["name"]
        case["edges"], case["outcomes"] = edges, outcomes
    return cases


def _nemo_band(v) -> tuple:
    level = "token" if v[1] == "icepop" else "seq"
    tis = v[2]
    return (
        level,
        tis["truncated_importance_sampling_ratio_min"],
        tis["truncated_importance_sampling_ratio"],
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nemo-rl", help="git dir of NVIDIA-NeMo/RL [@REV]")
    ap.add_argument("--areal", help="git dir of inclusionAI/AReaL [@REV]")
    ap.add_argument("--slime", help="git dir of THUDM/slime [@REV]")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    a = ap.parse_args(argv)

    x = make_inputs()
    check_design(x)
    xe = make_edge_inputs()
    check_edge_design(xe)
    m2_sets = [
        (
            "two_microbatches",
            make_m2po_microbatch_inputs(),
            "two micro-batches (rows [0, 4) and [4, 8)); the first holds the large δ",
        ),
        (
            "kept_rho_above_5",
            make_m2po_rho_inputs(),
            "one micro-batch; one token at ρ ≈ 5.5 kept by the M2 cut",
        ),
        (
            "tie_at_cut",
            make_m2po_tie_inputs(),
            "one micro-batch; 8 tokens tied at δ = 0.5 with k* = 2 inside the tie",
        ),
    ]

    peers: dict[str, dict] = {}
    cases: list[dict] = []
    edge_cases: list[dict] = []
    if a.nemo_rl:
        src = PeerSource(a.nemo_rl, "NVIDIA-NeMo/RL")
        peers["nemo_rl"], c = nemo_cases(src, x)
        cases += c
        edge_cases += with_outcomes(
            nemo_edge_cases(src, xe)[1],
            lambda i: nemo_cases(src, xe, [NEMO_EDGE_VARIANTS[i]], EDGE_LENGTHS)[1][0],
            [_nemo_band(v) for v in NEMO_EDGE_VARIANTS],
            xe,
        )
    if a.areal:
        src = PeerSource(a.areal, "inclusionAI/AReaL")
        areal_peers, c = areal_cases(src, x)
        peers.update(areal_peers)
        cases += c
        peers["areal_m2po_steps"], c = areal_m2po_edge_cases(src, m2_sets)
        edge_cases += c
    if a.slime:
        src = PeerSource(a.slime, "THUDM/slime")
        peers["slime"], c = slime_cases(src, x)
        cases += c
        edge_cases += with_outcomes(
            slime_edge_cases(src, xe)[1],
            lambda i: slime_cases(src, xe, [SLIME_EDGE_VARIANTS[i]], EDGE_LENGTHS)[1][0],
            [("token", v[1], v[2]) for v in SLIME_EDGE_VARIANTS],
            xe,
        )
    if not cases:
        ap.error("give at least one of --nemo-rl, --areal, --slime")

    fixture = {
        "recorded_by": "tools/record_peer_mismatch.py",
        "torch_version": torch.__version__,
        "dtype": "float64 inputs; AReaL computes its behaviour weight in float32 (see notes)",
        "generator_seed": SEED,
        "inputs_design": (
            "B=4, T=7, prefix masks of lengths [7, 4, 1, 6]. log(pi_old/pi_b): seq 0 ~3e-4 "
            "(geo-mean inside [0.999, 1.002]); seq 1 has tokens at ratio ~0.30 and ~0.55, "
            "geo-mean ~0.66; seq 2 is one token at ratio e^2; seq 3 has one token at ratio ~5.5, "
            "geo-mean ~1.16. Padding carries log-ratio 2.5 and random values that must not "
            "matter. pi_theta/pi_old ~ exp(0.2 N(0,1)); advantages per token ~ N(0,1)."
        ),
        "edge_inputs_design": (
            "issue 45. Bounds: B=4, T=7, lengths [7, 2, 2, 6]; tokens (0, 2), (0, 5), (3, 1) have "
            "exp(ℓold − ℓb) == 2.0, 0.8, 1.25 exactly (torch float64) with d = ℓold − ℓb on the "
            "far side of log(bound); the 2-token rows 1 and 2 have NeMo-RL's geometric mean "
            "exp(Σd / (n + 1e-8)) == 1.002 and 0.8 exactly with the plain mean of d on the far "
            "side of log(bound). M2PO (T=16): two micro-batches with the large δ in the first; "
            "one micro-batch with a kept token at ρ ≈ 5.5; one with 8 interchangeable tokens "
            "tied at δ = 0.5 and k* = 2 inside the tie."
        ),
        "peers": peers,
        "cases": [c for c in cases if c["objective"] in ("icepop", "seq_mask_tis")],
        "m2po_cases": [c for c in cases if c["objective"] == "m2po"],
        "edge_cases": [c for c in edge_cases if c["objective"] in ("icepop", "seq_mask_tis")],
        "m2po_edge_cases": [c for c in edge_cases if c["objective"] == "m2po"],
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(fixture, indent=1) + "\n")
    for c in cases + edge_cases:
        print(f"{c['name']:42s} loss={c['loss']!r}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
