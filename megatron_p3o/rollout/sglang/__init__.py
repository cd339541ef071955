"""SGLang rollouts: launch (``launch``), the pinned release's protocol (``protocol``), one server
over HTTP (``client``), weight transports (``weights``) and several servers (``fleet``).

The trainer never imports sglang: servers run in their own environment (``tools/sglang_env.sh``)
and are reached over HTTP plus a torch process group. ``rollout.sglang`` in a recipe is one flat
mapping, :class:`SGLangConfig`; each module owns the fields it reads (its ``*Settings`` class,
documented there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Dict

from megatron_p3o.rollout.sglang.client import ClientSettings, SGLangEngine
from megatron_p3o.rollout.sglang.fleet import FleetSettings, SGLangFleet, build_fleet
from megatron_p3o.rollout.sglang.launch import (
    API_KEY_ENV,
    PYTHON_ENV,
    LaunchSettings,
    SGLangSetupError,
)
from megatron_p3o.rollout.sglang.protocol import EngineResponseError, EngineUnavailableError
from megatron_p3o.rollout.sglang.weights import WeightSettings
from megatron_p3o.runtime.fields import check_ranges


@dataclass(frozen=True)
class SGLangConfig(FleetSettings, WeightSettings, ClientSettings, LaunchSettings):
    """``rollout.sglang``: the fields of :class:`~.launch.LaunchSettings` (interpreter, device,
    flags, ports, logs), :class:`~.client.ClientSettings` (url, timeouts, concurrency, retries,
    restarts), :class:`~.weights.WeightSettings` (the weight-update group's backend) and
    :class:`~.fleet.FleetSettings` (how many servers)."""

    RANGES: ClassVar[Dict[str, str]] = {
        "mem_fraction_static": "in (0, 1]",
        "max_total_tokens": ">= 1",
        "tp_size": ">= 1",
        "port": "a port in [1, 65535]",
        "router_port": "in [0, 65535] (0: a free port)",
        "servers": ">= 1",
        "startup_timeout_s": "> 0",
        "request_timeout_s": "> 0",
        "max_concurrency": ">= 1",
        "request_batch": ">= 1",
        "max_retries": ">= 0",
        "max_restarts": ">= 0",
    }

    def __post_init__(self):
        check_ranges(self, self.RANGES, "rollout.sglang")


__all__ = [
    "API_KEY_ENV",
    "PYTHON_ENV",
    "EngineResponseError",
    "EngineUnavailableError",
    "SGLangConfig",
    "SGLangEngine",
    "SGLangFleet",
    "SGLangSetupError",
    "build_fleet",
]
