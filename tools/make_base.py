"""Make a base model for a reasoning-gym task: a supervised warm-up of a small character-level
Llama on the task's scratchpad completions, stopped inside a target held-out accuracy band.

    python tools/make_base.py --task chain_sum --out runs/chain_base     # the shipped base
    python tools/make_base.py --task chain_sum --train --out runs/my_base [--seed 0]
    python tools/make_base.py --task tool_calc --out runs/tool_base      # the shipped tool base
    python tools/make_base.py --task tool_calc --train --out runs/my_tool_base [--seed 0]
    python tools/make_base.py --task tool_code --out runs/code_base      # the shipped code base
        [--target-acc 0.40] [--max-steps 3000]

Without ``--train`` it installs the base shipped in ``bases/<task>`` (``tools/shipped_base.py``:
weights checked against ``bases/SHA256SUMS``) in seconds, the same weights on every CPU: the
warm-up below lands elsewhere on another instruction set (0.058 held-out after 775 steps on one
machine, 0.69 on another). ``--train`` makes a new one:

``tool_calc`` (``recipes/tiny_cpu_tools.yaml``): arithmetic with a calculator tool, multi-turn
(``tools/tool_base.py`` says how its base is warmed up: a mix of tool calls and direct answers).
``tool_code`` (``recipes/tiny_cpu_code.yaml``): the same arithmetic answered through a sandboxed
``python`` call in the hermes format, the rollout an agent on the OpenAI client (same warm-up).

``chain_sum`` (``recipes/chain_cpu.yaml``): reasoning-gym's chain_sum with 5–7 one-digit terms
in the ``chain_scratchpad`` format (``3+7-2+9-4=`` → ``3+7=10;10-2=8;8+9=17;17-4=13;#13``):
completions of 26–60 characters, a carry or a sign change at most steps, and an answer that is
right only if every running sum is. The problems are the generator's own (the splits of
:func:`megatron_p3o.data.tasks.reasoning_gym.splits` with the recipe's task seed and sizes, so the
held-out set is the one the trainer evaluates) and accuracy is the dataset's ``score_answer``
on the decoded greedy completion. The tiny addition base stays ``tools/make_tiny_base.py``.

Deterministic (seeded). Trains until the greedy accuracy on the first ``--eval-prompts``
held-out prompts (every ``--eval-every`` steps) reaches ``--target-acc`` — the warm-up learns the
carries in a steep transition whose step depends on the seed, so a fixed step count would give
bases anywhere on it; exits 2 with one line if ``--max-steps`` comes first. Writes ``hf/``
(transformers model + character tokenizer), ``ckpt/`` (Megatron dist checkpoint via
checkpoints_convert) and ``base.json``: greedy pass@1 on the whole held-out split, pass@8 (and
the mean pass@1) at temperature 1 on its first 200 prompts, SFT steps and wall time, and the
completion lengths in tokens (``<eos>`` included).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TOOL_TASKS = ("tool_calc", "tool_code")  # tools/tool_base.py
# task -> (reasoning-gym dataset, its config, format); the recipe's data.task* keys must match
TASKS = {
    "chain_sum": (
        "chain_sum",
        {"min_terms": 5, "max_terms": 7, "min_digits": 1, "max_digits": 1},
        "chain_scratchpad",
    ),
}


def scores(model, tok, prompts, answers, max_new, n=1, seed=0) -> list:
    """Per prompt, the ``n`` completions' task scores (greedy if n == 1, else temperature 1)."""
    from megatron_p3o.reward.reasoning_gym import reasoning_gym_reward

    ids = [tok.encode("<bos>" + p) for p in prompts]
    L = max(map(len, ids))
    x = torch.full((len(ids), L), tok.pad_token_id)
    m = torch.zeros_like(x)
    for j, s in enumerate(ids):  # left-padded
        x[j, L - len(s) :] = torch.tensor(s)
        m[j, L - len(s) :] = 1
    model.eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            input_ids=x.repeat_interleave(n, 0),
            attention_mask=m.repeat_interleave(n, 0),
            max_new_tokens=max_new,
            do_sample=n > 1,
            temperature=1.0 if n > 1 else None,
            top_k=0 if n > 1 else None,
            top_p=1.0 if n > 1 else None,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    model.train()
    texts = tok.batch_decode(out[:, L:], skip_special_tokens=True)
    flat = [
        reasoning_gym_reward(t, a) for t, a in zip(texts, [a for a in answers for _ in range(n)])
    ]
    return [flat[i * n : (i + 1) * n] for i in range(len(prompts))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", required=True, help=f"one of {sorted(TASKS)}")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0, help="model init and batch order")
    ap.add_argument("--task-seed", type=int, default=0, help="the splits (recipe data.task_seed)")
    ap.add_argument("--train-size", type=int, default=20000, help="= data.task_train_size")
    ap.add_argument("--heldout-size", type=int, default=500, help="= data.task_heldout_size")
    ap.add_argument("--target-acc", type=float, default=0.40)
    ap.add_argument("--max-steps", type=int, default=3000, help="bound on SFT steps (exit 2)")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-prompts", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--train", action="store_true", help="train a new base, not the shipped one")
    a = ap.parse_args(argv)
    changed = [k for k in ("seed", "task_seed", "train_size", "heldout_size", "target_acc",
                           "max_steps", "eval_every", "eval_prompts", "batch", "lr")
               if getattr(a, k) != ap.get_default(k)]  # fmt: skip
    if a.task == "addition":
        print("make_base: the addition base is tools/make_tiny_base.py --out DIR", file=sys.stderr)
        return 2
    if a.task not in TASKS and a.task not in TOOL_TASKS:
        print(f"make_base: --task {a.task!r}: known tasks {sorted([*TASKS, *TOOL_TASKS])}",
              file=sys.stderr)  # fmt: skip
        return 2
    out = Path(a.out)
    if (out / "base.json").is_file():
        print(f"{out} exists: {(out / 'base.json').read_text()}")
        return 0
    if not a.train:
        from shipped_base import install  # tools/ (this script's folder)

        if changed:
            print(f"make_base: --{changed[0].replace('_', '-')} is a training option: add --train "
                  "(without it the shipped base is installed)", file=sys.stderr)  # fmt: skip
            return 2
        print(json.dumps(install(a.task, out)))
        return 0
    from megatron_p3o.runtime.quiet import silence_known_warnings

    silence_known_warnings()
    if a.task in TOOL_TASKS:
        return _tool_base(out, a)
    from rich.progress import Progress
    from shipped_base import MODEL  # tools/ (this script's folder)
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_p3o.data.tasks import chain_sum
    from megatron_p3o.data.tasks.arithmetic import make_tokenizer
    from megatron_p3o.data.tasks.reasoning_gym import encode_answer, splits, task_format

    t0 = time.time()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    name, args, fmt_name = TASKS[a.task]
    fmt = task_format(fmt_name)
    train, held = splits(name, args, a.task_seed, a.train_size, a.heldout_size)
    held_p = [fmt.prompt(e) for e in held]
    held_a = [encode_answer(name, args, e, fmt_name) for e in held]
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out / "hf", chain_sum.CHARS)
    prompts = [tok.encode("<bos>" + fmt.prompt(e)) for e in train]
    targets = [tok.encode(fmt.target(e) + "<eos>") for e in train]
    lens = sorted(map(len, targets))
    max_new = lens[-1] + 8
    torch.manual_seed(a.seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **MODEL,
    )
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(a.seed)
    acc, step = 0.0, 0

    def heldout_acc(k):
        s = scores(model, tok, held_p[:k], held_a[:k], max_new)
        return sum(r[0] for r in s) / k

    with Progress() as bar:
        task = bar.add_task(f"SFT {a.task} to held-out acc {a.target_acc}", total=a.max_steps)
        for step in range(1, a.max_steps + 1):
            idx = torch.randint(0, len(train), (a.batch,), generator=g).tolist()
            L = max(len(prompts[i]) + len(targets[i]) for i in idx)
            x = torch.full((len(idx), L), tok.pad_token_id)
            labels = torch.full((len(idx), L), -100)
            for j, i in enumerate(idx):  # loss on the completion (and its <eos>) only
                p, c = prompts[i], targets[i]
                x[j, : len(p) + len(c)] = torch.tensor(p + c)
                labels[j, len(p) : len(p) + len(c)] = torch.tensor(c)
            loss = model(input_ids=x, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            bar.advance(task)
            if step % a.eval_every == 0:
                acc = heldout_acc(a.eval_prompts)
                bar.console.print(
                    f"step {step}: loss {loss.item():.3f}, held-out greedy acc {acc:.3f} "
                    f"({time.time() - t0:.0f} s)"
                )
                if acc >= a.target_acc:
                    bar.update(task, total=step)  # reached early: the bar ends at 100%
                    break
    sft_s = time.time() - t0
    if acc < a.target_acc:
        print(
            f"make_base: held-out accuracy {acc:.3f} < --target-acc {a.target_acc} after "
            f"--max-steps {a.max_steps} (seed {a.seed}); raise --max-steps or lower --target-acc",
            file=sys.stderr,
        )
        return 2
    model.save_pretrained(out / "hf")
    pass1 = heldout_acc(len(held))
    k = min(200, len(held))
    s8 = scores(model, tok, held_p[:k], held_a[:k], max_new, n=8, seed=a.seed)
    from checkpoints_convert.hf_to_megatron import convert
    from megatron_p3o.runtime.parallel import Layout, initialize

    convert(str(out / "hf"), str(out / "ckpt"), groups=initialize(Layout()), dtype="float32")
    info = {
        "task": f"reasoning_gym:{name}",
        "task_args": args,
        "task_format": fmt_name,
        "task_seed": a.task_seed,
        "seed": a.seed,
        "heldout_greedy_acc": round(pass1, 4),
        "heldout_size": len(held),
        "pass@8_t1": round(sum(max(r) == 1.0 for r in s8) / k, 4),
        "pass@1_t1": round(sum(x == 1.0 for r in s8 for x in r) / (8 * k), 4),
        "pass_at_k_prompts": k,
        "sft_steps": step,
        "sft_wall_s": round(sft_s, 1),
        "total_wall_s": round(time.time() - t0, 1),
        "completion_tokens": {
            "min": lens[0],
            "median": statistics.median(lens),
            "p90": lens[int(0.9 * (len(lens) - 1))],
            "max": lens[-1],
        },
    }
    (out / "base.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info))
    return 0


def _tool_base(out: Path, a) -> int:
    """The tool-use base (tools/tool_base.py): warm-up, then the Megatron checkpoint."""
    from tool_base import train, write_base_json  # tools/ (this script's folder)

    from checkpoints_convert.hf_to_megatron import convert
    from megatron_p3o.runtime.parallel import Layout, initialize

    info = train(out, a.seed, batch=a.batch, task=a.task)  # tools/tool_base.PHASES
    convert(str(out / "hf"), str(out / "ckpt"), groups=initialize(Layout()), dtype="float32")
    write_base_json(out, info)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    from megatron_p3o.runtime.errors import run_cli

    run_cli(main, "make_base.py")  # user errors (a damaged shipped base, ...): one line, exit 2
