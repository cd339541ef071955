"""Prompt data: local jsonl/parquet through ``datasets``, DP-sharded, with a resumable cursor.

Every epoch is a seeded permutation of the whole file; DP rank r takes every dp-th prompt of the
global order, so the shards are disjoint and together cover each epoch. ``state()`` /
``load_state()`` make the position part of a checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

import torch


@dataclass
class PromptItem:
    index: int  # row in the file
    prompt_ids: List[int]
    answer: str


class PromptData:
    def __init__(self, path: str, tokenizer, *, prompt_key: str = "prompt", answer_key: str = "answer",
                 chat_template: bool = False, shuffle: bool = True, seed: int = 0,
                 dp_rank: int = 0, dp_size: int = 1, add_bos: bool = True):
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"data.path={path!r} does not exist")
        from datasets import load_dataset

        kind = "parquet" if p.suffix == ".parquet" else "json"
        ds = load_dataset(kind, data_files=str(p), split="train")
        for key in (prompt_key, answer_key):
            if key not in ds.column_names:
                raise KeyError(f"{path}: no column {key!r} (columns: {ds.column_names})")
        self.prompts = ds[prompt_key]
        self.answers = [str(a) for a in ds[answer_key]]
        self.tok, self.chat = tokenizer, chat_template
        self.shuffle, self.seed, self.add_bos = shuffle, seed, add_bos
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.epoch, self.pos = 0, 0  # position in the epoch's global order
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> List[int]:
        n = len(self.prompts)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(n, generator=g).tolist()

    def encode(self, text: str) -> List[int]:
        if self.chat:
            return self.tok.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=True)
        ids = self.tok.encode(text, add_special_tokens=False)
        return ([self.tok.bos_token_id] if self.add_bos and self.tok.bos_token_id is not None else []) + ids

    def next(self, global_count: int) -> List[PromptItem]:
        """This DP rank's share of the next ``global_count`` prompts (global_count % dp == 0)."""
        if global_count % self.dp_size:
            raise ValueError(f"{global_count} prompts do not split over dp={self.dp_size} ranks")
        rows: List[int] = []
        while len(rows) < global_count:
            if self.pos >= len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(global_count - len(rows), len(self._order) - self.pos)
            rows += self._order[self.pos:self.pos + take]
            self.pos += take
        mine = rows[self.dp_rank::self.dp_size]
        return [PromptItem(i, self.encode(self.prompts[i]), self.answers[i]) for i in mine]

    def state(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state(self, st: Dict[str, int]) -> None:
        self.epoch, self.pos = int(st["epoch"]), int(st["pos"])
        self._order = self._permutation(self.epoch)


def all_rows(path: str, tokenizer, prompt_key="prompt", answer_key="answer", add_bos=True) -> List[Tuple[List[int], str]]:
    """Every (prompt ids, answer) of a file, in order (evaluation sets)."""
    d = PromptData(path, tokenizer, prompt_key=prompt_key, answer_key=answer_key, shuffle=False,
                   add_bos=add_bos)
    return [(d.encode(p), a) for p, a in zip(d.prompts, d.answers)]
