"""GPU check, round 5 (issue 52), without TE or SGLang: the colocated push on one GPU.

Why: issue 52 fixed the colocated push where a CPU can test it (the client takes SGLang's
``null`` answers to the memory routes, one CUDA-IPC payload per server rank, the trainer's cached
memory returned before each resume, the route order against the stand-in); CUDA memory and CUDA
IPC exist only on a GPU. Three parts, recorded in ``round5.json``:

1. ``colocated``: the tiny Llama at world 1, ``CentralEngine(SGLangFleet, "colocated")`` through
   the real client, against a stand-in in another process on the GPU that acts as SGLang 0.5.23
   where it matters: ``null`` from the memory routes; no release unless paused, no generation
   while paused or released; weights, KV cache and graph memory freed on release and allocated
   on resume; each payload decoded as SGLang does (UUID → device index) into its weights'
   memory. Release → training step (forward, backward, SGD) → push → generate. Checked: route
   order and tags, every tensor the server holds bit for bit against the trainer's checksums,
   the generated token (from the pushed embedding), and the trainer's reserved memory lower at
   the server's first resume than after the step.
2. ``cached_memory``: a training-like step leaves ~30 % of the free memory cached by PyTorch;
   another process cannot allocate (free after return − 512 MiB) while the trainer holds it,
   and can after ``central.return_cached_memory``.
3. ``ipc_payloads``: torch counts one IPC reference per serialization, each receiver gives one
   back on release. Two receivers; after the first released and the sender dropped its tensor,
   ran ``torch.cuda.ipc_collect()`` and wrote new tensors, the second one's copy must be intact
   with a payload per receiver (one shared payload is recorded, not asserted: whether the block
   is reused is up to the allocator).

``--device cpu`` runs (1) with CPU tensors, gloo and pickled payloads and marks the rest skipped.
One ``RESULT`` line; exit 0 only if every check that ran passed.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import multiprocessing
import queue
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

from gpu_round4 import _decode_like_sglang  # noqa: E402 - SGLang 0.5.23's decoding, as round 4

from tests.sglang_standin import SGLangStandIn  # noqa: E402

MiB, GiB = 2**20, 2**30
MARGIN = 512 * MiB  # the second process asks for the free memory after return less this
BUCKET = 64 * 1024  # push buckets: the tiny model takes many (the route order shows each)
SEQ, BATCH, LR = 256, 32, 1e-2
PROMPT = [5, 17, 33, 2]
MEMORY = ("/release_memory_occupation", "/resume_memory_occupation")


def _digest(t: torch.Tensor) -> dict:
    t = t.detach().contiguous()
    raw = t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    return {"sum": float(t.double().sum()), "sha256": hashlib.sha256(raw).hexdigest()}


def _free(device: str):
    return torch.cuda.mem_get_info()[0] if device == "cuda" else None


def _gib(n):
    return None if n is None else round(n / GiB, 3)


class GPUStandIn(SGLangStandIn):
    """The stand-in's protocol and rules, plus SGLang 0.5.23's memory behaviour on ``device``."""

    def __init__(self, device: str, weights_bytes: int, kv_bytes: int):
        self.device = device
        graph = 64 * MiB if device == "cuda" else MiB
        self.sizes = {"weights": weights_bytes, "kv_cache": kv_bytes, "cuda_graph": graph}
        self.regions, self.offsets, self.views, self.end = {}, {}, {}, 0
        self.pushed, self.devices, self.memory, self.answers = [], set(), [], []
        super().__init__(self._generate, server_info={"tp_size": 1, "dp_size": 1, "pp_size": 1})
        for tag in self.sizes:  # the served model and its KV cache, as after start-up
            self._take(tag)

    def _take(self, tag):
        self.regions[tag] = torch.empty(self.sizes[tag], dtype=torch.uint8, device=self.device)

    def _refuse(self, path, body, why):
        with self.lock:
            self.routes.append((path, body))
        return self._fail(f"{path}: {why}")

    def handle(self, path, body):
        tags = (body or {}).get("tags") or list(self.sizes)
        if path == MEMORY[0] and not self.paused:  # SGLang asserts an idle server
            return self._refuse(path, body, "the server is not paused (pause_generation first)")
        if path == "/generate" and (self.paused or self.released):
            return self._refuse(path, body, f"paused={self.paused} released={self.released}")
        if path == MEMORY[1]:
            self.memory.append({"resume": tags, "free_gib": _gib(_free(self.device))})
            try:
                for tag in tags:
                    self._take(tag)
            except torch.OutOfMemoryError as e:
                return self._refuse(path, body, f"out of memory: {str(e).splitlines()[0]}")
        obj, code = super().handle(path, body)
        if path in MEMORY:
            self.answers.append(obj)
        if path == MEMORY[0]:
            for tag in tags:
                self.regions.pop(tag, None)
            if "weights" in tags:  # their memory is gone; a resume gives it back unset
                self.views = {}
            if self.device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            self.memory.append({"release": tags, "free_gib": _gib(_free(self.device))})
        if path == "/update_weights_from_tensor" and code == 200:
            try:
                self._load(body["serialized_named_tensors"][0])
            except Exception as e:
                return self._fail(f"decoding the payload: {e!r}")
        return obj, code

    def _load(self, blob: str) -> None:
        """Copy each tensor of the payload into the weights' memory (its slot fixed at first)."""
        region = self.regions["weights"]
        for name, t in _decode_like_sglang(blob):
            n = t.numel() * t.element_size()
            if name not in self.offsets:
                self.offsets[name], self.end = self.end, self.end + -(-n // 16) * 16
            off = self.offsets[name]
            if off + n > region.numel():
                raise ValueError(f"{name} does not fit the weights' memory")
            self.views[name] = region[off : off + n].view(t.dtype).view(t.shape)
            self.views[name].copy_(t)
            self.pushed.append(name)
            self.devices.add(str(t.device))
        if self.device == "cuda":
            torch.cuda.synchronize()  # loaded before the trainer may free the handles' memory

    def _generate(self, body: dict):
        emb = self.views["model.embed_tokens.weight"]
        self.regions["kv_cache"][:16].fill_(1)  # the KV cache is written: it must be there
        return [int(emb[body["input_ids"][-1]].float().argmax())], [-0.25], "length"

    def record(self) -> dict:
        bodies = [(p, b.get("tags")) for p, b in self.routes if p in MEMORY]
        return {"routes": self.paths(), "memory_tags": bodies, "memory": self.memory,
                "answers": self.answers, "pushed": self.pushed, "devices": sorted(self.devices),
                "held": {n: _digest(v) for n, v in self.views.items()}}  # fmt: skip


class _Helper:
    """Runs in the other process: an IPC receiver, the allocating "server", or the stand-in."""

    def __init__(self, device):
        self.device, self.held, self.srv = device, None, None

    def open(self, blob, want):
        self.held = _decode_like_sglang(blob)
        t = self.held[0][1]
        return {"device": str(t.device), "intact": _digest(t) == want}

    def check(self, want):
        return _digest(self.held[0][1]) == want

    def release(self):
        self.held = None
        gc.collect()  # torch gives the reference back when the storage dies
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def alloc(self, nbytes):
        try:
            torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(0)
            return {"allocated": True}
        except torch.OutOfMemoryError as e:
            return {"allocated": False, "error": str(e).splitlines()[0][:200]}
        finally:
            torch.cuda.empty_cache()

    def serve(self, weights_bytes, kv_bytes):
        self.srv = GPUStandIn(self.device, weights_bytes, kv_bytes)
        return self.srv.url

    def record(self):
        rec = self.srv.record()
        self.srv.close()
        return rec


def _helper_main(device, q_in, q_out):
    if device == "cuda":
        torch.cuda.set_device(0)
        torch.empty(1, device="cuda")  # its CUDA context exists before anyone measures
    me, parent = _Helper(device), multiprocessing.parent_process()
    while parent is None or parent.is_alive():  # an orphan (the step's timeout) exits
        try:
            cmd, args = q_in.get(timeout=1.0)
        except queue.Empty:
            continue
        if cmd == "stop":
            return
        try:
            q_out.put(("ok", getattr(me, cmd)(*args)))
        except Exception as e:
            q_out.put(("error", f"{type(e).__name__}: {e}"))


class Helper:
    """The trainer's end of a helper process (spawned: CUDA in a fresh process)."""

    def __init__(self, ctx, device):
        self.q_in, self.q_out = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_helper_main, args=(device, self.q_in, self.q_out),
                                daemon=True)  # fmt: skip
        self.proc.start()

    def ask(self, cmd, *args, timeout=30.0):
        """``cmd``'s answer; a helper that died or hangs is an error at once, not a wait."""
        self.q_in.put((cmd, args))
        deadline = time.monotonic() + timeout
        while True:
            try:
                kind, value = self.q_out.get(timeout=1.0)
                break
            except queue.Empty:
                if not self.proc.is_alive() or time.monotonic() > deadline:
                    why = f"no answer (exit {self.proc.exitcode})"
                    raise RuntimeError(f"helper {cmd}: {why}") from None
        if kind == "error":
            raise RuntimeError(f"helper {cmd}: {value}")
        return value

    def stop(self):
        self.q_in.put(("stop", ()))
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def ipc_payloads(device, helpers) -> dict:
    if device != "cuda":
        return {"skipped": "no GPU"}
    from megatron_p3o.weight_sync.ipc import serialize_named_tensors

    out, n = {}, 16 * MiB  # a 64 MiB fp32 tensor
    for case in ("shared", "per_receiver"):
        x = torch.arange(n, dtype=torch.float32, device="cuda").mul_(1e-3)
        want, ptr = _digest(x), x.data_ptr()
        if case == "shared":  # one serialization: one reference counted, two given back
            blobs = [serialize_named_tensors([("w", x)])] * len(helpers)
        else:  # one serialization per receiver, as fleet.py makes them
            blobs = [serialize_named_tensors([("w", x)]) for _ in helpers]
        opened = [h.ask("open", b, want) for h, b in zip(helpers, blobs)]
        helpers[0].ask("release")
        del x, blobs
        torch.cuda.ipc_collect()
        junk = [torch.full((n,), -7.0, device="cuda") for _ in range(4)]
        torch.cuda.synchronize()
        intact = helpers[1].ask("check", want)
        helpers[1].ask("release")
        out[case] = {"opened": opened, "second_intact_after_reuse": intact,
                     "sender_reused_the_block": ptr in [j.data_ptr() for j in junk]}  # fmt: skip
        del junk
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
    per = out["per_receiver"]
    out["ok"] = all(o["intact"] and o["device"] == "cuda:0" for c in ("shared", "per_receiver")
                    for o in out[c]["opened"]) and per["second_intact_after_reuse"]  # fmt: skip
    return out


