"""Rank bodies and fixtures for the HF ↔ Megatron conversion tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_p3o.checkpoint.state import load_model_state, save_model_state
from megatron_p3o.model.builder import BuildOptions, build_model
from megatron_p3o.model.forward import forward_backward, next_token_targets
from megatron_p3o.model.hf.dist_stream import P3O_META_FILE, read_meta

SEQ = 16

FAMILIES = {
    # untied, GQA, odd vocab, llama3 rope scaling, single safetensors file
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            vocab_size=301,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8,
            },
        ),
    ),
    # QKV bias, tied
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(vocab_size=259, tie_word_embeddings=True)),
    # QK-norm, head_dim ≠ hidden / heads, untied
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(vocab_size=317, head_dim=24, tie_word_embeddings=False),
    ),
    # mixture of experts: 4 experts, top-2, normalized top-k; QK-norm
    "qwen3moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            vocab_size=290,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
    ),  # fmt: skip
    # mixture of experts, Mixtral's names (w1/w3/w2, block_sparse_moe)
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            vocab_size=300,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=None,
            tie_word_embeddings=False,
        ),
    ),  # fmt: skip
    # sharded safetensors with an index
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(vocab_size=300, sliding_window=None, tie_word_embeddings=False),
    ),
}


def make_hf_model(family: str, out: Path, seed: int = 0):
    import transformers

    cfg_name, cls_name, kw = FAMILIES[family]
    cfg = getattr(transformers, cfg_name)(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **kw,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(out, max_shard_size="200KB" if family == "mistral" else "1GB")
    return model


def prompt_ids(vocab: int, n: int = 2, seq: int = SEQ, seed: int = 1):
    return torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))


def convert_hf(groups, hf_dir: str, out: str, tp: int = 1):
    from checkpoints_convert.hf_to_megatron import convert

    return convert(hf_dir, out, tp=tp, groups=groups, progress=False)


def export_hf(groups, ckpt: str, out: str, max_shard_bytes: int = 2**30):
    from checkpoints_convert.megatron_to_hf import convert

    return convert(ckpt, out, groups=groups, max_shard_bytes=max_shard_bytes, progress=False)


def _load(groups, ckpt):
    meta = read_meta(ckpt)
    chunks = build_model(
        meta["description"],
        groups,
        BuildOptions(
            seq_length=SEQ, make_vocab_size_divisible_by=meta["make_vocab_size_divisible_by"]
        ),
    )
    load_model_state(chunks, ckpt)
    return meta, chunks


def ckpt_logits(groups, ckpt: str, ids):
    """Full logits ``[b, s, V]`` of the checkpoint loaded at this layout (None off the last
    stage)."""
    meta, chunks = _load(groups, ckpt)
    for c in chunks:  # inference (MoE layers refuse TP without sequence parallelism in training)
        c.eval()
    got = []

    def loss_fn(batch, logits):
        got.append(logits.detach().clone())
        return torch.zeros(()), 0, {}

    batch = {
        "tokens": ids,
        "targets": next_token_targets(ids),
        "loss_mask": torch.ones_like(ids).float(),
    }
    with torch.no_grad():
        forward_backward(chunks, groups, [batch], loss_fn, forward_only=True)
    if not got:
        return None
    shard = got[0]
    if groups.layout.tp > 1:
        parts = [torch.empty_like(shard) for _ in range(groups.layout.tp)]
        torch.distributed.all_gather(parts, shard.contiguous(), group=groups.tp)
        shard = torch.cat(parts, -1)
    return shard[..., : meta["description"].vocab_size]


def resave_at_layout(groups, ckpt: str, out: str):
    """Load at this layout and save a new checkpoint from it (a checkpoint 'written at TP=2')."""
    meta, chunks = _load(groups, ckpt)
    payload = json.loads((Path(ckpt) / P3O_META_FILE).read_text())
    save_model_state(chunks, out, extra_files={P3O_META_FILE: payload})


def live_full(groups, ckpt: str):
    """``TrainerWeights.full()``: every HF tensor on every rank (the embedded engine's view)."""
    from megatron_p3o.weight_sync.source import TrainerWeights

    meta, chunks = _load(groups, ckpt)
    return dict(TrainerWeights(chunks, groups, meta["description"]).full())


def live_rank0(groups, ckpt: str):
    """``TrainerWeights.to_rank0()``: the stream a central SGLang server is pushed from."""
    from megatron_p3o.weight_sync.source import TrainerWeights

    meta, chunks = _load(groups, ckpt)
    return {n: t.clone() for n, t in TrainerWeights(chunks, groups, meta["description"]).to_rank0()}


def engine_logits(groups, ckpt: str, ids, precision: str = "fp32"):
    """Logits of an embedded engine fed by ``TrainerWeights.full()`` at this layout."""
    from megatron_p3o.model.description import description_to_hf_config
    from megatron_p3o.rollout.embedded import EmbeddedEngine
    from megatron_p3o.weight_sync.source import TrainerWeights

    meta, chunks = _load(groups, ckpt)
    desc = meta["description"]
    engine = EmbeddedEngine(description_to_hf_config(desc), precision)
    engine.update_weights([TrainerWeights(chunks, groups, desc).full()], 1)
    with torch.no_grad():
        return engine.model(input_ids=ids).logits.float()


def live_export(groups, ckpt: str):
    from megatron_p3o.weight_sync import iter_hf_buckets, iter_hf_tensors

    meta, chunks = _load(groups, ckpt)
    out, sizes, counts = {}, [], []
    for bucket in iter_hf_buckets(iter_hf_tensors(chunks, groups, meta["description"]), 40_000):
        sizes.append(sum(t.numel() * t.element_size() for _, t in bucket))
        counts.append(len(bucket))
        out.update({k: v.clone() for k, v in bucket})
    return {
        "tensors": out,
        "bucket_bytes": sizes,
        "bucket_counts": counts,
        "tp_rank": groups.tp_rank,
        "pp_rank": groups.pp_rank,
    }


def convert_failing_midway(groups, hf_dir: str, out: str, fail_at: int = 6):
    """Reading fails at the ``fail_at``-th tensor, after chunks were written: the error
    propagates and nothing is left behind."""
    from megatron_p3o.model.hf import safetensors_io

    orig = safetensors_io.HFCheckpointReader.get
    calls = {"n": 0}

    def flaky(self, name):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise OSError(f"simulated read failure at {name}")
        return orig(self, name)

    safetensors_io.HFCheckpointReader.get = flaky
    try:
        convert_hf(groups, hf_dir, out)
    except Exception as e:  # noqa: BLE001 - the test inspects the message
        return {"error": f"{type(e).__name__}: {e}", "reads": calls["n"]}
    finally:
        safetensors_io.HFCheckpointReader.get = orig
    return None


def run_verify(groups, hf_dir: str, ckpt: str):
    from checkpoints_convert.verify import verify

    return verify(hf_dir, ckpt, seq=SEQ, prompts=2)


def te_shaped_load(groups, ckpt: str):
    """A model with Transformer Engine's ``_extra_state`` (FP8 metadata) loads a local-spec
    checkpoint, which has none; a model needing a tensor the checkpoint lacks is refused."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    from megatron_p3o.checkpoint.state import load_into, load_sharded, sharded_model_state
    from megatron_p3o.runtime.errors import CheckpointError

    meta = read_meta(ckpt)
    opts = BuildOptions(
        seq_length=SEQ, make_vocab_size_divisible_by=meta["make_vocab_size_divisible_by"]
    )
    chunks = build_model(meta["description"], groups, opts)

    class Fp8Meta(torch.nn.Module):  # what a TE layer adds to its state: an _extra_state
        def get_extra_state(self):
            return torch.tensor([7.0])

        def set_extra_state(self, state):
            self.restored = state

    chunks[0].add_module("te_probe", Fp8Meta())
    key = "te_probe._extra_state"
    request = sharded_model_state(chunks)
    request["model0"][key] = ShardedObject(key, None, (1,), (0,), replica_id=0)
    loaded = load_sharded(request, ckpt)
    load_into(chunks[0], loaded["model0"], ckpt)
    out = {"extra_absent": key not in loaded["model0"], "loaded": len(loaded["model0"])}
    request = sharded_model_state(chunks)
    request["model0"]["decoder.extra.weight"] = ShardedTensor.from_rank_offsets(
        "decoder.extra.weight", torch.zeros(2), replica_id=0
    )
    try:
        load_sharded(request, ckpt)
        out["refused"] = None
    except CheckpointError as e:
        out["refused"] = str(e)
    return out
