"""GPU check (issue 42): every model family's local layer spec, forward and backward, on the
device; and the fused log-prob on the device against float64.

1. ``specs``: for each family the converter tests cover (llama with llama3 RoPE, qwen2 with QKV
   bias and tied embeddings, qwen3 with QK-norm, mistral, qwen3-moe, mixtral): a random tiny
   transformers model → Megatron checkpoint (checkpoints_convert) → Megatron's local spec on the
   device in fp32 (TF32 off). Forward: logits against transformers' on the same device.
   Backward: the gradient of the summed next-token log-likelihood w.r.t. the input embedding
   against transformers' autograd of the same loss; every parameter gets a finite gradient.
2. ``fused``: ``fused_vocab_parallel_logprobs`` (hidden states × output weight, the logits never
   whole) on the device at T tokens × V = 151,936: log-probs, entropy, log-partition and the
   gradients dh, dW against a float64 computation of the same inputs (fp32 inputs), and against
   the unfused kernel on the materialised logits (bf16 inputs: the same rounding steps).

``--device cpu`` runs the same on a small problem (a smoke test of this script). Writes
``specs.json`` in ``--out`` and one ``RESULT`` line; exit 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LOGIT_TOL = 2e-4  # fp32 on both sides, TF32 off; tests/distributed/test_convert.py: 1e-5 on CPU
GRAD_RTOL = 2e-3


def _nll(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, vocab: int):
    lp = torch.log_softmax(logits[..., :vocab].float(), -1)
    return -(lp.gather(-1, targets[..., None])[..., 0] * mask).sum()


def one_family(family: str, groups, device: torch.device, work: Path) -> dict:
    from megatron_p3o.checkpoint.state import load_model_state
    from megatron_p3o.model.builder import BuildOptions, build_model
    from megatron_p3o.model.forward import forward_backward, next_token_targets
    from megatron_p3o.model.hf.dist_stream import read_meta
    from tests.distributed.convert_bodies import SEQ, convert_hf, make_hf_model, prompt_ids

    hf = make_hf_model(family, work / f"{family}_hf")
    convert_hf(groups, str(work / f"{family}_hf"), str(work / f"{family}_ckpt"))
    vocab = hf.config.vocab_size
    ids = prompt_ids(vocab)
    targets = next_token_targets(ids)
    mask = torch.ones_like(ids, dtype=torch.float32)
    mask[:, -1] = 0

    hf = hf.to(device)
    emb = hf.get_input_embeddings().weight
    loss_ref = _nll(hf(ids.to(device)).logits, targets.to(device), mask.to(device), vocab)
    loss_ref.backward()
    ref_logits = hf(ids.to(device)).logits.detach().float()
    ref_grad = emb.grad.detach().clone()

    meta = read_meta(str(work / f"{family}_ckpt"))
    opts = BuildOptions(
        seq_length=SEQ,
        make_vocab_size_divisible_by=meta["make_vocab_size_divisible_by"],
        use_te=False,  # the local spec: TE cannot be carried to the lent GPU
    )
    chunks = build_model(meta["description"], groups, opts)
    load_model_state(chunks, str(work / f"{family}_ckpt"))
    got = {}

    def loss_fn(batch, logits):
        got["logits"] = logits.detach().float()
        loss = _nll(logits, batch["targets"], batch["loss_mask"], vocab)
        got["loss"] = loss.detach()
        return loss, int(batch["loss_mask"].sum()), {}

    batch = {"tokens": ids, "targets": targets, "loss_mask": mask}
    forward_backward(chunks, groups, [batch], loss_fn)
    model = chunks[0]
    grads = {n: p.grad for n, p in model.named_parameters()}
    missing = sorted(n for n, g in grads.items() if g is None or not torch.isfinite(g).all())
    g = model.embedding.word_embeddings.weight.grad[:vocab].float()
    logit_err = float((got["logits"][..., :vocab] - ref_logits).abs().max())
    grad_rel = float((g - ref_grad).norm() / ref_grad.norm())
    on_device = all(p.device.type == device.type for p in model.parameters())
    ok = logit_err < LOGIT_TOL and grad_rel < GRAD_RTOL and not missing and on_device
    return dict(
        ok=ok,
        max_abs_logit_diff=logit_err,
        embedding_grad_rel_err=grad_rel,
        loss=float(got["loss"]),
        loss_ref=float(loss_ref),
        params_without_finite_grad=missing,
        params_on_device=on_device,
        moe=meta["description"].is_moe,
    )


def fused_check(device: torch.device, tokens: int, vocab: int, hidden: int) -> dict:
    from megatron_p3o.logprob.fused import fused_vocab_parallel_logprobs
    from megatron_p3o.logprob.kernels import vocab_parallel_logprobs

    g = torch.Generator(device="cpu").manual_seed(0)
    h0 = torch.randn(tokens, hidden, generator=g) / hidden**0.25
    w0 = torch.randn(vocab, hidden, generator=g) / hidden**0.25
    y = torch.randint(0, vocab, (tokens,), generator=g)
    out = {"tokens": tokens, "vocab": vocab, "hidden": hidden}

    # fp32 inputs against float64
    h = h0.to(device).clone().requires_grad_(True)
    w = w0.to(device).clone().requires_grad_(True)
    t0 = time.perf_counter()
    lp, ent, lse = fused_vocab_parallel_logprobs(h, w, y.to(device), with_entropy=True,
                                                 with_lse=True)  # fmt: skip
    (lp.sum() + ent.sum()).backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    out["fp32_seconds"] = time.perf_counter() - t0
    h64 = h0.to(device, torch.float64).requires_grad_(True)
    w64 = w0.to(device, torch.float64).requires_grad_(True)
    z = h64 @ w64.T
    logp = torch.log_softmax(z, -1)
    lp64 = logp.gather(-1, y.to(device)[:, None])[:, 0]
    ent64 = -(logp.exp() * logp).sum(-1)
    (lp64.sum() + ent64.sum()).backward()
    lse64 = torch.logsumexp(z, -1)
    err = {
        "logprob": (lp.double() - lp64).abs().max(),
        "entropy": (ent.double() - ent64).abs().max(),
        "lse": (lse.double() - lse64).abs().max(),
        "dh_rel": (h.grad.double() - h64.grad).norm() / h64.grad.norm(),
        "dW_rel": (w.grad.double() - w64.grad).norm() / w64.grad.norm(),
    }
    out["fp32_vs_float64"] = {k: float(v) for k, v in err.items()}
    del z, logp, h64, w64
    ok = all(v < 1e-3 for v in out["fp32_vs_float64"].values())

    # bf16 inputs: fused against the unfused kernel on the materialised bf16 logits
    hb = h0.to(device, torch.bfloat16).requires_grad_(True)
    wb = w0.to(device, torch.bfloat16).requires_grad_(True)
    lpf, entf = fused_vocab_parallel_logprobs(hb, wb, y.to(device), with_entropy=True)
    (lpf.sum() + entf.sum()).backward()
    hu = h0.to(device, torch.bfloat16).requires_grad_(True)
    wu = w0.to(device, torch.bfloat16).requires_grad_(True)
    lpu, entu = vocab_parallel_logprobs(hu @ wu.T, y.to(device), with_entropy=True)
    (lpu.sum() + entu.sum()).backward()
    rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
    out["bf16_fused_vs_unfused"] = {
        "logprob": float((lpf - lpu).abs().max()),
        "entropy": float((entf - entu).abs().max()),
        "dh_rel": rel(hb.grad, hu.grad),
        "dW_rel": rel(wb.grad, wu.grad),
    }
    ok = ok and all(v < 2e-2 for v in out["bf16_fused_vs_unfused"].values())
    out["ok"] = ok
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--families", nargs="*", default=None, help="default: every family")
    a = ap.parse_args(argv)
    from megatron_p3o.runtime.quiet import silence_known_warnings

    silence_known_warnings()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from megatron_p3o.runtime.parallel import Layout, initialize
    from tests.distributed.convert_bodies import FAMILIES

    groups = initialize(Layout())
    device = torch.device(a.device)
    report = {"specs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for fam in a.families if a.families is not None else FAMILIES:
            try:
                report["specs"][fam] = one_family(fam, groups, device, Path(tmp))
            except Exception as e:  # recorded: one family's failure must not hide the others
                report["specs"][fam] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            print(fam, json.dumps(report["specs"][fam]), flush=True)
    big = a.device == "cuda"
    report["fused"] = fused_check(
        device,
        tokens=4096 if big else 64,
        vocab=151936 if big else 1000,
        hidden=1024 if big else 64,
    )
    print("fused", json.dumps(report["fused"]), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "specs.json").write_text(json.dumps(report, indent=2))
    specs_ok = sum(r["ok"] for r in report["specs"].values())
    ok = specs_ok == len(report["specs"]) and report["fused"]["ok"]
    print(f"RESULT specs_ok={specs_ok}/{len(report['specs'])} fused_ok={report['fused']['ok']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
