"""Held-out evaluation in the trainer's precision scores the policy, not the injected mismatch:
a rollout engine with rounded weights or logit noise is bypassed for the noise-free evaluator
even when its precision is the trainer's (the v4 study's weight-rounding cells were scored
through the rounded fp32 engine before this)."""

from types import SimpleNamespace

import pytest

from megatron_p3o.rollout.backend import EmbeddedBackend, RolloutBackend


class _Clean:
    def generate(self, prompts, n, sampling):
        return ["clean"] * len(prompts)


def _backend(precision, rounding=0.0, noise=0.0):
    engine = SimpleNamespace(precision=precision, rounding_step=rounding, logit_noise=noise)

    class Rollout:  # the rollout engine's own path: refuse, so the test sees which was taken
        def __getattr__(self, name):
            raise AssertionError("evaluated through the rollout engine")

    b = SimpleNamespace(engine=engine, scheduler=Rollout(), _sync=lambda v: None,
                        _evaluator=lambda p, v: _Clean(), turns=None)  # fmt: skip
    b._generate = lambda *a: RolloutBackend._generate(b, *a)  # the real one, single-turn
    return b


@pytest.mark.parametrize("rounding,noise", [(0.3, 0.0), (0.0, 1.2)])
def test_an_injected_engine_is_bypassed_at_the_trainers_precision(rounding, noise):
    b = _backend("fp32", rounding, noise)
    assert EmbeddedBackend.evaluate(b, [[1], [2]], None, 3, "fp32") == ["clean", "clean"]


def test_another_precision_uses_the_evaluator_and_a_clean_engine_itself():
    assert EmbeddedBackend.evaluate(_backend("bf16"), [[1]], None, 3, "fp32") == ["clean"]
    with pytest.raises(AssertionError, match="through the rollout engine"):
        EmbeddedBackend.evaluate(_backend("fp32"), [[1]], None, 3, "fp32")
