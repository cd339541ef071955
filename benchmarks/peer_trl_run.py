"""One TRL GRPOTrainer run on the tiny task, timed per optimizer step (runs in the TRL venv).

Started by ``benchmarks/bench_peer_trl.py``; not imported by the project. Settings mirror
``recipes/tiny_cpu.yaml``: 32 prompts x 8 completions = 256 per optimizer step, one optimizer step
per generation batch (``steps_per_generation = gradient_accumulation_steps``), token-mean loss
(``loss_type="dapo"``), beta = 0 (no reference model), fp32, no gradient checkpointing, AdamW at
the recipe's lr / clip, constant schedule, group-scaled advantages.

Writes one JSON line per optimizer step to ``--out``: ``step_s`` (on_step_begin -> on_step_end,
which contains the generation), ``generate_s`` (inside ``_generate_and_score_completions``:
tokenising, ``generate``, decoding, the reward), ``completion_tokens``, ``reward``; with
``--profile`` also ``phases``: the step's exclusive seconds per phase (``phase_clock.py``):
rollout (generation, reward, advantages), forward (the model, its lm head and log-softmax:
TRL's fused ``log_probs``), loss, backward, optimizer (clipping and Adam), zero grads, and the
Trainer's own Python between them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="tiny base dir (hf/, train.jsonl)")
    ap.add_argument("--repo", required=True, help="project root (for the task's reward)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--micro", type=int, default=32, help="completions per micro-batch")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--profile", action="store_true", help="phases per step (phase_clock.py)")
    args = ap.parse_args()

    sys.path.insert(
        0, args.repo
    )  # megatron_p3o.data.tasks.arithmetic imports only the standard library
    import torch
    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megatron_p3o.data.tasks.arithmetic import reward

    torch.set_num_threads(int(__import__("os").environ.get("OMP_NUM_THREADS", "2")))
    base = Path(args.base)
    data = load_dataset("json", data_files=str(base / "train.jsonl"), split="train")
    # Our trainer puts BOS before a plain-text prompt (rollout.prompts.encode_prompt); TRL
    # tokenizes the text as given, so the BOS goes into the text (the tokenizer maps it to id 1).
    data = data.map(lambda r: {"prompt": "<bos>" + r["prompt"]})

    def task_reward(prompts, completions, answer, **_):
        return [reward(c, a) for c, a in zip(completions, answer)]

    n_gen, prompts_per_step = 8, 32
    per_step = n_gen * prompts_per_step
    cfg = GRPOConfig(
        output_dir=args.work,
        seed=args.seed,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=per_step // args.micro,
        num_generations=n_gen,
        max_completion_length=5,
        temperature=1.0,
        top_p=1.0,
        beta=0.0,
        loss_type="dapo",
        num_iterations=1,
        scale_rewards="group",
        max_steps=args.steps,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    rows: list = []
    gen_s = [0.0]
    from phase_clock import PhaseClock  # benchmarks/ (this script's directory)

    clock = PhaseClock()

    class Timer(TrainerCallback):
        def on_train_begin(self, state_args, state, control, optimizer=None, model=None, **k):
            if args.profile:
                clock.wrap(optimizer, "step", "optimizer")
                clock.wrap(model, "zero_grad", "zero grads")

        def on_step_begin(self, *a, **k):
            gen_s[0] = 0.0
            if args.profile:
                clock.take()
                clock.push("trainer python")
            self.t0 = time.perf_counter()

        def on_step_end(self, state_args, state, control, **k):
            rows.append({"step": state.global_step, "step_s": time.perf_counter() - self.t0,
                         "generate_s": gen_s[0]})  # fmt: skip
            if args.profile:
                clock.pop()
                rows[-1]["phases"] = clock.take()

        def on_log(self, state_args, state, control, logs=None, **k):
            if rows and logs and "reward" in logs:
                rows[-1]["reward"] = logs["reward"]
                rows[-1]["completion_tokens"] = logs.get("completions/mean_length", 0) * per_step

    trainer = GRPOTrainer(
        model=str(base / "hf"),
        reward_funcs=task_reward,
        args=cfg,
        train_dataset=data,
        callbacks=[Timer()],
    )
    inner = trainer._generate_and_score_completions

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            gen_s[0] += time.perf_counter() - t0

    trainer._generate_and_score_completions = timed
    if args.profile:
        clock.wrap(trainer, "_generate_and_score_completions", "rollout")
        clock.wrap(trainer.model, "forward", "forward")
        clock.wrap(trainer, "_compute_loss", "loss")
        clock.wrap(trainer.accelerator, "backward", "backward")
        clock.wrap(trainer.accelerator, "clip_grad_norm_", "optimizer")
    trainer.train()
    with open(args.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
