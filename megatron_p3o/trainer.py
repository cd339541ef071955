"""``Trainer.step()``: rollout → compose (replay) → advantages → update → publish → checkpoint →
log. No maths here: each phase is a call into its own module.

Each DP rank rolls out its own share of the prompts through the rollout backend
(:mod:`megatron_p3o.rollout.backend`), which also decides how the trainer's weights reach the
engine; the trainer never asks which backend it holds. Which weight version generates which
batch (sync, lagged every L, async with staleness ≤ K) is the rollout scheduler's rule.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Dict, List, Optional

import torch

from megatron_p3o.advantage.turns import step_advantages
from megatron_p3o.checkpoint.state import (
    load_model_state,
    load_training_checkpoint,
    resumable_checkpoint,
    save_training_checkpoint,
)
from megatron_p3o.config.loading import to_dict
from megatron_p3o.config.train_config import TrainConfig
from megatron_p3o.data.prompts import PromptData, all_rows, remap_states
from megatron_p3o.env.types import eval_items
from megatron_p3o.logprob.reference import ReferenceModel
from megatron_p3o.loss import build_objective
from megatron_p3o.model.builder import BuildOptions, build_model
from megatron_p3o.model.hf.dist_stream import P3O_META_FILE, meta_dict, read_meta
from megatron_p3o.observability.metrics import (
    PhaseTimer,
    combine_optimizer_steps,
    reduce_rollout_metrics,
    staleness,
)
from megatron_p3o.observability.run_log import RunLog
from megatron_p3o.observability.turn_metrics import turn_metrics
from megatron_p3o.reward import build_reward, decode_completions, score_samples
from megatron_p3o.reward.overlong import dapo_overlong_reward
from megatron_p3o.rollout.backend import build_backend
from megatron_p3o.rollout.config import RolloutShard
from megatron_p3o.rollout.engine import check_behavior_semantics
from megatron_p3o.rollout.replay import ReplayBuffer, TrajectoryFIFO
from megatron_p3o.rollout.scheduler import RolloutScheduler
from megatron_p3o.rollout.turns import build_turn_loop
from megatron_p3o.runtime.collectives import all_gather_objects, all_max, all_sum
from megatron_p3o.runtime.errors import ConfigError
from megatron_p3o.runtime.parallel import ParallelGroups
from megatron_p3o.types import SamplingParams, TrainBatch
from megatron_p3o.update.batching import MicroBatcher
from megatron_p3o.update.optim import (
    UpdateSize,
    build_optimizer,
    build_scheduler,
    over_epochs,
    wrap_ddp,
    zero_grads,
)
from megatron_p3o.update.policy_update import PolicyUpdate
from megatron_p3o.weight_sync.source import TrainerWeights

CONFIG_FILE = "config.json"  # in each checkpoint: the recipe it was trained with
_PRECISION_OF = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


class Trainer:
    def __init__(self, cfg: TrainConfig, groups: ParallelGroups):
        cfg = cfg.with_task_files()  # a config built in code: its task's splits (else itself)
        self.cfg, self.groups = cfg, groups
        self.log = self.rollout = self.turns = None
        self._eval_sets: Dict[str, list] = {}
        try:
            self._build(cfg, groups)
        except BaseException:
            self.close()  # nothing started so far outlives a failed start
            raise

    def _build(self, cfg: TrainConfig, groups: ParallelGroups) -> None:
        """Model and optimizer → objective and update → data, reward, replay → run directory
        and resume → rollout backend (last: it may launch servers)."""
        from megatron_p3o.model.hf.safetensors_io import load_tokenizer

        ckpt = Path(cfg.model.checkpoint)
        self._build_model(cfg, groups, ckpt)
        self.tok = load_tokenizer(ckpt / "hf", "model.checkpoint")
        self.objective = build_objective(cfg.loss.objective, **cfg.loss.hyper)
        self.sampling = self._sampling()
        self.reference = self._build_reference(cfg, groups, ckpt)
        self.update = PolicyUpdate(
            self.objective, groups, self.desc.vocab_size, cfg.loss, self.sampling.temperature,
            keep_graphs=cfg.batch.keep_graphs, keep_logits=cfg.batch.keep_logits,
        )  # fmt: skip
        self.r2po = None
        if cfg.r2po.enabled:  # the residual rollout head on the last stage, and its phase
            from megatron_p3o.update.r2po import R2PO

            self.r2po = R2PO(
                cfg.r2po, self.chunks, self.ddp, self.opt, groups, self.reference,
                self.desc.vocab_size, self.sampling.temperature, cfg.loss, cfg.batch,
                seed=cfg.run.seed,
            )  # fmt: skip
        self.batcher = MicroBatcher(
            cfg.batch, groups, cfg.model.seq_length, self.tok.pad_token_id or 0,
            equal_counts=self.objective.needs_ess and cfg.loss.ess_scope == "microbatch",
            route_mode=cfg.rollout.routing_replay if self.desc.is_moe else None,
            fp8=bool(cfg.model.fp8),
        )  # fmt: skip
        d = cfg.data
        self.data = PromptData(
            d.path, self.tok, prompt_key=d.prompt_key, answer_key=d.answer_key,
            chat_template=d.chat_template, shuffle=d.shuffle, seed=cfg.run.seed,
            dp_rank=groups.dp_rank, dp_size=groups.layout.dp, split=d.split,
        )  # fmt: skip
        self.reward_fn = build_reward(cfg.reward.kind, cfg.reward.function)
        self.replay = ReplayBuffer(cfg.replay)
        self.fifo = TrajectoryFIFO(cfg.replay, cfg.run.seed, groups.dp_rank)
        resume = self._open_run(cfg, groups)
        self.rollout = self._build_rollout(cfg, groups, resume)

    def _build_model(self, cfg: TrainConfig, groups: ParallelGroups, ckpt: Path) -> None:
        meta = read_meta(ckpt)
        self.desc = meta["description"]
        self.build_opts = opts = BuildOptions(
            params_dtype=getattr(torch, cfg.model.params_dtype),
            make_vocab_size_divisible_by=meta["make_vocab_size_divisible_by"],
            seq_length=cfg.model.seq_length,
            use_te=cfg.model.use_te,
            fp8=cfg.model.fp8,
            moe_dispatcher=cfg.model.moe_dispatcher,
            moe_aux_loss_coeff=cfg.model.moe_aux_loss_coeff,
            fused_logprob=cfg.model.fused_logprob,
        )
        if cfg.rollout.routing_replay != "off" and not self.desc.is_moe:
            raise ConfigError(
                f"rollout.routing_replay={cfg.rollout.routing_replay!r}: {self.desc.architecture} "
                "has no mixture-of-experts layers to replay"
            )
        self.chunks = build_model(self.desc, groups, opts)
        load_model_state(self.chunks, ckpt)
        self.ddp = wrap_ddp(self.chunks, groups, cfg.optim)
        self.opt = build_optimizer(self.ddp, groups, cfg.optim)
        self.sched = build_scheduler(self.opt, cfg.optim)

    def _build_reference(self, cfg: TrainConfig, groups: ParallelGroups, ckpt: Path):
        """The frozen reference model when the objective (or ``reference.enabled``) asks."""
        if not cfg.reference.wanted(self.objective, cfg.r2po.enabled):
            return None
        return ReferenceModel(
            self.desc, groups, self.build_opts, ckpt, cfg.rollout.sampling.temperature,
            cfg.loss.logprob_chunk,
        )  # fmt: skip

    def _open_run(self, cfg: TrainConfig, groups: ParallelGroups) -> Optional[dict]:
        """The run directory (config.json, metrics.jsonl, TensorBoard, W&B on rank 0) and, when
        it holds a checkpoint, the resume; returns this DP rank's rollout state (batches made
        but not trained on, pending re-evaluations, older rollout weights) or None."""
        self.step_idx = 0
        self.run_dir = Path(cfg.run.dir) / cfg.run.name
        self.rank0 = groups.rank == 0
        say = print if groups.rank == 0 else (lambda *a: None)
        self.resumed_from = resumable_checkpoint(self.run_dir, say)
        self.log = RunLog(
            self.run_dir, to_dict(cfg), cfg.wandb, self.rank0, self.resumed_from is not None
        )
        if self.resumed_from is None:
            return None
        self._check_config_change(cfg, say)
        # the same command again continues the run
        st = load_training_checkpoint(self.resumed_from, self.chunks, self.opt, self.sched)
        self.step_idx = int(st["step"])
        rewound = self.log.rewind(self.step_idx)  # records of steps trained after it (a crash)
        if rewound:
            say(f"resuming at step {self.step_idx}: {rewound} records of later steps moved to "
                "metrics.jsonl.rewound / eval.jsonl.rewound")  # fmt: skip
        if self.reference is not None:
            self.reference.load(self.resumed_from, int(st.get("reference_reset_step", 0)))
        if self.r2po is not None:
            self.r2po.head.load(self.resumed_from, int(st.get("rollout_head_adam_step", 0)))
        resume = self._load_rank_state(st["ranks"], say)
        old = st.get("rollout_weights")
        if old is not None and old["tensors"] is None:  # pushed to a server: not kept
            say(f"the rollout weights of version {old['version']} were pushed to the server and "
                f"are not in {self.resumed_from.name}: until the next sync point batches are "
                f"made with its weights (version {self.step_idx})")  # fmt: skip
        elif old is not None:
            resume["weights"] = old
        return resume

    def _check_config_change(self, cfg: TrainConfig, say) -> None:
        """Resuming with other training-relevant keys than the checkpoint's recipe: refused
        (one line, every key with both values) unless ``run.allow_config_change``."""
        import json

        from megatron_p3o.config.loading import config_changes

        saved = self.resumed_from / CONFIG_FILE
        if not saved.is_file():  # written before checkpoints kept their recipe
            return
        now = json.loads(json.dumps(to_dict(cfg)))  # as saved: tuples become lists
        changes = config_changes(json.loads(saved.read_text()), now)
        if not changes:
            return
        listed = ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changes)
        if not cfg.run.allow_config_change:
            raise ConfigError(
                f"resuming {self.resumed_from} with a different recipe ({listed}); use the "
                "checkpoint's values, or --set run.allow_config_change=true to train on with them"
            )
        say(f"resuming with a changed recipe (run.allow_config_change): {listed}")

    def _build_rollout(self, cfg: TrainConfig, groups: ParallelGroups, resume: Optional[dict]):
        r = cfg.rollout
        engine_sampling = self.sampling
        if r.engine_temperature is not None:  # deliberate mismatch (stress experiments)
            engine_sampling = replace(self.sampling, temperature=r.engine_temperature)
        shard = RolloutShard(
            prompts=cfg.batch.prompts_per_rollout // groups.layout.dp,
            sampling=engine_sampling,
            seed=cfg.run.seed,
            dp_rank=groups.dp_rank,
            end=cfg.steps,
        )
        head = self.r2po.head.hf_tensors if self.r2po is not None else None
        weights = TrainerWeights(self.chunks, groups, self.desc, extra=head)
        self.turns = build_turn_loop(
            r.multi_turn, self.tok, cfg.data.chat_template, self.sampling.stop_token_ids
        )
        return build_backend(
            r, groups, weights, self.data, self._score, shard, self.step_idx, resume,
            cfg.model.params_dtype, self.tok.pad_token_id or 0, rollout_head=head is not None,
            log_dir=str(self.run_dir / "sglang"), turns=self.turns,
        )  # fmt: skip

    def _sampling(self) -> SamplingParams:
        """The recipe's sampling parameters plus the tokenizer's EOS as a stop token, checked
        against what the objective assumes of the behaviour log-probs."""
        s = self.cfg.rollout.sampling
        eos = self.tok.eos_token_id
        stops = tuple(s.stop_token_ids) + ((eos,) if eos is not None else ())
        sampling = replace(s, stop_token_ids=tuple(dict.fromkeys(stops)))
        check_behavior_semantics(sampling, s.temperature, self.objective.behavior_ratio)
        return sampling

    # -- one trainer step -----------------------------------------------------------------------
    def step(self) -> Dict[str, float]:
        timer = PhaseTimer()
        with timer("rollout_wait"):
            res = self._all_or_none(self.rollout.next_batch)
        with timer("compose"):
            groups, replay_stats = self.replay.compose(res.groups, self.step_idx, res.dropped)
            batch = TrainBatch.from_groups(groups)
        with timer("advantage"):
            adv = self._advantages(batch)
        with timer("train"):
            self.rollout.before_update()
            if self.r2po is not None and self.r2po.cfg.phase(self.step_idx) == "head":
                update = {"r2po_head_phase": 1.0, **self.r2po.head_update(batch, self.batcher)}
            else:
                update = self._update(batch.samples, adv)
                update.update(self._replay_update(batch, adv))
                if self.r2po is not None:
                    update["r2po_head_phase"] = 0.0
        self.step_idx += 1
        self._maybe_reset_reference()
        with timer("sync"):
            self.rollout.publish(self.step_idx - 1, self.replay.take_reeval())
        with timer("checkpoint"):
            every = self.cfg.checkpoint.every
            if every and self.step_idx % every == 0:
                self.save_checkpoint()
        return self._log(batch, {**update, **res.stats, **replay_stats}, timer.seconds)

    def _all_or_none(self, rollout):
        """``rollout()``; a multi-turn rollout a stop signal interrupted on any rank raises
        :class:`RolloutInterrupted` on every rank (one agreement over the world: a rank whose
        rollout ended first must not go on to the update alone)."""
        from megatron_p3o.runtime.preemption import RolloutInterrupted

        try:
            out, stop = rollout(), 0
        except RolloutInterrupted:
            out, stop = None, 1
        if self.turns is not None and self.groups.world_size > 1:
            flag = torch.tensor([stop], dtype=torch.int64, device=self.groups.device)
            all_max(flag, self.groups.world, "a stop signal during a rollout stops every rank")
            stop = int(flag.item())
        if stop:
            raise RolloutInterrupted("a stop signal arrived during a multi-turn rollout")
        return out

    # -- phases -----------------------------------------------------------------------------------
    def decode(self, ids: List[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def _score(self, samples, answers) -> List[float]:
        if self.turns is not None:  # multi-turn: the environment's rewards, summed over turns
            rewards = [float(s.reward) for s in samples]
        else:
            texts = decode_completions(self.decode, [s.completion_ids for s in samples])
            rewards = score_samples(self.reward_fn, texts, answers, [s.group_id for s in samples])
        ol = self.cfg.reward.overlong
        if ol is not None:  # DAPO's soft over-long penalty, on the tokens the policy sampled
            lens = torch.tensor([s.policy_tokens for s in samples])  # host
            pen = dapo_overlong_reward(lens, ol.max_len, ol.cache).tolist()
            rewards = [r + p for r, p in zip(rewards, pen)]
        return rewards

    def _advantages(self, batch: TrainBatch):
        """The objective's own advantages (OAPL's A*) or the configured group baseline, over
        the members that were not aborted; per token under ``multi_turn.credit: turn``."""
        a, mt, obj = self.cfg.advantage, self.cfg.rollout.multi_turn, self.objective
        own = (lambda r, g: obj.advantages(r, g)) if obj.spec.advantages is not None else None
        credit = (mt.credit, mt.discount) if mt is not None else ("trajectory", 1.0)
        return step_advantages(batch.samples, batch.rewards, batch.group_index, own, a.kind,
                               a.eps, *credit)  # fmt: skip

    def _update(self, samples, adv) -> Dict:
        """Every optimizer step of this rollout batch (mini-batches × epochs); their metrics."""
        b = self.cfg.batch
        per_step, packing = self.batcher.build(samples, adv)
        ref = {}
        if self.reference is not None:  # ℓref (and V_ref(s₁)) before any update of the batch
            t0 = time.perf_counter()
            for mbs in per_step:
                self.reference.score(mbs, with_value=self.objective.needs_value)
            ref = {
                "ref_forward_s": time.perf_counter() - t0,
                "ref_reset_step": float(self.reference.reset_step),
            }
        if self.objective.recomputes_old(self.cfg.loss.old_logprobs):  # πold before the updates
            for mbs in per_step:  # one schedule per step: its micro-batches share a shape
                self.update.recompute_old_logprobs(self.ddp, mbs)
        steps = over_epochs(b, lambda m: self._optimizer_step(per_step[m]))
        return {**combine_optimizer_steps(steps), **packing, **ref, **self._route_metrics()}

    def _optimizer_step(self, microbatches) -> Dict:
        """One optimizer step: gradients of the step's micro-batches, the optimizer and the LR
        schedule; its metrics (gradient norm before clipping, whether it clipped or skipped)."""
        zero_grads(self.ddp, self.opt)
        metrics = self.update.run(self.ddp, microbatches)
        size = UpdateSize(self.opt) if self.cfg.optim.log_update_size else None
        ok, gnorm, _ = self.opt.step()
        self.sched.step(1)
        if size is not None:
            metrics.update(size.measure())
        # the norm before clipping (Megatron clips to clip_grad inside step())
        metrics["grad_norm"] = float(gnorm) if gnorm is not None else float("nan")
        clip = self.cfg.optim.clip_grad
        metrics["grad_clipped"] = float(clip > 0 and metrics["grad_norm"] > clip)
        metrics["skipped_steps"] = 0.0 if ok else 1.0  # non-finite gradients: no update
        return metrics

    def _route_metrics(self) -> Dict[str, float]:
        """MoE: per-layer agreement of the trainer's own top-k with the engine's experts, over
        this batch's forwards (all ranks)."""
        if not self.desc.is_moe:
            return {}
        from megatron_p3o.model.routing import agreement

        hooks = [h for c in self.chunks for h in getattr(c, "route_hooks", [])]
        return agreement(hooks, self.desc.num_layers, self.groups.device, self.groups.world)

    def _replay_update(self, batch: TrainBatch, adv: torch.Tensor) -> Dict:
        """``replay.policy: fifo`` (ReVal): one more update on a uniform draw of older
        trajectories, then the fresh ones join the buffer; metrics prefixed ``replay/``."""
        if not self.fifo.active:
            return {}
        drawn = self.fifo.draw(len(batch.samples), self.step_idx)
        self.fifo.add(batch.samples, adv)
        if drawn is None:
            return {"replay/size": float(len(self.fifo))}
        m = self._update(*drawn)
        keep = ("loss", "ess", "kl_behavior_theta", "reval_abs_delta", "grad_norm", "n_tokens")
        out = {f"replay/{k}": v for k, v in m.items() if k in keep}
        out["replay/size"] = float(len(self.fifo))
        return out

    def _maybe_reset_reference(self) -> None:
        """``reference.reset_every``: the policy after this step becomes the reference."""
        every = self.cfg.reference.reset_every
        if self.reference is not None and every and self.step_idx % every == 0:
            self.reference.reset_from(self.chunks, self.step_idx)

    def _log(self, batch: TrainBatch, metrics: Dict, seconds: Dict[str, float]) -> Dict:
        b = self.cfg.batch
        # versions behind the policy this step trained (step_idx has moved on to the next)
        trained = self.step_idx - 1
        stale = staleness(batch.samples, trained)
        toks = sum(s.policy_tokens for s in batch.samples)  # the policy's (not an environment's)
        lens = [s.policy_tokens for s in batch.samples]  # an environment's tokens are not its
        cut = sum(s.finish_reason == "length" for s in batch.samples)
        distinct: Dict[int, set] = {}  # rollout diversity: distinct completions per prompt group
        for s, gi in zip(batch.samples, batch.group_index.tolist()):
            pol = (t for t, m in zip(s.completion_ids, s.mask()) if m)
            distinct.setdefault(gi, set()).add(tuple(pol))
        n_steps = b.epochs * b.minibatches
        out = {
            "step": self.step_idx,
            **metrics,
            **seconds,
            "reward_mean": float(batch.rewards.mean()),
            "completion_len": toks / len(batch.samples),
            "completion_len_max": float(max(lens)),
            "truncation_rate": cut / len(batch.samples),
            "distinct_per_group": sum(len(v) for v in distinct.values()) / max(len(distinct), 1),
            "train_tok_per_s": n_steps
            * metrics.get("n_tokens", 0.0)
            / max(seconds["train_s"], 1e-9),
            **stale,
            **turn_metrics(batch.samples),
            "weight_version": self.step_idx,
            "lr": self.opt.param_groups[0]["lr"],
        }
        reduce_rollout_metrics(out, self.groups)
        out["rollout_tok_per_s"] = out["rollout_tokens"] / max(out["rollout_s"], 1e-9)
        self.log.log(self.step_idx, {k: v for k, v in out.items() if k != "step"})
        return out

    # -- evaluation, checkpoints, teardown ------------------------------------------------------
    def evaluate(self, path: str, limit: int = 0) -> float:
        """Greedy (top-1) accuracy on a held-out file with the current weights (all ranks)."""
        return self.evaluate_detail(path, limit)[0]

    def evaluate_detail(self, path: str, limit: int = 0):
        """``(accuracy, per-prompt correctness)``: greedy, in ``data.eval_precision``; the list
        (on every rank) is in file order, for paired comparisons across runs."""
        d = self.cfg.data
        rows = all_rows(path, self.tok, d.prompt_key, d.answer_key, chat=d.chat_template)
        rows = rows[:limit] if limit else rows
        mine = list(range(self.groups.dp_rank, len(rows), self.groups.layout.dp))
        items = None
        if self.turns is not None:  # the same turn loop as the rollouts, greedy
            items = eval_items(path, d.prompt_key, rows, mine)
        samples = self._all_or_none(
            lambda: self.generate_eval([rows[i][0] for i in mine], self.greedy_sampling(), items)
        )
        score = torch.zeros(len(rows), dtype=torch.float64, device=self.groups.device)
        if items is not None:
            rewards = [float(s.reward) for s in samples]
        else:  # the training path's checks too (a failing or non-finite reward names the prompt)
            texts = decode_completions(self.decode, [s.completion_ids for s in samples])
            rewards = score_samples(self.reward_fn, texts, [rows[i][1] for i in mine], mine)
        for i, r in zip(mine, rewards):
            score[i] = r
        if self.groups.layout.dp_enabled:
            all_sum(score, self.groups.dp, "each DP rank evaluated a disjoint share of prompts")
        per_prompt = score.tolist()
        acc = sum(per_prompt) / max(len(per_prompt), 1)
        self.log.log(self.step_idx, {"eval/heldout_accuracy": acc}, jsonl="eval.jsonl")
        return acc, per_prompt

    # -- evaluation sets (megatron_p3o.evaluation.heldout) -----------------------------------------
    def eval_rows(self, name: str, cfg) -> list:
        """The set's (prompt ids, answer) rows, read once."""
        from megatron_p3o.evaluation.heldout import load_set

        if name not in self._eval_sets:
            self._eval_sets[name] = load_set(cfg, self.tok, self.cfg.data.chat_template, name)
        return self._eval_sets[name]

    def generate_eval(self, prompts, sampling: SamplingParams, items=None):
        """One completion per prompt with the current weights, in ``data.eval_precision``
        (``items``: multi-turn, one trajectory per prompt through the turn loop)."""
        precision = None
        if self.cfg.data.eval_precision == "trainer":
            precision = _PRECISION_OF[self.cfg.model.params_dtype]
        return self.rollout.evaluate(prompts, sampling, self.step_idx, precision, items)

    def greedy_sampling(self, max_tokens: int = 0) -> SamplingParams:
        """Top-1 decoding with the recipe's stop tokens (``max_tokens`` 0 = the recipe's)."""
        return SamplingParams(
            temperature=1.0,
            top_k=1,
            max_new_tokens=max_tokens or self.sampling.max_new_tokens,
            stop_token_ids=self.sampling.stop_token_ids,
            seed=0,
        )

    def evaluate_sets(self) -> Dict[str, float]:
        """Every ``eval.sets`` entry: pass@k, mean pass@1, greedy accuracy (all ranks); logged."""
        from megatron_p3o.evaluation.heldout import evaluate_sets

        metrics = evaluate_sets(self, self.cfg.eval)
        self.log.log(self.step_idx, metrics, jsonl="eval.jsonl")
        return metrics

    def save_checkpoint(self) -> Path:
        """Model, optimizer, scheduler, RNG, step; per DP rank the rollout batches made but not
        trained on (async K ≥ 1), the data cursor after them, pending re-evaluation requests and
        the replay buffer; the rollout weights when lagged sync still owes batches to older
        ones."""
        g = self.groups
        mine = None
        if g.is_dp_leader:
            replay = {**self.replay.state_dict(), **self.fifo.state_dict()}
            mine = (g.dp_rank, {"rollout": self.rollout.state_dict(), "replay": replay})
        parts = all_gather_objects(mine, g.world, "each DP rank has its own cursor and buffer; "
                                   "rank 0 stores them all in common.pt")  # fmt: skip
        ref = self.reference
        state = {
            "ranks": {str(r): v for r, v in (x for x in parts if x is not None)},
            "weight_version": self.step_idx,
            "rollout_weights": self.rollout.weights_state(),  # identical on every rank
            "reference_reset_step": ref.reset_step if ref is not None else 0,
        }
        extra = ref.sharded_state() if ref is not None else {}
        if self.r2po is not None:
            state["rollout_head_adam_step"] = self.r2po.head.adam_step()
            extra.update(self.r2po.head.sharded_state())
        return save_training_checkpoint(
            self.run_dir,
            self.step_idx,
            self.chunks,
            self.opt,
            self.sched,
            state,
            keep_last=self.cfg.checkpoint.keep_last,
            extra=extra,
            files={CONFIG_FILE: to_dict(self.cfg), P3O_META_FILE: self._model_meta()},
            copy_dirs={"hf": Path(self.cfg.model.checkpoint) / "hf"},
        )  # the recipe (resume compares it); what an export needs: description, tokenizer

    def _model_meta(self) -> dict:
        """The model description of this checkpoint, as the converter writes it (the padded
        vocabulary does not depend on TP: :func:`model.builder.padded_vocab_size`), so that
        ``checkpoints_convert.megatron_to_hf`` and ``verify`` read a trained checkpoint as they
        read a converted one, and a recipe can start from it (``model.checkpoint``)."""
        from megatron_p3o.model.builder import padded_vocab_size

        div = self.build_opts.make_vocab_size_divisible_by
        vpad = padded_vocab_size(self.desc.vocab_size, self.groups.layout.tp, div)
        return meta_dict(self.desc, vpad, div, self.build_opts.params_dtype,
                         source=f"trained from {self.cfg.model.checkpoint}")  # fmt: skip

    def _load_rank_state(self, ranks: Dict[str, dict], say) -> dict:
        """Restore this DP rank's cursor and buffer; returns its rollout state. A different DP
        size remaps the cursors (to before the carried batches, which are made again) and deals
        stored groups out round-robin."""
        dp, r = self.groups.layout.dp, self.groups.dp_rank
        if len(ranks) == dp:
            mine = ranks[str(r)]
            self.data.load_state_dict(mine["rollout"]["data"])
            self.replay.load_state_dict(mine["replay"])
            self.fifo.load_state_dict(mine["replay"])
            return {k: mine["rollout"].get(k, []) for k in ("pending", "carried")}
        rollouts = [ranks[str(i)]["rollout"] for i in range(len(ranks))]
        replays = [ranks[str(i)]["replay"] for i in range(len(ranks))]
        sched = RolloutScheduler
        carried = len(rollouts[0].get("carried", []))
        if carried:
            say(f"dp {len(ranks)} -> {dp}: the {carried} rollout batches made before the "
                "checkpoint are made again with its weights")  # fmt: skip
        cursors = [sched.cursor_before_carried(st) for st in rollouts]
        self.data.load_state_dict(remap_states(cursors, dp)[r])
        owed = [x for st in rollouts for x in sched.pending_reevals(st)]
        owed += [x for st in rollouts for x in sched.carried_reevals(st)]
        self.replay.load_state_dict(ReplayBuffer.regroup(replays, owed, dp, r))
        self.fifo.load_state_dict(TrajectoryFIFO.regroup(replays, dp, r))
        return {}

    def close(self) -> None:
        """Stop the rollout backend (its thread, servers it launched) and close the logs."""
        if self.rollout is not None:
            self.rollout.stop()
            self.rollout = None
        if self.turns is not None:  # its environment workers
            self.turns.close()
        if self.log is not None:
            self.log.close()
            self.log = None
