"""Embedded engine: sampling log-probs vs teacher forcing, truncation semantics, seeding, FP8
simulation, weight updates and parameter validation."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from megatron_p3o.rollout.embedded import (
    EmbeddedEngine,
    fp8_quant_dequant,
    max_abs_diff,
    sampling_logprobs,
)
from megatron_p3o.rollout.engine import check_behavior_semantics
from megatron_p3o.types import SamplingError, SamplingParams

PROMPTS = [[1, 2, 3, 4], [7, 8], [9, 10, 11, 12, 13, 14]]


@pytest.fixture(scope="module")
def hf_model():
    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m


def _engine(hf_model, precision):
    e = EmbeddedEngine(hf_model.config.to_dict(), precision)
    e.update_weights([list(hf_model.state_dict().items())], version=7)
    return e


@pytest.mark.parametrize("precision,tol", [("fp32", 1e-5), ("bf16", 5e-2), ("fp8", 5e-2)])
def test_sampling_logprobs_equal_teacher_forcing(hf_model, precision, tol):
    e = _engine(hf_model, precision)
    sp = SamplingParams(temperature=0.8, max_new_tokens=12, seed=1)
    samples = e.generate(PROMPTS, 2, sp)
    assert [s.group_id for s in samples] == [0, 0, 1, 1, 2, 2]
    assert all(s.weight_version == 7 and len(s.completion_ids) == 12 for s in samples)
    tf = e.score([s.prompt_ids for s in samples], [s.completion_ids for s in samples], sp)
    assert max_abs_diff([s.logprobs for s in samples], tf) < tol


def test_fp32_engine_matches_transformers_forward(hf_model):
    """The engine's fp32 log-probs are those of the plain transformers model at temperature T."""
    e = _engine(hf_model, "fp32")
    sp = SamplingParams(temperature=0.7, max_new_tokens=6, seed=2)
    s = e.generate([PROMPTS[0]], 1, sp)[0]
    ids = torch.tensor([s.prompt_ids + s.completion_ids])
    with torch.no_grad():
        logits = hf_model(ids).logits[0, len(s.prompt_ids) - 1 : -1].double()
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(s.completion_ids)[:, None])[
        :, 0
    ]
    assert (torch.tensor(s.logprobs, dtype=torch.float64) - ref).abs().max() < 1e-5


def test_lower_precisions_differ_measurably(hf_model):
    sp = SamplingParams(max_new_tokens=10, seed=4)
    ref = _engine(hf_model, "fp32")
    samples = ref.generate(PROMPTS, 1, sp)
    comp = [s.completion_ids for s in samples]
    base = ref.score(PROMPTS, comp, sp)
    diffs = {
        p: max_abs_diff(_engine(hf_model, p).score(PROMPTS, comp, sp), base)
        for p in ("bf16", "fp16", "fp8", "fp8_block")
    }
    assert all(d > 1e-5 for d in diffs.values()), diffs
    assert diffs["fp16"] < diffs["bf16"], diffs  # fp16 has 3 more mantissa bits


def test_seeded_sampling_is_reproducible(hf_model):
    e = _engine(hf_model, "bf16")
    sp = SamplingParams(max_new_tokens=8, seed=11)
    a, b = e.generate(PROMPTS, 2, sp), e.generate(PROMPTS, 2, sp)
    c = e.generate(PROMPTS, 2, SamplingParams(max_new_tokens=8, seed=12))
    assert [s.completion_ids for s in a] == [s.completion_ids for s in b]
    assert [s.completion_ids for s in a] != [s.completion_ids for s in c]


