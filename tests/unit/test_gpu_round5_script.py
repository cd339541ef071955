"""tools/gpu_check.sh's round-5 step (tools/gpu_round5.py, issue 52) works here: the colocated
push of the tiny Llama through the real client against the script's stand-in, on CPU tensors
with gloo (route order, tags, ``null`` answers, every tensor bit for bit, a generation after the
push), the GPU-only parts marked skipped; and the stand-in refuses what SGLang 0.5.23 refuses,
which the GPU step's meaning rests on."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _run_on_cpu(script: str, out: Path, report: str):
    """``tools/<script> --device cpu --out OUT``: its JSON report and its stdout."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "tools" / script), "--device", "cpu", "--out", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads((out / report).read_text()), r.stdout


def test_gpu_round5_script_runs_here(tmp_path):
    rep, stdout = _run_on_cpu("gpu_round5.py", tmp_path, "round5.json")
    assert rep["ipc_payloads"] == {"skipped": "no GPU"}
    assert rep["cached_memory"] == {"skipped": "no GPU"}
    co = rep["colocated"]
    assert co["ok"] and co["error"] is None and all(co["checks"].values()), co
    assert set(co["checks"]) == {"route_order", "memory_tags", "null_answers", "bitwise",
                                 "server_device", "generate"}  # fmt: skip
    k = co["buckets"]
    assert k >= 2 and co["tensors"] > k and not co["mismatched"]
    assert co["routes"] == [
        "/pause_generation", "/release_memory_occupation", "/resume_memory_occupation",
        "/begin_weight_update", *["/update_weights_from_tensor"] * k, "/end_weight_update",
        "/resume_memory_occupation", "/continue_generation", "/generate",
    ]  # fmt: skip
    assert co["memory_tags"] == [["cuda_graph", "kv_cache", "weights"], ["weights"],
                                 ["cuda_graph", "kv_cache"]]  # fmt: skip
    assert co["server_devices"] == ["cpu"] and co["memory"] == {"skipped": "no GPU"}
    assert ("RESULT round5 colocated=ok cached_returned=skipped ipc_per_receiver=skipped "
            "ipc_shared_second_intact=skipped") in stdout  # fmt: skip


def _round5():
    spec = importlib.util.spec_from_file_location("gpu_round5", ROOT / "tools/gpu_round5.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_round5_stand_in_refuses_what_sglang_refuses():
    """No release unless paused, no generation while paused or released, no push into released
    weights; release frees its memory and resume takes it back; ``null`` from the memory
    routes; a push lands in its weights' memory bit for bit, and the generation reads it."""
    from megatron_p3o.rollout.sglang.protocol import tensor_payload
    from megatron_p3o.weight_sync.ipc import serialize_named_tensors

    mod = _round5()
    emb = torch.randn(10, 8, generator=torch.Generator().manual_seed(0))
    push = tensor_payload([serialize_named_tensors([("model.embed_tokens.weight", emb)])], 2, True)
    gen = {"input_ids": [1, 3], "sampling_params": {"max_new_tokens": 1}}
    everything = ["kv_cache", "weights", "cuda_graph"]
    srv = mod.GPUStandIn("cpu", 4096, 1024)
    try:
        assert srv.handle("/release_memory_occupation", {"tags": everything})[1] == 400
        assert set(srv.regions) == set(everything)
        assert srv.handle("/pause_generation", {})[1] == 200
        assert srv.handle("/release_memory_occupation", {"tags": everything}) == (None, 200)
        assert srv.regions == {}
        assert srv.handle("/generate", gen)[1] == 400
        assert srv.handle("/begin_weight_update", {})[1] == 200
        assert srv.handle("/update_weights_from_tensor", push)[1] == 400  # weights released
        assert srv.handle("/resume_memory_occupation", {"tags": ["weights"]}) == (None, 200)
        assert srv.handle("/update_weights_from_tensor", push)[1] == 200
        assert torch.equal(srv.views["model.embed_tokens.weight"], emb)
        assert srv.handle("/end_weight_update", {})[1] == 200
        assert srv.handle("/generate", gen)[1] == 400  # KV cache still released, and paused
        after = {"tags": ["kv_cache", "cuda_graph"]}
        assert srv.handle("/resume_memory_occupation", after) == (None, 200)
        assert srv.handle("/continue_generation", {})[1] == 200
        out, code = srv.handle("/generate", gen)
        assert code == 200 and out["output_ids"] == [int(emb[3].argmax())]
        assert out["meta_info"]["weight_version"] == "2"
        rec = srv.record()
        assert rec["answers"] == [None, None, None]
        assert rec["pushed"] == ["model.embed_tokens.weight"]
        assert rec["held"]["model.embed_tokens.weight"] == mod._digest(emb)
        assert [p for p, _ in rec["memory_tags"]].count("/release_memory_occupation") == 2
    finally:
        srv.close()


def test_gpu_round6_script_runs_here(tmp_path):
    """tools/gpu_check.sh's round-6 step (issue 63) on CPU tensors: the padded-vocabulary
    chunks against float64 and the payload aliasing check run; the free-memory part is
    skipped (no CUDA memory here)."""
    rep, stdout = _run_on_cpu("gpu_round6.py", tmp_path, "round6.json")
    assert rep["padded_chunks"]["ok"] and max(rep["padded_chunks"]["rel"].values()) < 1e-4
    assert rep["payload_aliasing"] == {"ok": True, "shares_storage": False}
    assert "skipped" in rep["colocated_fraction"]
