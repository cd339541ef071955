"""SGLang 0.5.23's HTTP protocol: request bodies and response parsing, nothing that talks.

Fields follow the pinned release's own server code (``tests/unit/test_sglang_protocol.py``
checks every route and field against that release's source; the ``sglang`` test tier runs them
against the real server). ``POST /generate`` takes ``input_ids``, ``sampling_params`` and
``return_logprob``; the response's ``meta_info.output_token_logprobs`` is a list of
``[logprob, token_id, text]``, ``meta_info.finish_reason`` a dict with ``type``
("stop" | "length" | "abort"). SGLang's log-probs are log_softmax(logits / T) over the full
vocabulary (not truncated by top-p/top-k) when ``SGLANG_RETURN_ORIGINAL_LOGPROB=false``, which
every launched server has.

Weight versions: ``meta_info.weight_version`` is the version that produced the *last* token. A
request retracted by a weight push (``/pause_generation`` ``retract``) and resumed under the new
weights also carries ``meta_info.weight_versions``: spans ``{"version", "start", "end"}`` over
its output tokens (``sglang/srt/utils/weight_versions.py``), which :func:`token_versions` turns
into one version per completion token. A version that is not an integer (``"default"``: a
server that never received the trainer's weights, or a restarted one) is refused: such samples
cannot be attributed to a policy.
"""

from __future__ import annotations

import hashlib
import math
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

from megatron_p3o.runtime.errors import UserError
from megatron_p3o.types import Sample, SamplingParams


class EngineUnavailableError(UserError, RuntimeError):
    """The SGLang server does not answer (after the configured restarts and retries)."""


class EngineResponseError(UserError, ValueError):
    """A response that cannot be a valid sample (aborted, non-finite log-probs, length mismatch)."""


def generate_payload(
    prompt_ids: Sequence[int],
    sampling: SamplingParams,
    seed: Optional[int],
    routed_experts: bool = False,
) -> dict:
    """The ``/generate`` body for one completion of one prompt (with ``routed_experts``: the
    experts of every token from the first prompt token on, ``routed_experts_start_len`` 0)."""
    sp = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_new_tokens": sampling.max_new_tokens,
    }
    if sampling.top_k > 0:
        sp["top_k"] = sampling.top_k
    if sampling.stop_token_ids:
        sp["stop_token_ids"] = list(sampling.stop_token_ids)
    if seed is not None:
        sp["sampling_seed"] = int(seed)
    body = {
        "input_ids": list(map(int, prompt_ids)),
        "sampling_params": sp,
        "return_logprob": True,
        "logprob_start_len": -1,  # output tokens only
    }
    if routed_experts:
        body.update(return_routed_experts=True, routed_experts_start_len=0)
    return body


def batch_payload(bodies: Sequence[dict]) -> dict:
    """Several :func:`generate_payload` bodies as one ``/generate`` request (SGLang's batch form:
    ``input_ids`` and ``sampling_params`` become lists; the answer is a list in the same order).
    The bodies must agree on everything else (they do: one call of ``generate``)."""
    if not bodies:
        raise ValueError("batch_payload: no requests")
    rest = [
        {k: v for k, v in b.items() if k not in ("input_ids", "sampling_params")} for b in bodies
    ]
    if any(r != rest[0] for r in rest[1:]):
        raise ValueError("batch_payload: the requests differ in more than prompt and sampling")
    return {
        "input_ids": [b["input_ids"] for b in bodies],
        "sampling_params": [b["sampling_params"] for b in bodies],
        **rest[0],
    }


def decode_routed_experts(meta: dict, n_tokens: int, shape: Tuple[int, int], rid) -> torch.Tensor:
    """``meta_info.routed_experts`` (base64 of int32) → ``[n_tokens, layers, k]`` int16."""
    import base64

    import numpy as np

    raw = meta.get("routed_experts")
    if raw is None:
        raise EngineResponseError(
            f"SGLang request {rid}: no meta_info.routed_experts (is the server launched with "
            "--enable-return-routed-experts?)"
        )
    a = np.frombuffer(base64.b64decode(raw), dtype=np.int32)
    layers, k = shape
    if a.size != n_tokens * layers * k:
        raise EngineResponseError(
            f"SGLang request {rid}: routed_experts holds {a.size} values, expected "
            f"{n_tokens} tokens × {layers} layers × top-{k}"
        )
    return torch.from_numpy(a.reshape(n_tokens, layers, k).astype(np.int16))