def test_shared_prefill_and_finished_rows_sample_as_a_plain_loop(hf_model, monkeypatch):
    """The engine prefills each distinct prompt once for its n samples and drops finished rows
    from later forwards (with their KV rows); neither may change what is sampled. Reference: a
    plain loop over the whole left-padded batch — every row, every step, no KV cache, the full
    sequences through transformers — drawing from the same generator."""
    temp, seed, n, max_new = 0.9, 7, 4, 8
    stop = tuple(range(0, 300, 3))  # a third of the vocabulary: rows stop at different steps
    e = _engine(hf_model, "fp32")
    ran, shrink = [], EmbeddedEngine._shrink

    def spy(self, held, stopped, cache):
        out = shrink(self, held, stopped, cache)
        ran.append(len(stopped) if out is None else len(out))
        return out

    monkeypatch.setattr(EmbeddedEngine, "_shrink", spy)
    sp = SamplingParams(temperature=temp, max_new_tokens=max_new, seed=seed, stop_token_ids=stop)
    got = e.generate(PROMPTS, n, sp)
    assert min(ran) < len(PROMPTS) * n, ran  # finished rows left the forwards
    rows = [list(p) for p in PROMPTS for _ in range(n)]
    gen = torch.Generator().manual_seed(seed)
    toks, lps, done = [[] for _ in rows], [[] for _ in rows], [False] * len(rows)
    with torch.no_grad():
        for _ in range(max_new):
            width = max(len(r) for r in rows)
            ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
            pos = (mask.cumsum(-1) - 1).clamp_min(0)
            z = hf_model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1]
            logp = torch.log_softmax(z.float() / temp, -1)
            tok = torch.multinomial(logp.exp(), 1, generator=gen)[:, 0].tolist()
            for i, t in enumerate(tok):
                if not done[i]:
                    toks[i].append(t)
                    lps[i].append(float(logp[i, t]))
                    done[i] = t in stop
                rows[i].append(0 if done[i] else t)
            if all(done):
                break
    lengths = {len(t) for t in toks}
    assert len(lengths) >= 3 and any(done) and not all(done), (lengths, done)  # rows did leave
    assert [s.completion_ids for s in got] == toks
    assert max_abs_diff([s.logprobs for s in got], lps) < 1e-5
    assert [s.finish_reason for s in got] == ["stop" if d else "length" for d in done]


def test_stop_tokens_end_a_completion(hf_model):
    e = _engine(hf_model, "fp32")
    free = e.generate(PROMPTS, 1, SamplingParams(max_new_tokens=10, seed=5))
    stop = free[0].completion_ids[3]
    s = e.generate(PROMPTS, 1, SamplingParams(max_new_tokens=10, seed=5, stop_token_ids=(stop,)))
    first = s[0].completion_ids
    assert s[0].finish_reason == "stop" and first[-1] == stop and stop not in first[:-1]
    assert len(first) <= 4


def test_truncated_distribution_logprobs():
    z = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    lp = sampling_logprobs(z, SamplingParams(temperature=1.0, top_k=2))
    ref = torch.log_softmax(torch.tensor([2.0, 1.0]), -1)
    assert torch.allclose(lp[0, :2], ref) and torch.isinf(lp[0, 2:]).all()
    p = torch.softmax(z, -1)[0]
    lp = sampling_logprobs(z, SamplingParams(top_p=float(p[0] + p[1] - 1e-3)))
    assert torch.isfinite(lp[0, :2]).all() and torch.isinf(lp[0, 2:]).all()
    assert abs(float(lp[0, :2].exp().sum()) - 1) < 1e-6


def test_fp8_simulation_rounds_like_e4m3():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 384, generator=g)
    q = fp8_quant_dequant(w)
    qb = fp8_quant_dequant(w, 128)
    rel = lambda a: float((a - w).norm() / w.norm())  # noqa: E731
    assert 1e-3 < rel(q) < 0.06 and 1e-3 < rel(qb) < 0.06
    assert rel(qb) <= rel(q)  # finer scales lose less
    scale = w.abs().max() / 448
    assert torch.equal(q, (w / scale).to(torch.float8_e4m3fn).float() * scale)


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(top_p=0.0), "top_p=0.0 must be in (0, 1]"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(max_new_tokens=0), "max_new_tokens=0"),
        (dict(temperature=0.0), "temperature=0.0"),
        (dict(top_k=-1), "top_k=-1"),
    ],
)
def test_bad_sampling_params(kw, needle):
    with pytest.raises(
        SamplingError, match=needle.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")
    ):
        SamplingParams(**kw)


