"""``Trainer.step()``: generate → reward → advantages → (ESS pre-pass + gradient pass) →
optimizer step → weight sync. No maths here: each stage is a call into its own module.

Each DP rank rolls out its own share of the prompts; the model-parallel ranks of one DP rank
hold identical engines with identical seeds, so they produce identical samples without talking.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist

from .advantage import group_advantages
from .batching import samples_to_microbatches
from .checkpoint import (latest_checkpoint, load_model_state, load_training_checkpoint,
                         save_training_checkpoint)
from .config import TrainConfig, to_dict
from .hf.dist_stream import read_meta
from .loss import build_objective
from .loss.step_loss import StepLoss, StepLossConfig
from .model.builder import BuildOptions, build_model
from .model.description import description_to_hf_config
from .optim import build_optimizer, build_scheduler, wrap_ddp, zero_grads
from .parallel import ParallelGroups
from .reward import build_reward, score_samples
from .rollout.embedded import EmbeddedEngine
from .rollout.engine import check_behaviour_semantics
from .rollout.prompts import PromptData, all_rows
from .types import SamplingParams
from .weight_sync import iter_hf_buckets, iter_hf_tensors


class Trainer:
    def __init__(self, cfg: TrainConfig, groups: ParallelGroups):
        from transformers import AutoTokenizer

        self.cfg, self.groups = cfg, groups
        ckpt = Path(cfg.model.checkpoint)
        meta = read_meta(ckpt)
        self.desc = meta["description"]
        dtype = getattr(torch, cfg.model.params_dtype)
        self.chunks = build_model(self.desc, groups, BuildOptions(
            params_dtype=dtype, make_vocab_size_divisible_by=meta["make_vocab_size_divisible_by"],
            seq_length=cfg.model.seq_length, use_te=cfg.model.use_te, fp8=cfg.model.fp8))
        load_model_state(self.chunks, ckpt)
        self.ddp = wrap_ddp(self.chunks, groups, cfg.optim)
        self.opt = build_optimizer(self.ddp, groups, cfg.optim)
        self.sched = build_scheduler(self.opt, cfg.optim)
        self.tok = AutoTokenizer.from_pretrained(ckpt / "hf")
        s = cfg.rollout.sampling
        eos = self.tok.eos_token_id
        self.sampling = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                       max_new_tokens=s.max_new_tokens,
                                       stop_token_ids=(eos,) if eos is not None else ())
        check_behaviour_semantics(self.sampling, s.temperature, cfg.loss.objective)
        self.objective = build_objective(cfg.loss.objective, **cfg.loss.hyper)
        self.loss = StepLoss(self.objective, groups, self.desc.vocab_size, StepLossConfig(
            temperature=s.temperature, ess_scope=cfg.loss.ess_scope, nonfinite=cfg.loss.nonfinite,
            logprob_chunk=cfg.loss.logprob_chunk))
        if cfg.rollout.engine != "embedded":
            raise NotImplementedError("the trainer drives the embedded engine for now; SGLang wiring "
                                      "(launch per node, NCCL weight sync) is the next step")
        self.engine = EmbeddedEngine(description_to_hf_config(self.desc), cfg.rollout.precision,
                                     pad_token_id=self.tok.pad_token_id or 0)
        self.data = PromptData(cfg.data.path, self.tok, prompt_key=cfg.data.prompt_key,
                               answer_key=cfg.data.answer_key, chat_template=cfg.data.chat_template,
                               shuffle=cfg.data.shuffle, seed=cfg.run.seed, dp_rank=groups.dp_rank,
                               dp_size=groups.layout.dp)
        self.reward_fn = build_reward(cfg.reward.kind, cfg.reward.function)
        self.step_idx = 0
        self.run_dir = Path(cfg.run.dir) / cfg.run.name
        self.rank0 = groups.rank == 0
        self.tb = None
        if self.rank0:
            from torch.utils.tensorboard import SummaryWriter

            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        self.resumed_from = latest_checkpoint(self.run_dir)
        if self.resumed_from is not None:  # the same command again continues the run
            st = load_training_checkpoint(self.resumed_from, self.chunks, self.opt, self.sched)
            self.step_idx = int(st["step"])
            self.data.load_state(st["data"][str(groups.dp_rank)])
        self.sync_weights()

    # -- stages ---------------------------------------------------------------------------------
    def sync_weights(self) -> None:
        """Push the trainer's weights into this rank's engine (all ranks take part)."""
        tensors = list(iter_hf_tensors(self.chunks, self.groups, self.desc))
        if self.groups.layout.pp > 1:
            parts: List = [None] * self.groups.layout.pp
            # PP group: each stage exported its own layers; every rank's engine needs all of them.
            dist.all_gather_object(parts, tensors, group=self.groups.pp)
            tensors = [t for p in parts for t in p]
        self.engine.update_weights(iter_hf_buckets(iter(tensors), 64 * 2**20), version=self.step_idx)

    def _decode(self, ids: List[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True).replace(" ", "")

    def step(self) -> Dict[str, float]:
        cfg, t = self.cfg, {}
        t0 = time.perf_counter()
        items = self.data.next(cfg.batch.prompts_per_rollout)
        sp = SamplingParams(**{**self.sampling.__dict__, "seed": cfg.run.seed * 7919 + self.step_idx * 31
                               + self.groups.dp_rank})
        samples = self.engine.generate([it.prompt_ids for it in items], cfg.rollout.n_samples, sp)
        t["rollout_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        rewards = score_samples(self.reward_fn, [self._decode(s.completion_ids) for s in samples],
                                [items[s.group_id].answer for s in samples], [s.group_id for s in samples])
        gids = torch.tensor([s.group_id for s in samples])
        adv = group_advantages(torch.tensor(rewards), gids, cfg.advantage.kind, cfg.advantage.eps)
        t["reward_s"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        per_step = len(samples) // cfg.batch.minibatches
        metrics: Dict[str, float] = {}
        for _ in range(cfg.batch.epochs):
            for m in range(cfg.batch.minibatches):
                sl = slice(m * per_step, (m + 1) * per_step)
                mbs = samples_to_microbatches(samples[sl], adv[sl], cfg.model.seq_length,
                                              cfg.batch.micro_batch_size, self.tok.pad_token_id or 0,
                                              first_index=m * per_step)
                zero_grads(self.ddp, self.opt)
                metrics = self.loss.run(self.ddp, mbs)
                ok, gnorm, _ = self.opt.step()
                self.sched.step(1)
                metrics["grad_norm"] = float(gnorm) if gnorm is not None else float("nan")
        t["train_s"] = time.perf_counter() - t2
        self.step_idx += 1
        if cfg.checkpoint.every and self.step_idx % cfg.checkpoint.every == 0:
            self.save_checkpoint()
        if self.step_idx % cfg.rollout.sync_every == 0:
            t3 = time.perf_counter()
            self.sync_weights()
            t["sync_s"] = time.perf_counter() - t3
        toks = sum(len(s.completion_ids) for s in samples)
        out = {"step": self.step_idx, **metrics, **t, "reward_mean": float(sum(rewards) / len(rewards)),
               "completion_len": toks / len(samples), "rollout_tok_per_s": toks / max(t["rollout_s"], 1e-9),
               "train_tok_per_s": cfg.batch.epochs * metrics.get("n_tokens", 0.0) * cfg.batch.minibatches
               / max(t["train_s"], 1e-9),
               "weight_version": self.engine.weight_version, "lr": self.opt.param_groups[0]["lr"]}
        self._reduce_reward(out)
        if self.rank0:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(out) + "\n")
            for k, v in out.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(f"train/{k}", v, self.step_idx)
            self.tb.flush()
        return out

    def _reduce_reward(self, out: Dict[str, float]) -> None:
        if self.groups.layout.dp > 1:
            t = torch.tensor([out["reward_mean"]], dtype=torch.float64)
            # DP group: every DP rank scored its own prompts; report the mean over all of them.
            dist.all_reduce(t, group=self.groups.dp)
            out["reward_mean"] = float(t) / self.groups.layout.dp

    def evaluate(self, path: str, limit: int = 0) -> float:
        """Greedy (top-1) accuracy on a held-out file, in the engine's precision."""
        rows = all_rows(path, self.tok, self.cfg.data.prompt_key, self.cfg.data.answer_key)
        rows = rows[:limit] if limit else rows
        rows = rows[self.groups.dp_rank::self.groups.layout.dp]
        sp = SamplingParams(temperature=1.0, top_k=1, max_new_tokens=self.sampling.max_new_tokens,
                            stop_token_ids=self.sampling.stop_token_ids, seed=0)
        samples = self.engine.generate([r[0] for r in rows], 1, sp)
        correct = sum(float(self.reward_fn(self._decode(s.completion_ids), rows[s.group_id][1]))
                      for s in samples)
        t = torch.tensor([correct, len(rows)], dtype=torch.float64)
        if self.groups.layout.dp > 1:
            # DP group: each DP rank evaluated a disjoint share of the held-out prompts.
            dist.all_reduce(t, group=self.groups.dp)
        acc = float(t[0] / t[1])
        if self.tb is not None:
            self.tb.add_scalar("eval/heldout_accuracy", acc, self.step_idx)
            self.tb.flush()
        return acc

    def save_checkpoint(self) -> Path:
        """Model, optimizer, scheduler, RNG, every DP rank's data cursor and the step."""
        cursors: List = [None] * self.groups.world_size
        # World: each DP rank has its own cursor; rank 0 stores them all in the common state.
        dist.all_gather_object(cursors, (self.groups.dp_rank, self.data.state()))
        state = {"data": {str(r): c for r, c in cursors}, "weight_version": self.engine.weight_version}
        return save_training_checkpoint(self.run_dir, self.step_idx, self.chunks, self.opt, self.sched,
                                        state, keep_last=self.cfg.checkpoint.keep_last)
