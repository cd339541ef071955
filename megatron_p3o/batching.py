"""Samples → training micro-batches: ``[b, s]`` tensors aligned with next-token targets.

Position t of a sequence predicts token t+1, so completion token j (at sequence position
p + j, p = prompt length) is scored at position p + j − 1: there sit its target, its behaviour
log-prob, its advantage and a 1 in the loss mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

import torch

from .errors import DataError
from .model.forward import next_token_targets
from .types import Sample


@dataclass(frozen=True)
class BatchConfig:
    """Attributes:
    prompts_per_rollout: prompts per rollout batch (× n_samples sequences).
    minibatches: optimizer steps per rollout batch.
    epochs: passes over the rollout batch.
    micro_batch_size: sequences per micro-batch per DP rank.
    """

    prompts_per_rollout: int = 64
    minibatches: int = 1
    epochs: int = 1
    micro_batch_size: int = 4


def samples_to_microbatches(
    samples: Sequence[Sample],
    advantages: torch.Tensor,
    seq_length: int,
    micro_batch_size: int,
    pad_id: int = 0,
    first_index: int = 0,
) -> List[Dict[str, torch.Tensor]]:
    """Pack samples (in order) into micro-batches of ``micro_batch_size`` sequences."""
    if len(samples) % micro_batch_size:
        raise ValueError(
            f"{len(samples)} samples do not split into micro-batches of {micro_batch_size}"
        )
    n = len(samples)
    tokens = torch.full((n, seq_length), pad_id, dtype=torch.long)
    mask = torch.zeros(n, seq_length)
    blp = torch.zeros(n, seq_length)
    adv = torch.zeros(n, seq_length)
    for i, s in enumerate(samples):
        seq = s.prompt_ids + s.completion_ids
        if len(seq) > seq_length:
            raise DataError(
                f"sample {first_index + i} (prompt group {s.group_id}) has {len(seq)} tokens "
                f"> model.seq_length={seq_length}; raise seq_length or lower max_new_tokens"
            )
        tokens[i, : len(seq)] = torch.tensor(seq)
        p, c = len(s.prompt_ids), len(s.completion_ids)
        if c:
            mask[i, p - 1 : p - 1 + c] = 1.0
            blp[i, p - 1 : p - 1 + c] = torch.tensor(s.logprobs)
            adv[i, p - 1 : p - 1 + c] = float(advantages[i])
    out = []
    for k in range(0, n, micro_batch_size):
        sl = slice(k, k + micro_batch_size)
        t = tokens[sl]
        out.append(
            {
                "tokens": t,
                "targets": next_token_targets(t, pad_id),
                "loss_mask": mask[sl],
                "behavior_logprobs": blp[sl],
                "advantages": adv[sl],
                "sample_index": torch.arange(first_index + k, first_index + k + t.shape[0]),
            }
        )
    return out
