"""Training inside :func:`megatron_p3o.runtime.cpu_shim.strict` (a CUDA request reaching torch
raises):
model construction, DDP, one packed P3O policy update (ESS pre-pass, global sums), AdamW steps
of the distributed optimizer with clipping, a distributed checkpoint save and load."""

from megatron_p3o.checkpoint.state import load_model_state, save_model_state
from megatron_p3o.model.forward import forward_backward
from megatron_p3o.runtime import cpu_shim
from megatron_p3o.update.optim import OptimConfig, build_optimizer, wrap_ddp, zero_grads

from . import bodies
from . import packing_bodies as pb


def strict_training(groups, family, init, out, dispatcher="allgather"):
    """Returns the gradient norms of two optimizer steps and, for the second one, the torch
    calls the strict mode saw and those that went through the shim's wrappers."""
    with cpu_shim.strict() as mode:
        pb.packed_step(groups, family, init, f"{out}/grads", dispatcher=dispatcher)
        chunks = bodies._build(family, groups, dispatcher=dispatcher)
        load_model_state(chunks, init)
        cfg = OptimConfig(lr=1e-3, clip_grad=1.0, distributed_optimizer=True)
        ddp = wrap_ddp(chunks, groups, cfg)
        opt = build_optimizer(ddp, groups, cfg)
        batch = bodies.make_batch(family)
        loss = bodies.nll_loss_fn(groups, bodies.FAMILIES[family]["vocab_size"],
                                  batch["loss_mask"].sum())  # fmt: skip

        def step():
            zero_grads(ddp, opt)
            forward_backward(ddp, groups, bodies._split_microbatches(batch, groups, 1), loss)
            ok, gnorm, _ = opt.step()
            assert ok
            return float(gnorm)

        norms = [step()]
        seen, calls = mode.seen, cpu_shim.CALLS
        norms.append(step())
        step_seen, step_calls = mode.seen - seen, cpu_shim.CALLS - calls
        save_model_state(chunks, f"{out}/ckpt")
        load_model_state(chunks, f"{out}/ckpt")
    return {"seen": step_seen, "shim_calls": step_calls, "norms": norms}


def meta_factories(groups):
    """Devices of tensors made inside ``with torch.device("meta")`` with the shim installed."""
    import torch

    with torch.device("meta"):
        made = [torch.tensor(1.0), torch.empty(2), torch.zeros(2), torch.arange(3), torch.ones(1)]
    return [t.device.type for t in made]
