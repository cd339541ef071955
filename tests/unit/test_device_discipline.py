"""Every tensor bound for the model or a collective is created on the training device.

NCCL refuses CPU tensors (``No backend type associated with device type cpu``), and the CPU
shim makes any device look right here, so a missing ``device=`` passes every CPU test and
crashes the first GPU step. This test reads the modules whose tensors reach the model or a
collective and fails on a torch factory call without ``device=``, unless its line says
``# host`` (host-side bookkeeping, never sent). Micro-batches are built on the host
(``batching.py``) and moved to the device right before each forward (``model/forward.py``).
"""

import ast
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
# modules whose tensors reach the model or a collective
DEVICE_BOUND = [
    "megatron_p3o/update/policy_update.py",
    "megatron_p3o/observability/metrics.py",
    "megatron_p3o/trainer.py",
    "megatron_p3o/model/forward.py",
    "megatron_p3o/model/packed.py",
    "megatron_p3o/model/local_attention.py",
    "megatron_p3o/update/balance.py",
    "megatron_p3o/update/batching.py",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "megatron_p3o/loss").glob("*.py")),
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "megatron_p3o/logprob").glob("*.py")),
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "megatron_p3o/weight_sync").glob("*.py")),
]
FACTORIES = {
    "zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "randn", "rand",
    "randint", "linspace", "eye",
}  # fmt: skip


def violations(path: Path):
    src = path.read_text()
    lines = src.splitlines()
    out = []
    for node in ast.walk(ast.parse(src)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        f = node.func
        if not (isinstance(f.value, ast.Name) and f.value.id == "torch" and f.attr in FACTORIES):
            continue
        if any(k.arg == "device" for k in node.keywords):
            continue
        span = lines[node.lineno - 1 : (node.end_lineno or node.lineno)]
        if any("# host" in x for x in span):
            continue
        out.append(f"{path.relative_to(ROOT)}:{node.lineno}: torch.{f.attr}(...) without device=")
    return out


@pytest.mark.parametrize("module", DEVICE_BOUND)
def test_no_factory_call_without_a_device(module):
    found = violations(ROOT / module)
    assert not found, "\n".join(found)


def test_the_check_catches_a_default_device_tensor(tmp_path):
    bad = ROOT / "megatron_p3o" / "_discipline_probe.py"
    try:
        bad.write_text("import torch\nflag = torch.tensor([1.0])\nok = torch.zeros(1)  # host\n")
        assert violations(bad) == [
            "megatron_p3o/_discipline_probe.py:2: torch.tensor(...) without device="
        ]
    finally:
        bad.unlink()


def test_micro_batches_move_to_the_training_device():
    from megatron_p3o.model.forward import to_device

    mb = {"tokens": torch.ones(2, 3, dtype=torch.long), "n": 3}
    moved = to_device(mb, torch.device("meta"))
    assert moved["tokens"].device.type == "meta" and moved["n"] == 3
    assert mb["tokens"].device.type == "cpu"  # the host copy is untouched


def test_metrics_reduce_on_the_given_device(monkeypatch):
    """The reduced tensors are made on the device handed in (meta here: a tensor left on the
    CPU default would show up as cpu in the collective)."""
    import torch.distributed as dist

    from megatron_p3o.observability.metrics import StepMetrics

    class Seen(Exception):
        pass

    def all_reduce(t, **kw):
        raise Seen(t.device.type)

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    fills = (
        lambda m: m.add("loss", 1.0, 2.0),
        lambda m: m.add_max("ratio_max", 3.0),
        lambda m: m.add_log_hist("ratio", torch.zeros(4)),
    )
    for fill in fills:  # sums, maxima, histograms: each all-reduced on the device
        m = StepMetrics()
        fill(m)
        with pytest.raises(Seen, match="meta"):
            m.reduce(object(), torch.device("meta"))
