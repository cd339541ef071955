"""The rollout-engine interface, and the check that behaviour log-probs mean what P3O assumes.

Engines: :class:`~megatron_p3o.rollout.embedded.EmbeddedEngine` (transformers on CPU, in a chosen
precision) and the SGLang server engine (GPU).
"""

from __future__ import annotations

import abc
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

from megatron_p3o.types import Sample, SamplingError, SamplingParams

Bucket = List[Tuple[str, torch.Tensor]]


class RolloutEngine(abc.ABC):
    """generate / update_weights / health, usable as a context manager (start/stop)."""

    name = "engine"

    @abc.abstractmethod
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        keys: Optional[Sequence[str]] = None,
    ) -> List[Sample]:
        """``n`` completions of each prompt (``group_id`` = prompt index). ``keys``: a routing
        key per prompt (multi-turn: every turn of a trajectory carries its prompt's, so a router
        sends it to the server that holds its prefix); engines without a router ignore it."""

    def generate_turn(
        self, ids: Sequence[int], sampling: SamplingParams, key: Optional[str] = None
    ) -> Sample:
        """One completion of ``ids``: one turn of a multi-turn trajectory (an engine that can
        abort a request returns ``finish_reason`` "abort" instead of raising)."""
        return self.generate([ids], 1, sampling, None if key is None else [key])[0]

    def turn_server(self, slots: int, max_len: int):
        """The multi-turn loop's access to this engine (:mod:`.turn_server`): ``slots``
        trajectories at once, sequences up to ``max_len`` tokens. By default each turn is one
        :meth:`generate_turn` call from a pool of ``slots`` threads."""
        from megatron_p3o.rollout.turn_server import ThreadedTurnServer

        return ThreadedTurnServer(self, slots)

    @abc.abstractmethod
    def update_weights(self, buckets: Iterable[Bucket], version: int) -> None:
        """Load HF-named tensors (buckets from ``weight_sync``) and set the weight version."""

    @abc.abstractmethod
    def health(self) -> dict:
        """A dict with at least ``ok`` (bool) and ``weight_version``."""

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any trainer rank (engines shared by ranks make this a
        collective, so that all ranks take the same dynamic-sampling rounds)."""
        return flag

    def start(self) -> "RolloutEngine":
        return self

    def stop(self) -> None:  # noqa: B027 - engines without resources need no teardown
        pass

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False


def check_behavior_semantics(
    sampling: SamplingParams,
    trainer_temperature: float,
    behavior_ratio: bool,
    allow_truncation: bool = False,
) -> None:
    """Refuse engine/trainer settings under which ℓb is not the log-prob the objective assumes.

    The trainer computes ℓθ from logits / T over the full vocabulary. The engine's ℓb must be
    taken at the same T; top-p/top-k change the sampled distribution, so for objectives whose
    ratio is against πb (``Objective.behavior_ratio``: P3O, P4O) they must be off unless the
    trainer applies the same truncation (``allow_truncation``).
    """
    if abs(sampling.temperature - trainer_temperature) > 1e-9:
        raise SamplingError(
            f"engine temperature {sampling.temperature} != trainer temperature "
            f"{trainer_temperature}: behaviour log-probs would come from another distribution"
        )
    if sampling.truncated and behavior_ratio and not allow_truncation:
        raise SamplingError(
            "the objective takes its ratio against the engine's log-probs, but "
            f"top_p={sampling.top_p} / top_k={sampling.top_k} truncate the sampled distribution "
            "and the trainer does not: disable them (top_p=1, top_k=0)"
        )
