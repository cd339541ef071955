"""Export the live (sharded) Megatron model as HF-named tensors, in buckets, for rollout engines."""

from megatron_p3o.weight_sync.export import iter_hf_buckets, iter_hf_tensors

__all__ = ["iter_hf_tensors", "iter_hf_buckets"]