def _train_like_step(target_bytes: int) -> torch.nn.Module:
    """An MLP's forward + backward whose activations (≈ ``target_bytes``) end up cached."""
    d, layers = 1024, 4
    rows = max(1024, target_bytes // ((layers + 2) * d * 4))
    torch.manual_seed(0)
    mods = [m for _ in range(layers) for m in (torch.nn.Linear(d, d), torch.nn.ReLU())]
    net = torch.nn.Sequential(*mods).cuda()
    net(torch.randn(rows, d, device="cuda")).square().mean().backward()
    torch.cuda.synchronize()
    return net  # parameters and gradients stay allocated, as a trainer's do


def cached_memory(device, server, objects) -> dict:
    if device != "cuda":
        return {"skipped": "no GPU"}
    from megatron_p3o.rollout.central import return_cached_memory

    torch.cuda.empty_cache()
    free0, total = torch.cuda.mem_get_info()
    net = _train_like_step(int(0.3 * free0))
    reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    releasable = sum(s["total_size"] for s in torch.cuda.memory_snapshot()
                     if s["allocated_size"] == 0)  # fmt: skip
    free1 = _free(device)
    block = free1 + releasable - MARGIN  # what will be free after the return, less the margin
    before = server.ask("alloc", block)
    return_cached_memory(objects, "round 5: the trainer returns its cached blocks")
    free2 = _free(device)
    after = server.ask("alloc", block)
    del net
    torch.cuda.empty_cache()
    ok = releasable >= 4 * MARGIN and not before["allocated"] and after["allocated"]
    return {"ok": ok, "total_gib": _gib(total), "free_before_step_gib": _gib(free0),
            "reserved_gib": _gib(reserved), "allocated_gib": _gib(allocated),
            "cached_gib": _gib(reserved - allocated), "releasable_gib": _gib(releasable),
            "free_holding_cache_gib": _gib(free1), "free_after_return_gib": _gib(free2),
            "block_gib": _gib(block), "server_while_cached": before,
            "server_after_return": after}  # fmt: skip


def _tiny_train_step(model, vocab: int, device) -> dict:
    """Forward, backward and an SGD step of the tiny model: new weights, and cached memory."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=g).to(device)
    pos = torch.arange(SEQ, device=device)[None].expand(BATCH, -1)
    logits = model(tokens, pos, None)[..., :vocab].float()
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, vocab), tokens[:, 1:].reshape(-1)
    )
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-LR)
                p.grad = None
    out = {"loss": loss.item()}
    del logits, loss
    if device.type == "cuda":
        torch.cuda.synchronize()
        r, a = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
        out.update(reserved=r, allocated=a, free=_free("cuda"))
    return out


def colocated_step(device, groups, objects, server) -> dict:
    from megatron_p3o.model.builder import BuildOptions, build_model
    from megatron_p3o.rollout.central import CentralEngine
    from megatron_p3o.rollout.sglang import SGLangConfig, SGLangEngine, SGLangFleet, protocol
    from megatron_p3o.types import SamplingParams
    from megatron_p3o.weight_sync.source import TrainerWeights
    from tests.distributed.bodies import desc_of

    cuda = device == "cuda"
    desc = desc_of("llama")
    chunks = build_model(desc, groups, BuildOptions(seq_length=SEQ))
    weights = TrainerWeights(chunks, groups, desc)
    model_bytes = sum(-(-t.numel() * t.element_size() // 16) * 16 for _, t in weights.full())
    kv_bytes = min(4 * GiB, _free(device) // 20) if cuda else MiB
    url = server.ask("serve", model_bytes, kv_bytes)
    cfg = SGLangConfig(url=url, tp_size=1, startup_timeout_s=30, request_timeout_s=60)
    fleet = SGLangFleet.solo(SGLangEngine(cfg), "colocated").start()
    eng = CentralEngine(fleet, groups, objects, "colocated")
    at_resume, resume = [], fleet.resume_memory

    def noted_resume(tags):  # the trainer's reserved memory as it asks the server to resume
        at_resume.append(torch.cuda.memory_reserved() if cuda else None)
        resume(tags)

    fleet.resume_memory = noted_resume
    sent, samples, want_token, error = {}, [], None, None
    step = {"loss": None, "reserved": 0, "allocated": 0, "free": None}
    try:
        eng.release_memory()
        step = _tiny_train_step(chunks[0], desc.vocab_size, groups.device)
        full = dict(weights.full())
        sent = {n: _digest(t) for n, t in full.items()}
        want_token = int(full["model.embed_tokens.weight"][PROMPT[-1]].float().argmax())
        del full
        eng.update_weights_colocated(weights, 1, server_tp=1, bucket_bytes=BUCKET)
        sp = SamplingParams(temperature=1.0, max_new_tokens=1, seed=0)
        samples = eng.generate([PROMPT], 1, sp)
    except Exception as e:  # the server's record still says how far it got
        error = f"{type(e).__name__}: {e}"
    fleet.stop()
    rec = server.ask("record")
    k = rec["routes"].count("/update_weights_from_tensor")
    want_routes = ["/pause_generation", MEMORY[0], MEMORY[1], "/begin_weight_update",
                   *["/update_weights_from_tensor"] * k, "/end_weight_update", MEMORY[1],
                   "/continue_generation", "/generate"]  # fmt: skip
    tags = [sorted(t) for _, t in rec["memory_tags"]]
    want_tags = [sorted(protocol.MEMORY_TAGS), sorted(protocol.RESUME_BEFORE_PUSH),
                 sorted(protocol.RESUME_AFTER_PUSH)]  # fmt: skip
    held = rec["held"]
    mismatched = sorted(n for n in set(sent) | set(held) if sent.get(n) != held.get(n))
    checks = {
        "route_order": rec["routes"] == want_routes and k >= 2,
        "memory_tags": tags == want_tags,
        "null_answers": rec["answers"] == [None, None, None],
        "bitwise": not mismatched and sorted(rec["pushed"]) == sorted(sent),
        "server_device": rec["devices"] == ["cuda:0" if cuda else "cpu"],
        "generate": [(s.weight_version, s.completion_ids) for s in samples] == [(1, [want_token])],
    }
    out = {"error": error, "routes": rec["routes"], "memory_tags": tags, "buckets": k,
           "tensors": len(sent), "mismatched": mismatched, "server_devices": rec["devices"],
           "loss": step["loss"], "server_memory": rec["memory"]}  # fmt: skip
    if cuda:
        cached = step["reserved"] - step["allocated"]
        dropped = bool(at_resume) and at_resume[0] < step["reserved"]
        checks["reserved_dropped_before_resume"] = cached >= 16 * MiB and dropped
        out["trainer_memory"] = {
            "after_step_reserved_mib": round(step["reserved"] / MiB, 1),
            "after_step_cached_mib": round(cached / MiB, 1),
            "at_resume_reserved_mib": [round(r / MiB, 1) for r in at_resume],
            "after_step_free_gib": _gib(step["free"]),
            "server_at_resumes": rec["memory"][1:],
        }
    else:
        out["memory"] = {"skipped": "no GPU"}
    return {"ok": error is None and all(checks.values()), "checks": checks, **out}


def _part(fn, *args) -> dict:
    try:
        return fn(*args)
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}",
                "trace": traceback.format_exc().splitlines()[-12:]}  # fmt: skip


def verdict(part: dict) -> str:
    return "skipped" if "skipped" in part else ("ok" if part.get("ok") else "FAILED")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    helpers = [Helper(ctx, a.device) for _ in range(2 if a.device == "cuda" else 1)]
    report = {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        from megatron_p3o.runtime.parallel import Layout, destroy, initialize, new_object_group

        groups = initialize(Layout())  # world 1: NCCL on the GPU, gloo on the CPU
        objects = new_object_group()
        for name, fn, args in [
            ("ipc_payloads", ipc_payloads, (helpers,)),
            ("cached_memory", cached_memory, (helpers[0], objects)),
            ("colocated", colocated_step, (groups, objects, helpers[-1])),
        ]:
            report[name] = _part(fn, a.device, *args)
            (out / "round5.json").write_text(json.dumps(report, indent=2))  # kept if killed
            print(f"round5: {name}: {verdict(report[name])}", flush=True)
        destroy()
    finally:
        for h in helpers:
            h.stop()
    ipc = report["ipc_payloads"]
    shared = ipc.get("shared", {}).get("second_intact_after_reuse", "skipped")
    parts = [report[k] for k in ("colocated", "cached_memory", "ipc_payloads")]
    print(f"RESULT round5 colocated={verdict(parts[0])} cached_returned={verdict(parts[1])} "
          f"ipc_per_receiver={verdict(parts[2])} ipc_shared_second_intact={shared}")  # fmt: skip
    return 0 if all(verdict(p) != "FAILED" for p in parts) else 1


if __name__ == "__main__":
    sys.exit(main())
