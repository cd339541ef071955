"""Make Megatron-Core run on a machine without CUDA (gloo backend).

Why this exists: Megatron-Core hard-codes CUDA devices (``torch.cuda.current_device()`` is used as
a device at ~175 call sites, ``device="cuda"`` factory arguments, ``.cuda()`` calls, CUDA RNG
states, ``torch.cuda.synchronize``). Our CI and developer machines have no GPU, yet every parallel
layout (TP, PP, VPP, CP, DP, distributed optimizer, dist checkpointing) must be tested there. The
shim below redirects those CUDA touches to the CPU. It is installed by
:func:`megatron_p3o.runtime.parallel.initialize` **only when CUDA is unavailable**; on a GPU
machine it is
never active, so nothing here can change cluster behaviour.

What it patches (see ``shared/docs/megatron-on-cpu.md`` for the measurements behind each):

A. ``torch.cuda.current_device`` returns the CPU device.
B. Megatron's CUDA RNG tracker is replaced by one that forks the CPU generator
   (``DotProductAttention`` forks it even with dropout 0).
C. Where CUDA devices are *requested*, and only there: the tensor factories (``torch.empty``,
   ``zeros``, ``tensor``, … and ``Tensor.new_*``) and ``Tensor.to`` rewrite a CUDA ``device``
   to the CPU and drop ``pin_memory``; ``Tensor.cuda``/``pin_memory`` return the tensor,
   ``is_pinned`` is False, and ``Tensor.type()`` reports ``torch.cuda.*Tensor`` names (the
   distributed optimizer checks them); ``torch.cuda.synchronize`` is a no-op. Every other torch
   call (the matmuls, softmaxes and adds of forward, backward and the optimizer step) runs
   untouched: an earlier ``TorchFunctionMode`` saw every call (~52,000 per tiny-recipe step,
   ~40 % of the step's time). :func:`strict` is the proof that nothing slips past: a mode that
   fails loudly when a CUDA request reaches torch (``tests/distributed/test_cpu_shim.py`` runs
   training steps of every layout inside it). ``CALLS`` counts the shim's calls.
D. CUDA streams (the MoE ``alltoall`` token dispatcher copies its split sizes to the host on a
   side stream): ``torch.cuda.Stream()`` and ``current_stream()`` are one no-op stand-in (so the
   dispatcher sees itself on the current stream and records nothing), events are no-op
   stand-ins, ``torch.cuda.stream(s)`` an empty context. Its host copy of the split sizes
   (``moe_utils.maybe_move_tensor_to_cpu(as_numpy=True)``) converts only CUDA tensors, so on
   CPU the sizes would stay tensors, which ``all_to_all_single`` refuses: CPU tensors asked for
   as numpy become numpy.
E. ``dist.all_gather`` of tensors of different first-dimension sizes (the alltoall dispatcher's
   expert-TP gather): NCCL accepts it, gloo does not; it is padded to the largest size, gathered
   and cut back (only when the sizes differ; equal sizes take gloo's own path untouched).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False
_CPU = torch.device("cpu")


def _is_cuda_device(dev) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return False


# -- C: CUDA device requests, rewritten where they are made ------------------------------------
FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "as_tensor", "asarray", "arange", "range",
    "linspace", "logspace", "eye", "rand", "randn", "randint", "randperm", "normal",
    "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
    "randint_like", "empty_strided", "scalar_tensor", "tril_indices", "triu_indices",
)  # fmt: skip
TENSOR_FACTORIES = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")
CALLS = 0  # calls that went through the shim's wrappers (the whole of its hot-path cost)


def _device_kwargs(fn):
    """``fn`` with a CUDA ``device=`` keyword made the CPU and ``pin_memory`` dropped."""

    @functools.wraps(fn)
    def shim(*args, **kwargs):
        global CALLS
        CALLS += 1
        if kwargs:
            if _is_cuda_device(kwargs.get("device")):
                kwargs["device"] = _CPU
            kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return shim


def _to(orig):
    @functools.wraps(orig)
    def to(self, *args, **kwargs):
        global CALLS
        CALLS += 1
        if args and _is_cuda_device(args[0]):
            args = (_CPU,) + args[1:]
        if kwargs and _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        return orig(self, *args, **kwargs)

    return to


def _type(orig):
    @functools.wraps(orig)
    def type_(self, *args, **kwargs):
        if args or kwargs:
            return orig(self, *args, **kwargs)
        name = orig(self)
        return name if "cuda" in name else name.replace("torch.", "torch.cuda.", 1)

    return type_


def _same(self, *_, **__):
    return self


def _install_device_rewrites() -> None:
    from torch.utils import _device

    # ``with torch.device("meta"):`` (transformers builds models under it) gives a device to the
    # factories in a set made on first use: made now, it holds torch's own functions, which the
    # wrappers call (made later, it would hold the wrappers, which the mode never sees, and
    # torch.tensor would leave the meta context: transformers' RoPE buffers came out garbage)
    _device._device_constructors()
    for name in FACTORIES:
        if hasattr(torch, name):
            setattr(torch, name, _device_kwargs(getattr(torch, name)))
    T = torch.Tensor
    for name in TENSOR_FACTORIES:
        setattr(T, name, _device_kwargs(getattr(T, name)))
    T.to = _to(T.to)
    T.type = _type(T.type)
    T.cuda = T.pin_memory = _same
    T.is_pinned = lambda self, *_, **__: False


class _Strict(TorchFunctionMode):
    """Fails loudly when a CUDA device request reaches torch past the shim; counts the torch
    calls it sees (``seen``)."""

    def __init__(self):
        super().__init__()
        self.seen = 0

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        self.seen += 1
        kwargs = kwargs or {}
        cuda = _is_cuda_device(kwargs.get("device")) or kwargs.get("pin_memory") is True
        name = getattr(func, "__name__", "")
        if name in ("cuda", "pin_memory") or (
            name == "to" and args[1:2] and _is_cuda_device(args[1])
        ):
            cuda = True
        if cuda:
            raise RuntimeError(f"cpu_shim.strict: a CUDA request reached torch: {func}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def strict():
    """Inside: any CUDA device request that reaches torch raises; yields the mode (``.seen``)."""
    with _Strict() as mode:
        yield mode


class _CpuRNGStatesTracker:
    """Shim B: named RNG streams over the CPU generator, mirroring ``CudaRNGStatesTracker``."""

    def __init__(self, *_, **__):
        self.reset()

    def reset(self):
        self._is_initialized = False
        self.states_ = {}
        self.seeds_ = set()

    def is_initialized(self):
        return self._is_initialized

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = states

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"RNG seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"RNG state {name} already exists")
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"RNG state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


class _Event:
    """Shim D: a CUDA event that is always complete."""

    def __init__(self, *_, **__):
        pass

    def synchronize(self):
        pass

    def wait(self, *_):
        pass

    def record(self, *_):
        pass

    def query(self):
        return True


class _Done:
    """Shim E: the handle of a collective that has already completed."""

    def wait(self, *_):
        return True

    def is_completed(self):
        return True


class _Stream:
    """Shim D: the one stream of a CPU process (``Stream()`` is the current stream)."""

    _one = None

    def __new__(cls, *_, **__):
        if cls._one is None:
            cls._one = super().__new__(cls)
        return cls._one

    def synchronize(self):
        pass

    def wait_stream(self, *_):
        pass

    def wait_event(self, *_):
        pass

    def record_event(self, *_):
        return _Event()


def install() -> bool:
    """Install shims A–D once per process. Returns False (and does nothing) with CUDA."""
    global _INSTALLED
    if torch.cuda.is_available():
        return False
    if _INSTALLED:
        return True
    from megatron.core.tensor_parallel import random as mrandom

    # A: current_device is used as a device argument throughout Megatron-Core.
    torch.cuda.current_device = lambda: _CPU
    torch.cuda.synchronize = lambda *a, **k: None
    # D: one stand-in for every stream (the current one and any side stream). Classes, not
    # functions: libraries use ``torch.cuda.Stream`` in type annotations.
    torch.cuda.Stream, torch.cuda.Event = _Stream, _Event
    torch.cuda.current_stream = lambda *a, **k: _Stream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    # B: a CPU RNG tracker in place of the CUDA one.
    tracker_cls = type(
        "CpuRNGStatesTracker", (_CpuRNGStatesTracker, mrandom.CudaRNGStatesTracker), {}
    )
    mrandom.CudaRNGStatesTracker_orig = mrandom.CudaRNGStatesTracker
    mrandom.CudaRNGStatesTracker = tracker_cls
    mrandom._CUDA_RNG_STATE_TRACKER = tracker_cls()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    move = moe_utils.maybe_move_tensor_to_cpu

    def to_host(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = to_host
    token_dispatcher.maybe_move_tensor_to_cpu = to_host
    # E: uneven all_gather on gloo.
    import torch.distributed as dist

    gather = dist.all_gather

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if all(t.shape == tensor.shape for t in tensor_list):
            return gather(tensor_list, tensor, group=group, async_op=async_op)
        n = max(t.shape[0] for t in tensor_list)
        rest = tuple(tensor.shape[1:])
        bufs = [tensor.new_empty((n,) + rest) for _ in tensor_list]
        mine = tensor.new_zeros((n,) + rest)
        mine[: tensor.shape[0]] = tensor
        gather(bufs, mine, group=group)
        for t, b in zip(tensor_list, bufs):
            t.copy_(b[: t.shape[0]])
        return _Done() if async_op else None

    dist.all_gather = all_gather
    # C: CUDA device requests become CPU ones where they are made.
    _install_device_rewrites()
    _INSTALLED = True
    return True
