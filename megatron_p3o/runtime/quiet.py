"""Known third-party warnings, silenced at their source (by category, module and message).

Why: on a CPU machine, or without NVIDIA apex / Transformer Engine, Megatron-Core and torch warn
about things this project handles on purpose (torch fallbacks for TE/apex kernels, gloo instead
of NCCL). A run printed pages of them, which hid the lines a user needs. Each entry names the
module that warns and what the warning says, so a new or different warning still shows. Never a
blanket ``filterwarnings("ignore")``.

In runtime/ (the lowest layer, beside :mod:`.errors`) because :func:`.errors.run_cli`, which every
command-line tool goes through, installs these filters before anything else is imported.
"""

from __future__ import annotations

import logging
import warnings

# (category, message regex, module regex): see ``warnings.filterwarnings``.
KNOWN = (
    # megatron-core without TE/apex: its torch fallbacks are the local (CPU) spec we ask for.
    (UserWarning, r"Transformer Engine and Apex are not installed", r"megatron\.core"),
    (UserWarning, r"Apex is not installed", r"megatron\.core"),
    (UserWarning, r"Transformer Engine is not installed", r"megatron\.core"),
    (UserWarning, r"Transformer Engine not installed", r"megatron\.core"),
    (UserWarning, r".*(apex|APEX).*not (installed|found|available)", r"megatron\.core"),
    (UserWarning, r".*nvidia[-_]resiliency", r"megatron\.core"),
    (UserWarning, r".*[Tt]riton", r"megatron\.core"),
    # TransformerConfig's own default cuda_graph_scope="full" triggers its deprecation notice.
    (UserWarning, r"full scope is deprecated", r"megatron\.core"),
    (DeprecationWarning, r"", r"megatron\.core"),
    (FutureWarning, r"", r"megatron\.core"),
    # torch.distributed.checkpoint with gloo on a CPU: no GPUs to place shards on.
    (UserWarning, r".*(dist\.barrier|barrier\(\)).*device", r"torch\.distributed"),
    (FutureWarning, r"", r"torch\.distributed\.checkpoint"),
    # dist_checkpointing still builds torch ShardedTensors; on a CPU the call passes through
    # the device shim, which the warning then names as its source.
    (
        FutureWarning,
        r"Please use DTensor instead",
        r"(torch|megatron\.core|megatron_p3o\.runtime\.cpu_shim)",
    ),
    (UserWarning, r"TypedStorage is deprecated", r"torch"),
    # torch.utils.tensorboard and datasets pulling deprecated APIs of their own dependencies.
    (DeprecationWarning, r"", r"(tensorboard|google\.protobuf|pkg_resources)"),
)


# (logger, message prefix) of log records that our own one-line errors already carry
KNOWN_LOG_LINES = (
    # a failed checkpoint write (e.g. a full disk): checkpoint.save_training_checkpoint's
    # CheckpointError names the OS error, the directory and the bytes needed
    ("megatron.core.dist_checkpointing.strategies.filesystem_async", "Local process "),
)


class _DropPrefix(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def silence_known_warnings() -> None:
    """Install the filters of :data:`KNOWN` and :data:`KNOWN_LOG_LINES` (idempotent; before
    importing megatron.core)."""
    for category, message, module in KNOWN:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, prefix in KNOWN_LOG_LINES:
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropPrefix) and f.prefix == prefix for f in log.filters):
            log.addFilter(_DropPrefix(prefix))