def _version(value, rid) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise EngineResponseError(
            f"SGLang request {rid}: the server reports weight_version {value!r}, not a version "
            "the trainer pushed; its samples cannot be attributed to a policy"
        ) from None


def token_versions(meta: dict, n_tokens: int, rid) -> List[int]:
    """One weight version per completion token: from the ``weight_versions`` spans when the
    request straddled a push, else ``weight_version`` for every token. Spans must cover the
    completion exactly, in order."""
    spans = meta.get("weight_versions")
    if not spans:
        return [_version(meta.get("weight_version"), rid)] * n_tokens
    out: List[int] = []
    for sp in spans:
        if sp["start"] != len(out) or sp["end"] < sp["start"]:
            raise EngineResponseError(
                f"SGLang request {rid}: weight_versions spans {spans} do not tile the "
                f"{n_tokens} completion tokens"
            )
        out += [_version(sp["version"], rid)] * (sp["end"] - sp["start"])
    if len(out) != n_tokens:
        raise EngineResponseError(
            f"SGLang request {rid}: weight_versions spans cover {len(out)} tokens, the "
            f"completion has {n_tokens}"
        )
    return out


def parse_generate_response(
    resp: dict,
    prompt_ids: Sequence[int],
    group_id: int,
    routed_experts: Optional[Tuple[int, int]] = None,
    allow_abort: bool = False,
) -> Sample:
    """One SGLang ``/generate`` response → :class:`Sample` (refuses non-finite ones, and aborted
    ones unless ``allow_abort``: then a sample of what was generated, finish reason "abort");
    ``routed_experts`` = (layers, k) decodes the recorded experts (MoE)."""
    if not isinstance(resp, dict):
        raise EngineResponseError(
            f"SGLang /generate (prompt group {group_id}) answered {type(resp).__name__} "
            f"{str(resp)[:200]!r}, not a response object"
        )
    meta = resp.get("meta_info") or {}
    rid = meta.get("id", "?")
    fin = meta.get("finish_reason")
    kind = fin.get("type") if isinstance(fin, dict) else fin
    if kind == "abort" and allow_abort:
        return Sample(list(prompt_ids), [], [], "abort", 0, group_id, meta={"rid": rid})
    if kind not in ("stop", "length"):
        raise EngineResponseError(
            f"SGLang request {rid} (prompt group {group_id}) finished with "
            f"{fin!r}; expected stop or length"
        )
    triples = meta.get("output_token_logprobs")
    if triples is None:
        raise EngineResponseError(
            f"SGLang request {rid}: no output_token_logprobs (was return_logprob sent?)"
        )
    logprobs = [float(t[0]) if t[0] is not None else math.nan for t in triples]
    ids = [int(t[1]) for t in triples]
    out_ids = resp.get("output_ids")
    if out_ids is not None and list(out_ids) != ids:
        raise EngineResponseError(
            f"SGLang request {rid}: output_ids and output_token_logprobs "
            f"disagree ({len(out_ids)} vs {len(ids)} tokens)"
        )
    bad = [i for i, x in enumerate(logprobs) if not math.isfinite(x)]
    if bad:
        raise EngineResponseError(
            f"SGLang request {rid} (prompt group {group_id}): non-finite "
            f"behaviour log-prob at completion token {bad[0]}"
        )
    versions = token_versions(meta, len(ids), rid)
    first = versions[0] if versions else _version(meta.get("weight_version"), rid)
    routes = None
    if routed_experts is not None and ids:
        routes = decode_routed_experts(meta, len(prompt_ids) + len(ids) - 1, routed_experts, rid)
    return Sample(
        prompt_ids=list(prompt_ids),
        completion_ids=ids,
        logprobs=logprobs,
        finish_reason=kind,
        weight_version=first,
        group_id=group_id,
        meta={"rid": rid},
        routed_experts=routes,
        token_versions=versions if len(set(versions)) > 1 else None,
    )


