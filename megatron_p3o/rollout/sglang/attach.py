"""Attaching to an SGLang server this trainer did not launch (``rollout.sglang.url``,
``rollout.sglang_workers``): it is taken as it is found — a weight-update session a killed trainer
left open is closed, memory a killed colocated trainer released is resumed, and generation
continued (:func:`close_stale_session`); its tensor-parallel size (:func:`adopt_layout`) and
context length (:func:`read_context_length`) come from the server, not the recipe.

Functions of one :class:`~.client.SGLangEngine` each (the fleet calls them on its attached
servers), kept apart from the client's requests and pushes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from megatron_p3o.rollout.sglang.client import STALE_CALL_S, SGLangEngine
from megatron_p3o.rollout.sglang.protocol import (
    NO_SESSION_OPEN,
    EngineResponseError,
    EngineUnavailableError,
)


def adopt_layout(eng: SGLangEngine, transport: str) -> None:
    """``tp_size`` from ``GET /server_info`` (the server's resolved arguments), not the
    recipe: the weight-update group spans 1 + Σ tp_size ranks and a tensor push sends one
    payload per TP rank, so a wrong recipe value left the group's rendezvous waiting for
    ranks that never come. A recipe value that differs is replaced, in one line; a colocated
    push refuses it instead (its payload ranks are trainer ranks 0…tp_size−1, which the
    recipe places). Data- or pipeline-parallel servers are refused for every push but disk:
    SGLang 0.5.23 joins the group as ``rank_offset + tp_rank`` (pipeline stages would share
    ranks) and refuses data-parallel replicas there. A URL without ``/server_info`` (a
    router) keeps the recipe's value."""
    from megatron_p3o.rollout.sglang.launch import SGLangSetupError

    code, info = eng._get("/server_info")
    keys = ("tp_size", "dp_size", "pp_size")
    info = info if isinstance(info, dict) else {}
    if not all(type(info.get(k)) is int for k in keys):
        eng._notice(f"no tp_size in GET /server_info (HTTP {code}); "
                     f"rollout.sglang.tp_size={eng.cfg.tp_size} stands")  # fmt: skip
        return
    tp, dp, pp = (info[k] for k in keys)
    if (dp > 1 or pp > 1) and transport != "disk":
        raise SGLangSetupError(
            f"SGLang {eng.label} at {eng.url} serves dp_size={dp}, pp_size={pp} (GET "
            f"/server_info): rollout.weight_sync={transport} pushes to one tensor-parallel "
            "group per server; serve it with --dp-size 1 --pp-size 1, or use "
            "rollout.weight_sync=disk"
        )
    if tp == eng.cfg.tp_size:
        return
    if transport == "colocated":
        raise SGLangSetupError(
            f"rollout.sglang.tp_size={eng.cfg.tp_size}, but SGLang {eng.label} at "
            f"{eng.url} serves tp_size={tp} (GET /server_info): a colocated push builds "
            "server rank r's payload on trainer rank r; set rollout.sglang.tp_size="
            f"{tp}"
        )
    eng._notice(f"serves tp_size={tp} (GET /server_info); rollout.sglang.tp_size="
                 f"{eng.cfg.tp_size} ignored for it")  # fmt: skip
    eng.cfg = replace(eng.cfg, tp_size=tp)


def close_stale_session(eng: SGLangEngine, released: Sequence[str] = ()) -> None:
    """Before waiting for ``/health``: only ``/end_weight_update`` closes a weight-update
    session (SGLang 0.5.23); one a killed trainer left open made every later
    ``/begin_weight_update`` a 400 and its pause held every ``/generate`` and ``/health``.
    Sessions open only while paused, so a server whose ``GET /ready`` answers 200 has none
    (503 while paused, starting or unhealthy); one that does not gets ``/end_weight_update``
    (none open is fine), the regions a colocated trainer released (``released``, from its
    record) resumed — a forward on released memory touches unmapped pages — and
    ``/continue_generation`` (a no-op if not paused). A scheduler blocked in a weight
    broadcast whose trainer died (until NCCL's timeout) answers none of these: that is one
    line after :data:`STALE_CALL_S`, not a wait of ``request_timeout_s``."""
    code = eng.wait_healthy(eng.cfg.startup_timeout_s, "/ready", any_status=True)
    if code in (200, 404):  # ready, or no such route (a router): nothing of ours is open
        return
    try:
        _stale_call(eng, eng.end_weight_update)
        closed = "a weight-update session it left open closed, "
    except EngineResponseError as e:
        if NO_SESSION_OPEN not in str(e):
            raise
        closed = ""
    if released:
        _stale_call(eng, lambda: eng.resume_memory(list(released)))
        closed += f"its released memory ({', '.join(released)}) resumed, "
    _stale_call(eng, eng.continue_generation)
    eng._notice(f"not ready (GET /ready: HTTP {code}; paused by a previous trainer?); "
                 f"{closed}generation continued")  # fmt: skip


def _stale_call(eng: SGLangEngine, fn) -> None:
    """``fn()`` with a short request timeout; a server that does not answer is an error."""
    saved = eng.cfg
    eng.cfg = replace(saved, request_timeout_s=STALE_CALL_S, max_retries=0)
    try:
        fn()
    except EngineUnavailableError:
        raise EngineUnavailableError(
            f"SGLang {eng.label} at {eng.url} accepts connections but did not answer within "
            f"{STALE_CALL_S:.0f} s: its scheduler is blocked (a trainer killed inside a weight "
            "push leaves it in the broadcast until NCCL's timeout); restart that server"
        ) from None
    finally:
        eng.cfg = saved


def read_context_length(eng: SGLangEngine) -> None:
    """``GET /server_info``'s ``context_length`` (None if absent): a multi-turn turn never
    asks past it (SGLang refuses input + ``max_new_tokens`` beyond it with a 400)."""
    _, info = eng._get("/server_info")
    value = info.get("context_length") if isinstance(info, dict) else None
    eng.context_length = value if type(value) is int and value > 0 else None
