"""GPU benchmarks for ``tools/gpu_check.sh``, side by side in one process.

    python benchmarks/bench_gpu.py logprob --tokens 8192 --vocab 151936 --out DIR
    python benchmarks/bench_gpu.py mfu --hidden 2048 --layers 16 --seq 2048 --out DIR

``logprob``: the training path of ``vocab_parallel_logprobs`` (in-place backward; with and without
the entropy) against Megatron's ``vocab_parallel_cross_entropy`` on the same bf16 logits
``[T, V]``, forward + backward: median time, peak memory above the inputs
(``torch.cuda.max_memory_allocated``), their ratios, and the fraction of HBM bandwidth achieved
(bytes the kernel must move at least — read the logits forward and backward, write the gradient —
over time, against ``--hbm-tbs``, 4.8 TB/s for an H200).

``mfu``: forward + backward of a ~1B-parameter Llama-style GPTModel (local spec, bf16) on one GPU:
tokens/s and model FLOPs utilisation, 6·N·tokens (+ attention 12·L·s·h per token) over the
chip's bf16 dense peak (``--peak-tflops``, 790 for an H200).

Each writes ``DIR/<name>.json`` and prints one ``RESULT`` line. ``--device cpu`` runs the same
code at small sizes for a smoke test (no ratios worth reading).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_reset(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    return 0


def _peak(device, base):
    return (torch.cuda.max_memory_allocated(device) - base) if device.type == "cuda" else 0


def _time(fn, device, reps):
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_logprob(a, device, groups) -> dict:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_p3o.logprob.kernels import vocab_parallel_logprobs

    g = torch.Generator(device=device).manual_seed(0)
    base = torch.randn(a.tokens, a.vocab, generator=g, device=device, dtype=torch.bfloat16)
    tgt = torch.randint(0, a.vocab, (a.tokens,), generator=g, device=device)

    def ours(entropy):
        def run():
            x = base.clone().requires_grad_(True)
            lp, ent = vocab_parallel_logprobs(
                x, tgt, None, with_entropy=entropy, inplace_backward=True
            )
            loss = lp.sum() + (ent.sum() if ent is not None else 0)
            loss.backward()

        return run

    def megatron():
        x = base.clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(x[None], tgt[None]).sum()  # its global TP group
        loss.backward()

    out = {}
    for name, fn in (("ours", ours(False)), ("ours_entropy", ours(True)), ("megatron", megatron)):
        fn()  # warm-up (kernels, allocator)
        b = _peak_reset(device)
        fn()
        out[f"{name}_peak_gib"] = _peak(device, b) / 2**30
        out[f"{name}_ms"] = 1e3 * _time(fn, device, a.reps)
    # least traffic: the bf16 logits read twice (forward, backward) and the gradient written once
    # (the clone of the inputs is part of every variant and excluded from the minimum)
    min_bytes = 3 * a.tokens * a.vocab * 2
    out["hbm_fraction_ours"] = min_bytes / (out["ours_ms"] / 1e3) / (a.hbm_tbs * 1e12)
    out["time_ratio"] = out["ours_ms"] / out["megatron_ms"]
    out["time_ratio_entropy"] = out["ours_entropy_ms"] / out["megatron_ms"]
    if out["megatron_peak_gib"] > 0:
        out["peak_ratio"] = out["ours_peak_gib"] / out["megatron_peak_gib"]
    out.update(tokens=a.tokens, vocab=a.vocab, dtype="bfloat16", device=str(device))
    return out


def bench_mfu(a, device, groups) -> dict:
    from megatron_p3o.model.builder import BuildOptions, build_model
    from megatron_p3o.model.description import ModelDescription
    from megatron_p3o.model.forward import forward_backward, next_token_targets

    desc = ModelDescription.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": a.vocab,
            "hidden_size": a.hidden,
            "intermediate_size": a.ffn,
            "num_hidden_layers": a.layers,
            "num_attention_heads": a.heads,
            "num_key_value_heads": a.heads,
            "max_position_embeddings": a.seq,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
        }
    )
    chunks = build_model(
        desc,
        groups,
        BuildOptions(params_dtype=torch.bfloat16, seq_length=a.seq, use_te=False),
    )
    n_params = sum(p.numel() for c in chunks for p in c.parameters())
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, a.vocab, (a.mbs, a.seq), generator=g)
    mbs = [{"tokens": tokens, "targets": next_token_targets(tokens)} for _ in range(a.micro)]

    def loss_fn(batch, logits):
        loss = logits.float().logsumexp(-1).mean() / a.micro  # a stand-in loss over the logits
        return loss, batch["tokens"].numel(), {}

    def step():
        for c in chunks:
            c.zero_grad(set_to_none=True)
        forward_backward(chunks, groups, mbs, loss_fn)

    step()  # warm-up
    b = _peak_reset(device)
    dt = _time(step, device, a.reps)
    toks = a.mbs * a.seq * a.micro
    flops_per_token = 6 * n_params + 12 * a.layers * a.seq * a.hidden
    tok_s = toks / dt
    return {
        "params_b": n_params / 1e9,
        "tokens_per_step": toks,
        "step_s": dt,
        "tokens_per_s": tok_s,
        "tflops": flops_per_token * tok_s / 1e12,
        "mfu": flops_per_token * tok_s / (a.peak_tflops * 1e12),
        "peak_gib": _peak(device, b) / 2**30,
        "hidden": a.hidden,
        "layers": a.layers,
        "seq": a.seq,
        "device": str(device),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("which", choices=["logprob", "mfu"])
    ap.add_argument("--out", default="gpu_bench")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hbm-tbs", type=float, default=4.8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    a = ap.parse_args(argv)
    from megatron_p3o.runtime.parallel import Layout, initialize
    from megatron_p3o.runtime.quiet import silence_known_warnings

    silence_known_warnings()
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device (use --device cpu for a smoke test)", file=sys.stderr)
        return 2
    groups = initialize(Layout())
    res = (bench_logprob if a.which == "logprob" else bench_mfu)(a, device, groups)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.which}.json").write_text(json.dumps(res, indent=2))
    print("RESULT " + " ".join(f"{k}={v:.4g}" for k, v in res.items() if isinstance(v, float)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
