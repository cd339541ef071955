"""``Trainer.step()``: rollout (generate + reward, scheduled) → replay → advantages → (ESS
pre-pass + gradient pass) → optimizer step → publish weights. No maths here: each stage is a call
into its own module.

Each DP rank rolls out its own share of the prompts; the model-parallel ranks of one DP rank
hold identical engines with identical seeds, so they produce identical samples without talking.
Which weight version generates which batch (sync, lagged every L, async with staleness ≤ K) is
the rollout scheduler's rule (:mod:`megatron_p3o.rollout.scheduler`).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist

from .advantage import group_advantages
from .batching import samples_to_microbatches
from .checkpoint import (
    latest_checkpoint,
    load_model_state,
    load_training_checkpoint,
    save_training_checkpoint,
)
from .config import TrainConfig, to_dict
from .hf.dist_stream import read_meta
from .loss import build_objective
from .loss.oapl import oapl_advantages
from .loss.step_loss import StepLoss, StepLossConfig
from .model.builder import BuildOptions, build_model
from .model.description import description_to_hf_config
from .optim import build_optimizer, build_scheduler, wrap_ddp, zero_grads
from .parallel import ParallelGroups
from .replay import ReplayBuffer
from .reward import build_reward, score_samples
from .rollout.embedded import EmbeddedEngine
from .rollout.engine import check_behaviour_semantics
from .rollout.prompts import PromptData, all_rows, remap_states
from .rollout.scheduler import Publication, RolloutPlan, RolloutScheduler
from .types import SamplingParams
from .weight_sync import iter_hf_tensors


class Trainer:
    def __init__(self, cfg: TrainConfig, groups: ParallelGroups):
        from transformers import AutoTokenizer

        self.cfg, self.groups = cfg, groups
        ckpt = Path(cfg.model.checkpoint)
        meta = read_meta(ckpt)
        self.desc = meta["description"]
        dtype = getattr(torch, cfg.model.params_dtype)
        self.chunks = build_model(
            self.desc,
            groups,
            BuildOptions(
                params_dtype=dtype,
                make_vocab_size_divisible_by=meta["make_vocab_size_divisible_by"],
                seq_length=cfg.model.seq_length,
                use_te=cfg.model.use_te,
                fp8=cfg.model.fp8,
            ),
        )
        load_model_state(self.chunks, ckpt)
        self.ddp = wrap_ddp(self.chunks, groups, cfg.optim)
        self.opt = build_optimizer(self.ddp, groups, cfg.optim)
        self.sched = build_scheduler(self.opt, cfg.optim)
        self.tok = AutoTokenizer.from_pretrained(ckpt / "hf")
        s = cfg.rollout.sampling
        eos = self.tok.eos_token_id
        self.sampling = SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_new_tokens=s.max_new_tokens,
            stop_token_ids=(eos,) if eos is not None else (),
        )
        check_behaviour_semantics(self.sampling, s.temperature, cfg.loss.objective)
        engine_sampling = self.sampling
        if cfg.rollout.engine_temperature is not None:  # deliberate mismatch (stress experiments)
            engine_sampling = replace(self.sampling, temperature=cfg.rollout.engine_temperature)
        self.objective = build_objective(cfg.loss.objective, **cfg.loss.hyper)
        self.loss = StepLoss(
            self.objective,
            groups,
            self.desc.vocab_size,
            StepLossConfig(
                temperature=s.temperature,
                ess_scope=cfg.loss.ess_scope,
                nonfinite=cfg.loss.nonfinite,
                logprob_chunk=cfg.loss.logprob_chunk,
            ),
        )
        self.central = cfg.rollout.engine == "sglang"
        if self.central:
            self.engine, self.eval_engine = self._central_engines()
        else:
            self.engine = self.eval_engine = EmbeddedEngine(
                description_to_hf_config(self.desc),
                cfg.rollout.precision,
                pad_token_id=self.tok.pad_token_id or 0,
            )
        self.data = PromptData(
            cfg.data.path,
            self.tok,
            prompt_key=cfg.data.prompt_key,
            answer_key=cfg.data.answer_key,
            chat_template=cfg.data.chat_template,
            shuffle=cfg.data.shuffle,
            seed=cfg.run.seed,
            dp_rank=groups.dp_rank,
            dp_size=groups.layout.dp,
        )
        self.reward_fn = build_reward(cfg.reward.kind, cfg.reward.function)
        self.replay = ReplayBuffer(cfg.replay)
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
        pending: List = []
        if self.resumed_from is not None:  # the same command again continues the run
            st = load_training_checkpoint(self.resumed_from, self.chunks, self.opt, self.sched)
            self.step_idx = int(st["step"])
            pending = self._load_rank_state(st["ranks"])
        dp = groups.layout.dp
        plan = RolloutPlan(
            prompts=cfg.batch.prompts_per_rollout // dp,
            n_samples=cfg.rollout.n_samples,
            sampling=engine_sampling,
            sync_every=cfg.rollout.sync_every,
            max_staleness=cfg.rollout.max_staleness,
            dynamic_sampling=cfg.rollout.dynamic_sampling,
            max_rounds=cfg.rollout.dynamic_max_rounds,
            logprob_noise=cfg.rollout.logprob_noise,
            seed=cfg.run.seed,
            dp_rank=groups.dp_rank,
            end=cfg.steps,
        )
        if self.central:  # the server gets the trainer's weights now (attached or resumed runs)
            self._push_central()
        self.rollout = RolloutScheduler(
            self.engine,
            self.data,
            self._score,
            plan,
            self.step_idx,
            [] if self.central else self.export_weights(),
            pending,
        )

    # -- stages ---------------------------------------------------------------------------------
    def export_weights(self) -> List:
        """The trainer's weights as full HF-named tensors (all ranks take part)."""
        tensors = list(iter_hf_tensors(self.chunks, self.groups, self.desc))
        if self.groups.layout.pp > 1:
            parts: List = [None] * self.groups.layout.pp
            # PP group: each stage exported its own layers; every rank's engine needs all of them.
            dist.all_gather_object(parts, tensors, group=self.groups.pp)
            tensors = [t for p in parts for t in p]
        return tensors

    def _central_engines(self):
        """SGLang on global rank 0, driven for every rank (see ``rollout.central``): one view for
        the rollout producer, one for evaluation, each with its own object group."""
        import os

        from .parallel import new_object_group
        from .rollout.central import CentralEngine
        from .rollout.sglang_engine import SGLangEngine, SGLangFleet

        r = self.cfg.rollout
        inner = None
        if self.groups.rank == 0:
            router = SGLangEngine(r.sglang)
            workers = [SGLangEngine(replace(r.sglang, url=u)) for u in r.sglang_workers] or [router]
            inner = SGLangFleet(router, workers).start()
            if r.weight_sync == "nccl":
                inner.init_weight_update_groups(
                    os.environ.get("MASTER_ADDR", "127.0.0.1"), r.weight_sync_port
                )
        hf = description_to_hf_config(self.desc, self.cfg.model.params_dtype)
        return tuple(
            CentralEngine(
                inner, self.groups, new_object_group(), r.weight_sync, r.weight_sync_dir, hf
            )
            for _ in range(2)
        )

    def _push_central(self) -> None:
        """Stream the weights to rank 0 and push them to the server (every rank takes part)."""
        from .weight_sync import iter_hf_buckets
        from .weight_sync.stream import iter_hf_tensors_to_rank0

        tensors = iter_hf_tensors_to_rank0(self.chunks, self.groups, self.desc)
        self.engine.update_weights(iter_hf_buckets(tensors, 256 * 2**20), self.step_idx)
        self.eval_engine.weight_version = self.step_idx

    def _decode(self, ids: List[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True).replace(" ", "")

    def _score(self, samples, answers) -> List[float]:
        return score_samples(
            self.reward_fn,
            [self._decode(s.completion_ids) for s in samples],
            answers,
            [s.group_id for s in samples],
        )

    def step(self) -> Dict[str, float]:
        cfg, t = self.cfg, {}
        t0 = time.perf_counter()
        res = self.rollout.next()
        t["rollout_wait_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        batch, rstats = self.replay.compose(res.groups, self.step_idx, res.dropped)
        samples = []
        for gi, g in enumerate(batch):
            for s in g.samples:
                s.group_id = gi
                samples.append(s)
        rewards = torch.tensor([float(s.reward) for s in samples], dtype=torch.float64)
        gids = torch.tensor([s.group_id for s in samples])
        if self.objective.name == "oapl":  # OAPL regresses onto its own optimal advantage r − V*
            adv = oapl_advantages(rewards, gids, self.objective.hyper.beta1)
        else:
            adv = group_advantages(rewards, gids, cfg.advantage.kind, cfg.advantage.eps)
        stale = torch.tensor([float(self.step_idx - s.weight_version) for s in samples])
        t["advantage_s"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        all_mbs = samples_to_microbatches(
            samples,
            adv,
            cfg.model.seq_length,
            cfg.batch.micro_batch_size,
            self.tok.pad_token_id or 0,
        )
        if self.objective.needs_old_logprobs:  # πold/πprox = the policy before this batch's updates
            self.loss.recompute_old_logprobs(self.ddp, all_mbs)
        per_step = len(all_mbs) // cfg.batch.minibatches
        metrics: Dict[str, float] = {}
        for _ in range(cfg.batch.epochs):
            for m in range(cfg.batch.minibatches):
                mbs = all_mbs[m * per_step : (m + 1) * per_step]
                zero_grads(self.ddp, self.opt)
                metrics = self.loss.run(self.ddp, mbs)
                ok, gnorm, _ = self.opt.step()
                self.sched.step(1)
                metrics["grad_norm"] = float(gnorm) if gnorm is not None else float("nan")
        t["train_s"] = time.perf_counter() - t2
        self.step_idx += 1
        t3 = time.perf_counter()
        sync = self.step_idx % cfg.rollout.sync_every == 0
        if self.central and sync:
            self._push_central()
        weights = ([] if self.central else self.export_weights()) if sync else None
        self.rollout.publish(self.step_idx - 1, self.step_idx, weights, self.replay.take_reeval())
        t["sync_s"] = time.perf_counter() - t3
        if cfg.checkpoint.every and self.step_idx % cfg.checkpoint.every == 0:
            self.save_checkpoint()
        toks = sum(len(s.completion_ids) for s in samples)
        out = {
            "step": self.step_idx,
            **metrics,
            **t,
            **res.stats,
            **rstats,
            "reward_mean": float(rewards.mean()),
            "completion_len": toks / len(samples),
            "train_tok_per_s": cfg.batch.epochs
            * metrics.get("n_tokens", 0.0)
            * cfg.batch.minibatches
            / max(t["train_s"], 1e-9),
            "staleness_mean": float(stale.mean()),
            "staleness_max": float(stale.max()),
            "weight_version": self.step_idx,
            "lr": self.opt.param_groups[0]["lr"],
        }
        self._reduce_reward(out)
        out["rollout_tok_per_s"] = out["rollout_tokens"] / max(out["rollout_s"], 1e-9)
        if self.rank0:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(out) + "\n")
            for k, v in out.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(f"train/{k}", v, self.step_idx)
            self.tb.flush()
        return out

    _DP_SUMS = (
        "rollout_tokens",
        "dynamic_refilled",
        "reeval_groups",
        "replay_groups",
        "homogeneous_groups",
    )
    _DP_MEANS = ("reward_mean", "completion_len", "staleness_mean", "rollout_s", "rollout_wait_s")

    def _reduce_reward(self, out: Dict[str, float]) -> None:
        """Rollout-side numbers of the whole step: each DP rank rolled out and scored its own
        prompts (DP group: sums, means and the staleness maximum over all of them)."""
        dp = self.groups.layout.dp
        if dp == 1:
            return
        keys = self._DP_SUMS + self._DP_MEANS
        t = torch.tensor([float(out.get(k, 0.0)) for k in keys], dtype=torch.float64)
        dist.all_reduce(t, group=self.groups.dp)
        for k, v in zip(keys, t.tolist()):
            if k in out:
                out[k] = v if k in self._DP_SUMS else v / dp
        m = torch.tensor([out["staleness_max"]], dtype=torch.float64)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=self.groups.dp)
        out["staleness_max"] = float(m)

    def evaluate(self, path: str, limit: int = 0) -> float:
        """Greedy (top-1) accuracy on a held-out file with the current weights, in the engine's
        precision (the engine is borrowed from the rollout producer for the duration)."""
        rows = all_rows(path, self.tok, self.cfg.data.prompt_key, self.cfg.data.answer_key)
        rows = rows[:limit] if limit else rows
        rows = rows[self.groups.dp_rank :: self.groups.layout.dp]
        sp = SamplingParams(
            temperature=1.0,
            top_k=1,
            max_new_tokens=self.sampling.max_new_tokens,
            stop_token_ids=self.sampling.stop_token_ids,
            seed=0,
        )
        if self.central:  # the server holds the weights of the last sync point
            samples = self.eval_engine.generate([r[0] for r in rows], 1, sp)
        else:
            weights = self.export_weights()  # every rank, always: the export is a collective
            with self.rollout.engine_lock:
                self.rollout.ensure_weights(Publication(self.step_idx - 1, self.step_idx, weights))
                samples = self.engine.generate([r[0] for r in rows], 1, sp)
        correct = sum(
            float(self.reward_fn(self._decode(s.completion_ids), rows[s.group_id][1]))
            for s in samples
        )
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
        """Model, optimizer, scheduler, RNG, step, and per DP rank: the data cursor of the next
        rollout batch, pending re-evaluation requests and the replay buffer."""
        g = self.groups
        mine = None
        if g.tp_rank == 0 and g.pp_rank == 0 and g.cp_rank == 0:
            mine = (g.dp_rank, {"rollout": self.rollout.state(), "replay": self.replay.state()})
        parts: List = [None] * g.world_size
        # World: each DP rank has its own cursor and buffer; rank 0 stores them all in common.pt.
        dist.all_gather_object(parts, mine)
        state = {
            "ranks": {str(r): v for r, v in (x for x in parts if x is not None)},
            "weight_version": self.step_idx,
        }
        return save_training_checkpoint(
            self.run_dir,
            self.step_idx,
            self.chunks,
            self.opt,
            self.sched,
            state,
            keep_last=self.cfg.checkpoint.keep_last,
        )

    def _load_rank_state(self, ranks: Dict[str, dict]) -> List[dict]:
        """Restore this DP rank's cursor and buffer; returns its pending re-evaluation requests.
        A different DP size remaps the cursors and deals stored groups out round-robin."""
        dp, r = self.groups.layout.dp, self.groups.dp_rank
        if len(ranks) == dp:
            mine = ranks[str(r)]
            self.data.load_state(mine["rollout"]["data"])
            self.replay.load_state(mine["replay"])
            return mine["rollout"]["pending"]
        old = [ranks[str(i)] for i in range(len(ranks))]
        self.data.load_state(remap_states([o["rollout"]["data"] for o in old], dp)[r])
        stored = [x for o in old for x in o["replay"]["stored"]]
        difficult = [x for o in old for x in o["replay"]["difficult"]]
        difficult += [x for o in old for p in o["rollout"]["pending"] for x in p["reeval"]]
        self.replay.load_state({"stored": stored[r::dp], "difficult": difficult[r::dp]})
        return []

    def close(self) -> None:
        self.rollout.stop()
        self.engine.stop()
        if self.tb is not None:
            self.tb.close()
