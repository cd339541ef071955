"""The trainer driving one SGLang server for all ranks (``rollout.engine: sglang``), on CPU.

The server here is a loopback stand-in speaking SGLang's HTTP protocol (/health, /generate with
``return_logprob``, /update_weights_from_disk), sampling with the embedded engine. What is under
test is the trainer's side: prompts of every DP leader reach the one server once (no duplicates
from model-parallel ranks), weights stream stage by stage to rank 0 and reach the server through
a safetensors directory after every sync point, samples carry the version the server reports,
and async staleness stays within K. A real server on a GPU: tools/gpu_check.sh.
"""

import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Optional

import pytest

from ..sglang_standin import SGLangStandIn
from .cli import ENV, ROOT, sglang_disk_sets, torchrun
from .test_tiny_recipe import _sets


class StandIn(SGLangStandIn):
    """SGLang's protocol and rules (``tests/sglang_standin.py``) over the embedded engine."""

    def __init__(self, hf_dir: Path, nan_logprobs: bool = False, api_key: Optional[str] = None):
        from megatron_p3o.rollout.embedded import EmbeddedEngine

        self.nan_logprobs = nan_logprobs  # report NaN behaviour log-probs (a broken server)
        cfg = json.loads((hf_dir / "config.json").read_text())
        self.engine = EmbeddedEngine(cfg, "bf16", pad_token_id=cfg.get("pad_token_id") or 0)
        self.engine_lock = threading.Lock()
        super().__init__(self._generate, api_key=api_key, load_from_disk=self._load)

    def _load(self, model_path: str) -> None:
        from safetensors.torch import load_file

        tensors = {}
        for f in sorted(Path(model_path).glob("*.safetensors")):
            tensors.update(load_file(str(f)))
        with self.engine_lock:
            self.engine.update_weights([list(tensors.items())], len(self.loads))

    def _generate(self, body: dict):
        from megatron_p3o.types import SamplingParams

        sp = body["sampling_params"]
        params = SamplingParams(
            temperature=sp["temperature"],
            top_p=sp["top_p"],
            top_k=sp.get("top_k", 0),
            max_new_tokens=sp["max_new_tokens"],
            stop_token_ids=tuple(sp.get("stop_token_ids", ())),
            seed=sp.get("sampling_seed"),
        )
        with self.engine_lock:
            s = self.engine.generate([body["input_ids"]], 1, params)[0]
        lps = [float("nan")] * len(s.logprobs) if self.nan_logprobs else s.logprobs
        return s.completion_ids, lps, s.finish_reason


@pytest.mark.e2e
@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_trainer_drives_one_server(base, tmp_path, layout):
    key = f"test-secret-{layout}-{os.getpid()}"  # as the batch script makes one per job
    srv = StandIn(base / "ckpt" / "hf", api_key=key)
    steps, prompts, n = 3, 8, 8
    heldout = tmp_path / "heldout_small.jsonl"  # each evaluation: one request per prompt
    heldout.write_text("".join((base / "heldout.jsonl").read_text().splitlines(keepends=True)[:24]))
    extra = (
        ["--set", "parallel.pp=2"] if layout == "pp2" else ["--set", "batch.micro_batch_size=16"]
    )
    r = subprocess.run(
        [
            *torchrun(2),
            "-m",
            "megatron_p3o.train",
            str(ROOT / "recipes/tiny_cpu.yaml"),
            *_sets(base, tmp_path, layout, steps=steps),
            *extra,
            *sglang_disk_sets(srv.url, tmp_path / "sync"),
            "--set",
            "rollout.max_staleness=1",
            "--set",
            "rollout.dynamic_sampling=true",
            "--set",
            f"data.eval_path={heldout}",
        ],
        capture_output=True,
        text=True,
        env={**ENV, "P3O_SGLANG_API_KEY": key},
        timeout=900,
    )
    srv.close()
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert srv.refused == 0  # every request carried the key
    leaked = [
        f for f in (tmp_path / layout).rglob("*") if f.is_file() and key.encode() in f.read_bytes()
    ]
    assert not leaked, f"the API key reached the run directory: {leaked}"
    assert key not in r.stdout and key not in r.stderr
    lines = [json.loads(x) for x in (tmp_path / layout / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert srv.loads == [0, 1, 2, 3]  # the start, then every sync point, each exactly once
    rollout = sum(prompts * n + m["dynamic_refilled"] * n for m in lines)
    # every DP leader's prompts once, model-parallel ranks add nothing, the async producer stops
    # at the last step; and two held-out evaluations of 24 prompts
    assert srv.generated == rollout + 2 * 24, (srv.generated, rollout)
    assert all(m["staleness_max"] <= 1 for m in lines) and all(0 < m["ess"] <= 1 for m in lines)
    # the loss side lives on the last pipeline stage; the logger (rank 0) is the first (pp2)
    for key in ("loss", "ratio_p99", "abs_logprob_diff", "k3_to_behavior", "log_ratio_hist"):
        assert all(key in m for m in lines), (key, sorted(lines[0]))
    assert "held-out accuracy before training" in r.stdout
