"""Issue 24, item 11: ``optim.moments_dtype`` reaches Megatron's ``OptimizerConfig`` through its
constructor, so ``__post_init__`` derives what depends on it (setting the field afterwards left
``use_precision_aware_optimizer_no_fp8_or_ds_fp8`` False: the distributed optimizer then kept
fp32 moments and read ``param.grad`` instead of the decoupled grads). Transformer Engine's
FusedAdam, which the derivation inspects, is replaced by a stand-in with its signature: TE
cannot be installed on this machine."""

import sys
import types

import pytest
import torch

from megatron_p3o.runtime import mcore_compat
from megatron_p3o.update.optim import OptimConfig, optimizer_config


@pytest.fixture
def te_fused_adam(monkeypatch):
    class FusedAdam:  # the keyword arguments Megatron checks for
        def __init__(self, params, master_weight_dtype=None, exp_avg_dtype=None,
                     exp_avg_sq_dtype=None, use_decoupled_grad=False):  # fmt: skip
            pass

    te = types.ModuleType("transformer_engine")
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    te.pytorch.optimizers = types.ModuleType("transformer_engine.pytorch.optimizers")
    te.pytorch.optimizers.FusedAdam = FusedAdam
    mods = {
        "transformer_engine": te,
        "transformer_engine.pytorch": te.pytorch,
        "transformer_engine.pytorch.optimizers": te.pytorch.optimizers,
    }
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    import megatron.core.optimizer.optimizer_config as oc

    monkeypatch.setattr(oc, "is_te_min_version", lambda v, *a, **k: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mcore_compat, "have_transformer_engine", lambda: True)


def test_precision_aware_fields_are_derived(te_fused_adam):
    cfg = OptimConfig(moments_dtype="bfloat16", distributed_optimizer=True)
    ocfg = optimizer_config(cfg, torch.bfloat16)
    assert ocfg.use_precision_aware_optimizer is True
    assert ocfg.use_precision_aware_optimizer_no_fp8_or_ds_fp8 is True  # the derived flag
    assert ocfg.exp_avg_dtype == ocfg.exp_avg_sq_dtype == torch.bfloat16
    assert ocfg.bf16 and ocfg.params_dtype == torch.bfloat16


def test_fp32_moments_leave_the_precision_aware_optimizer_off():
    ocfg = optimizer_config(OptimConfig(), torch.float32)
    assert not ocfg.use_precision_aware_optimizer
    assert not ocfg.use_precision_aware_optimizer_no_fp8_or_ds_fp8