def test_bad_n_and_missing_weights(hf_model):
    e = EmbeddedEngine(hf_model.config.to_dict(), "fp32")
    with pytest.raises(RuntimeError, match="no weights loaded"):
        e.generate(PROMPTS, 1, SamplingParams())
    e.update_weights([list(hf_model.state_dict().items())], 0)
    with pytest.raises(ValueError, match="n=0"):
        e.generate(PROMPTS, 0, SamplingParams())
    partial = [(k, v) for k, v in hf_model.state_dict().items() if "layers.1." not in k]
    with pytest.raises(ValueError, match="tensors were not sent"):
        e.update_weights([partial], 1)
    with pytest.raises(ValueError, match=r"shape \(3, 3\)"):
        e.update_weights([[("model.norm.weight", torch.zeros(3, 3))]], 1)


def test_behavior_semantics_are_enforced():
    from megatron_p3o.loss import build_objective

    p3o = build_objective("p3o")
    assert p3o.behavior_ratio and not build_objective("grpo").behavior_ratio
    check_behavior_semantics(SamplingParams(temperature=0.7), 0.7, p3o.behavior_ratio)
    with pytest.raises(SamplingError, match="temperature 0.7 != trainer temperature 1.0"):
        check_behavior_semantics(SamplingParams(temperature=0.7), 1.0, p3o.behavior_ratio)
    with pytest.raises(SamplingError, match="top_p=0.9"):
        check_behavior_semantics(SamplingParams(top_p=0.9), 1.0, p3o.behavior_ratio)
    check_behavior_semantics(SamplingParams(top_p=0.9), 1.0, build_objective("grpo").behavior_ratio)


def test_logit_noise_reports_the_perturbed_distribution(hf_model):
    """With ``logit_noise`` σ the engine samples from softmax((z + σε)/T) and reports exactly
    that distribution's log-probs: replayed here with plain transformers forwards and the same
    generator stream (ε draws interleaved with the multinomial draws)."""
    sigma, temp, seed = 0.5, 0.9, 3
    e = EmbeddedEngine(hf_model.config.to_dict(), "fp32", logit_noise=sigma)
    e.update_weights([list(hf_model.state_dict().items())], version=1)
    sp = SamplingParams(temperature=temp, max_new_tokens=8, seed=seed)
    s = e.generate([PROMPTS[2]], 1, sp)[0]
    gen = torch.Generator().manual_seed(seed)
    ids = list(s.prompt_ids)
    ref_lp, ref_tok = [], []
    with torch.no_grad():
        for _ in range(len(s.completion_ids)):
            z = hf_model(torch.tensor([ids])).logits[:, -1].float()
            z = z + sigma * torch.randn(z.shape, generator=gen)
            logp = torch.log_softmax(z / temp, -1)
            tok = int(torch.multinomial(logp.exp(), 1, generator=gen)[0, 0])
            ref_tok.append(tok)
            ref_lp.append(float(logp[0, tok]))
            ids.append(tok)
    assert s.completion_ids == ref_tok
    assert max(abs(a - b) for a, b in zip(s.logprobs, ref_lp)) < 1e-5
    # and the noise is a real mismatch against the clean model the trainer holds
    clean = e.score([s.prompt_ids], [s.completion_ids], sp)[0]
    assert sum(abs(a - b) for a, b in zip(s.logprobs, clean)) / len(clean) > 0.05