# The GPU memory regions of SGLang 0.5.23 (``sglang/srt/constants.py``: GPU_MEMORY_ALL_TYPES).
# ``/release_memory_occupation`` without tags releases every one of them
# (``scheduler_components/weight_updater.py``), CUDA graphs included: they are captured in the
# ``cuda_graph`` region when the memory saver is on (colocated servers). A colocated push
# releases all of them by name and resumes exactly the same set (a tag resumed that was never
# released is a KeyError there): the weights before the push, the rest before generation.
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
RESUME_BEFORE_PUSH = ("weights",)
RESUME_AFTER_PUSH = ("kv_cache", "cuda_graph")
assert sorted(RESUME_BEFORE_PUSH + RESUME_AFTER_PUSH) == sorted(MEMORY_TAGS)


# SGLang 0.5.23's answer to ``/end_weight_update`` without a session
# (``scheduler_components/weight_updater.py``, ``end_weight_update``). Only that route closes a
# session, so the next trainer closes the one a killed trainer left open when it attaches, and
# this answer there is no error.
NO_SESSION_OPEN = "no weight-update session is open"


def release_payload() -> dict:
    """``/release_memory_occupation``: every region, named (never the empty body)."""
    return {"tags": list(MEMORY_TAGS)}


def resume_payload(tags: Sequence[str]) -> dict:
    """``/resume_memory_occupation`` of ``tags`` (a subset of :data:`MEMORY_TAGS`)."""
    unknown = set(tags) - set(MEMORY_TAGS)
    if unknown or not tags:
        raise ValueError(f"resume_memory_occupation: tags {list(tags)} not in {MEMORY_TAGS}")
    return {"tags": list(tags)}


def with_last(items: Iterable):
    """``(item, is_last)`` with one item of look-ahead (buckets arrive as a stream)."""
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for x in it:
        yield prev, False
        prev = x
    yield prev, True


def last_bucket_fields(version: int, last: bool) -> dict:
    """The cache is flushed and the version set once, with the last bucket of a session."""
    return {"flush_cache": last, **({"weight_version": str(version)} if last else {})}


def disk_payload(model_path: str, version: int) -> dict:
    """``/update_weights_from_disk``: a safetensors directory every server can read."""
    return {"model_path": model_path, "weight_version": str(version), "flush_cache": True}


def init_group_payload(
    master_address: str,
    master_port: int,
    world: int,
    group_name: str,
    backend: str = "nccl",
    rank_offset: int = 1,
) -> dict:
    """``/init_weights_update_group``: the server's ranks join as ``rank_offset`` …
    ``rank_offset + tp_size − 1`` (trainer rank 0; server i of a fleet after servers 0…i−1);
    ``backend`` "nccl" (GPU servers) or "gloo" (CPU servers)."""
    return {
        "master_address": master_address,
        "master_port": master_port,
        "rank_offset": rank_offset,
        "world_size": world,
        "group_name": group_name,
        "backend": backend,
    }


def distributed_payload(bucket, group_name: str, version: int, last: bool) -> dict:
    """``/update_weights_from_distributed`` for one bucket of ``(name, tensor)``."""
    return {
        "names": [n for n, _ in bucket],
        "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
        "group_name": group_name,
        **last_bucket_fields(version, last),
    }


def tensor_payload(serialized: Sequence[str], version: int, last: bool) -> dict:
    """``/update_weights_from_tensor``: one serialized payload per server TP rank."""
    return {"serialized_named_tensors": list(serialized), **last_bucket_fields(version, last)}


# sglang-router's routing key (its ``manual`` policy: every request of one key to one server)
ROUTING_KEY_HEADER = "x-smg-routing-key"


def routing_key(ids: Sequence[int]) -> str:
    """A routing key for a token sequence (multi-turn: a trajectory's prompt, so that every
    turn of every trajectory of a prompt carries the same key)."""
    return hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:16]


def request_chunks(jobs: list, per: int) -> list:
    """``jobs`` (``(group, input ids, seed, routing key)``) cut into requests of ``per``
    completions; only jobs of one routing key share a request (a request goes to one
    server)."""
    out: list = []
    for job in jobs:
        last = out[-1] if out else None
        if last and len(last) < per and last[0][3] == job[3]:
            last.append(job)
        else:
            out.append([job])
    return out
