"""The real SGLang 0.5.23 CPU server loads and serves a trained policy's HF export (issue 41,
item 1): the checkpoint the trainer wrote at TP=2 × PP=2, exported by
``checkpoints_convert.megatron_to_hf --ckpt RUN_DIR`` (the ``trained_export`` fixture).

Served in fp32, the log-prob SGLang reports for each sampled token equals transformers' fp32
teacher-forced log-prob of the same token under the export (loaded with
``AutoModelForCausalLM.from_pretrained``, nothing of this project's) within 1e-5.
"""

import json
import shutil
import urllib.request

import pytest
import torch

from megatron_p3o.rollout.sglang import SGLangConfig, build_fleet
from megatron_p3o.runtime.ports import free_port

from .conftest import kill_launched, log_tail

pytestmark = [pytest.mark.sglang, pytest.mark.e2e]


def test_the_export_of_a_trained_checkpoint_is_served(trained_export, base, tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_p3o.data.prompts import all_rows

    _, hf = trained_export
    served = tmp_path / "hf"
    shutil.copytree(hf, served)
    cfg = json.loads((served / "config.json").read_text())
    cfg["max_position_embeddings"] = 512  # SGLang's CPU scheduler wants room past the prompt
    (served / "config.json").write_text(json.dumps(cfg))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(served)
    prompts = [ids for ids, _ in all_rows(str(base / "heldout.jsonl"), tok)[:8]]
    sg = SGLangConfig(model_path=str(served), dtype="float32", port=free_port(),
                      startup_timeout_s=300, max_restarts=0)  # fmt: skip
    fleet = build_fleet(sg, [], tmp_path / "logs", "disk")
    got = []
    try:
        fleet.start()  # launched on the export itself: the server loads it
        url = fleet.workers[0].url
        for ids in prompts:  # plain SGLang HTTP, as any client of the export would send it
            params = {"temperature": 1.0, "max_new_tokens": 5, "n": 4,
                      "stop_token_ids": [tok.eos_token_id]}  # fmt: skip
            body = {"input_ids": ids, "return_logprob": True, "sampling_params": params}
            req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
            with urllib.request.urlopen(req, timeout=120) as r:
                outs = json.loads(r.read())
            for o in outs if isinstance(outs, list) else [outs]:
                lps = o["meta_info"]["output_token_logprobs"]
                got.append((ids, [t for _, t, _ in lps], [lp for lp, _, _ in lps]))
    except BaseException:
        print(log_tail(tmp_path / "logs"))
        raise
    finally:
        fleet.stop()
        kill_launched(tmp_path / "logs")
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    assert len(got) == 32 and all(c for _, c, _ in got)
    worst = 0.0
    for prompt, completion, logprobs in got:
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])
        lb = torch.tensor(logprobs, dtype=torch.float64)
        worst = max(worst, float((lb - ref[:, 0]).abs().max()))
    assert worst <= 1e-5, worst
