"""CUDA-IPC handles of named tensors in the format SGLang's ``/update_weights_from_tensor``
reads, made without importing sglang.

Why our own: the trainer and SGLang live in different environments (SGLang pins its own torch),
so the trainer cannot call ``sglang.srt.utils.MultiprocessingSerializer``. The format is
``base64(ForkingPickler.dumps(list of (name, tensor)))``. SGLang's server patches torch's CUDA
tensor reductions so that the device travels as its UUID rather than its index (indices differ
between processes with different ``CUDA_VISIBLE_DEVICES``); :func:`serialize_named_tensors` does
the same on the sending side. Each server TP rank reads only *its* payload
(``serialized_named_tensors[tp_rank]``), so a colocated server of TP size T needs T payloads,
each built by the trainer rank that shares that server rank's GPU.

CPU tensors travel as plain pickled data (``pickle.dumps``: the tensor bytes themselves), which
SGLang's ``SafeUnpickler`` reads on a CPU server. Torch's shared-memory reductions for CPU tensors
send file descriptors that the server cannot receive over HTTP: the real server's TP worker dies
with an ``AuthenticationError`` (seen on SGLang 0.5.23 on CPU). The CUDA path needs a GPU.
"""

from __future__ import annotations

import base64
import copyreg
import io
from multiprocessing.reduction import ForkingPickler
from typing import List, Sequence, Tuple

import torch

# position of the device index in torch's reduce_tensor output for CUDA tensors; SGLang's own
# patch relies on the same constant (torch has not changed the signature in years)
_DEVICE_ARG = 6


def _reduce_with_uuid(tensor: torch.Tensor):
    from torch.multiprocessing import reductions

    fn, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda:  # the receiving side maps the UUID back to its own device index
        uuid = str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid)
        args = (*args[:_DEVICE_ARG], uuid, *args[_DEVICE_ARG + 1 :])
    return fn, args


class _Pickler(ForkingPickler):
    """ForkingPickler whose tensor reduction sends CUDA devices by UUID (SGLang's patch)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        table = copyreg.dispatch_table.copy()
        table.update(ForkingPickler._extra_reducers)
        table[torch.Tensor] = _reduce_with_uuid
        table[torch.nn.Parameter] = _reduce_with_uuid
        self.dispatch_table = table


def serialize_named_tensors(named: Sequence[Tuple[str, torch.Tensor]]) -> str:
    """One payload: the base64 text of the pickled ``[(name, tensor), ...]``: CUDA-IPC handles
    for CUDA tensors (they must stay alive until the server has loaded them), the data for CPU
    tensors. One call per receiving server rank, never one payload for several: torch counts one
    IPC reference per serialization, and each process that opens the handles gives one back."""
    import pickle

    import torch.multiprocessing.reductions  # noqa: F401 - registers torch's reducers

    items = [(n, t) for n, t in named]
    cuda = {t.is_cuda for _, t in items}
    if cuda == {False, True}:
        raise ValueError("a tensor payload mixes CUDA and CPU tensors")
    if True in cuda:  # handles, not data: the tensors must stay alive until loaded
        buf = io.BytesIO()
        _Pickler(buf).dump(items)
        raw = buf.getvalue()
    else:  # the data itself (a CPU server; no file descriptors over HTTP)
        raw = pickle.dumps([(n, t.detach().contiguous()) for n, t in items])
    return base64.b64encode(raw).decode("ascii")


def payload_ranks(server_tp: int, world_size: int) -> List[int]:
    """The trainer ranks whose GPUs hold server ranks 0…T−1 (colocated: global ranks 0…T−1)."""
    if server_tp > world_size:
        raise ValueError(
            f"a colocated server of tp_size {server_tp} needs {server_tp} trainer GPUs"
        )
    return list(range(server_tp))