def test_fp8_activation_and_kv_rounding(hf_model):
    """Activations round per (token, 128 channels) to e4m3 (relative error ≤ 2⁻⁴ of each group's
    max, scale-invariant per group); w8a8 moves the engine further from fp32 than block weights
    alone, and the FP8 KV cache changes its log-probs again."""
    from megatron_p3o.rollout.embedded import fp8_activation_quant, fp8_kv_round

    x = torch.randn(3, 200) * torch.logspace(-3, 3, 200)
    q = fp8_activation_quant(x)
    for lo in (0, 128):
        g, gq = x[:, lo : lo + 128], q[:, lo : lo + 128]
        assert ((g - gq).abs() <= g.abs().amax(-1, keepdim=True) * 2**-4).all()
    assert torch.equal(fp8_activation_quant(x[:, :128] * 1024), q[:, :128] * 1024)
    assert fp8_kv_round(torch.tensor([1000.0, 0.1])).tolist()[0] == 448.0
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, seed=1)
    ref = _engine(hf_model, "fp32").generate(PROMPTS, 2, sp)
    comp = [s.completion_ids for s in ref]
    diffs, lps = {}, {}
    for name, kw in (("fp8_block", {}), ("fp8_w8a8", {}), ("fp8_w8a8+kv", {"fp8_kv_cache": True})):
        e = EmbeddedEngine(hf_model.config.to_dict(), name.split("+")[0], **kw)
        e.update_weights([list(hf_model.state_dict().items())], version=1)
        lps[name] = e.score([s.prompt_ids for s in ref], comp, sp)
        pairs = [(a, b) for x, y in zip(lps[name], ref) for a, b in zip(x, y.logprobs)]
        diffs[name] = sum(abs(a - b) for a, b in pairs) / len(pairs)
    assert diffs["fp8_block"] < diffs["fp8_w8a8"], diffs
    assert max_abs_diff(lps["fp8_w8a8+kv"], lps["fp8_w8a8"]) > 1e-3


def test_weight_rounding_serves_the_rounded_weights_exactly(hf_model):
    """``rollout.weight_rounding_step`` (issue 43's structured mismatch): the engine samples
    from transformers with every linear weight rounded per output channel to multiples of
    step · max|w_row| (written out here in float64), not from the trainer's weights; its ℓb
    are exact for that model, and the error is the same at every push of the same weights."""
    import copy

    step = 0.3
    e = EmbeddedEngine(hf_model.config.to_dict(), "fp32", weight_rounding_step=step)
    e.update_weights([list(hf_model.state_dict().items())], version=1)
    rounded = copy.deepcopy(hf_model)
    linears = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if p.dim() == 2 and name.rsplit(".", 2)[-2] in linears:
                w = p.double()
                unit = w.abs().max(dim=1, keepdim=True).values * step
                q = torch.round(w / unit) * unit
                assert (q - w).abs().max() <= 0.5 * unit.max() + 1e-12
                p.copy_(q)
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
    s = e.generate([PROMPTS[2]], 1, sp)[0]
    ids = torch.tensor([s.prompt_ids + s.completion_ids])
    with torch.no_grad():
        lr = torch.log_softmax(rounded(ids).logits[0, len(s.prompt_ids) - 1 : -1].double(), -1)
        lt = torch.log_softmax(hf_model(ids).logits[0, len(s.prompt_ids) - 1 : -1].double(), -1)
    tok = torch.tensor(s.completion_ids)[:, None]
    lb = torch.tensor(s.logprobs, dtype=torch.float64)
    assert (lb - lr.gather(-1, tok)[:, 0]).abs().max() < 1e-5  # the rounded model's ℓb
    assert (lb - lt.gather(-1, tok)[:, 0]).abs().max() > 1e-3  # not the trainer's
    e.update_weights([list(hf_model.state_dict().items())], version=2)  # the same push again
    again = e.score([s.prompt_ids], [s.completion_ids], sp)[0]
    assert max(abs(a - b) for a, b in zip(again, s.logprobs)) < 1e-5


def test_weight_rounding_is_refused_outside_the_embedded_engine():
    from pathlib import Path

    from megatron_p3o.config.loading import load_config
    from megatron_p3o.runtime.errors import ConfigError

    recipes = Path(__file__).resolve().parents[2] / "recipes"
    with pytest.raises(ConfigError, match="rollout.weight_rounding_step"):
        load_config(
            str(recipes / "tiny_cpu_sglang.yaml"), ["rollout.weight_rounding_step=0.3"]
        ).validate(1)
    with pytest.raises(ConfigError, match=r"rollout.weight_rounding_step=1.5 must be in \[0, 1\]"):
        load_config(str(recipes / "tiny_cpu.yaml"), ["rollout.weight_rounding_step=1.5"]).validate(
            1
        )
