"""Prompt data: local jsonl/parquet or a hub dataset through ``datasets``, DP-sharded, with a
resumable cursor.

Every epoch is a seeded permutation of the whole file; DP rank r takes every dp-th prompt of the
global order (its k-th prompt of an epoch is ``order[k·dp + r]``), so the shards are disjoint and
together cover each epoch. Each rank keeps its own cursor (k, epoch): a rank that draws more
prompts (DAPO dynamic sampling refills) moves ahead without overlapping the others.
``state_dict()`` / ``load_state_dict()`` make the position part of a checkpoint; ``remap_states``
carries cursors across a change of DP size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Literal, Sequence, Tuple

import torch

from megatron_p3o.runtime.errors import CheckpointError, ConfigError, DataError, InputFileError
from megatron_p3o.runtime.fields import check_ranges


@dataclass(frozen=True)
class DataConfig:
    """Attributes: path (a jsonl/json/parquet file, or a hub dataset name on a cluster, with
    ``split``), eval_path (held-out set, optional), prompt_key,
    answer_key, chat_template, shuffle, eval_every (steps; 0 = only at start and end),
    eval_precision ("trainer": a second embedded engine in ``model.params_dtype``, so scores
    measure the policy and not the rollout precision; "rollout": the rollout engine itself;
    SGLang always evaluates on its server).

    A reasoning-gym task in place of a file (:mod:`..tasks.reasoning_gym`): task
    (``reasoning_gym:<name>``), task_args (the generator's config), task_format (``question``
    or ``chain_scratchpad``), task_seed (the splits' seed: the same held-out set for every
    ``run.seed``), task_train_size / task_heldout_size (problems per split). The splits are
    written as jsonl under ``{run.dir}/tasks/`` and become ``path`` and (unless set)
    ``eval_path``; ``reward.kind: reasoning_gym`` scores them."""

    path: str = ""
    split: str = "train"
    eval_path: str = ""
    eval_every: int = 0
    eval_precision: Literal["trainer", "rollout"] = "trainer"
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    chat_template: bool = False
    shuffle: bool = True
    task: str = ""
    task_args: Dict[str, Any] = field(default_factory=dict)
    task_format: str = "question"
    task_seed: int = 0
    task_train_size: int = 10000
    task_heldout_size: int = 500

    RANGES: ClassVar[Dict[str, str]] = {
        "eval_every": ">= 0",
        "task_train_size": ">= 1",
        "task_heldout_size": ">= 1",
    }

    def __post_init__(self):
        check_ranges(self, self.RANGES, "data")

    def with_task_files(self, run_dir: str) -> "DataConfig":
        """With ``task`` set: its splits written (once) as jsonl files under
        ``{run_dir}/tasks/``, which become ``path`` and, unless given, ``eval_path``. Without a
        task, or once they are written, ``self``. The one step of a run that writes data files:
        the entry points call it after loading the recipe (loading only reads)."""
        if not self.task:
            return self
        from megatron_p3o.data.tasks.reasoning_gym import materialize, split_paths

        args = (
            self.task, dict(self.task_args), self.task_format, self.task_seed,
            self.task_train_size, self.task_heldout_size, Path(run_dir) / "tasks",
        )  # fmt: skip
        train, held = split_paths(*args)
        # written already: here, or under another run directory (the probe's scratch run keeps
        # the recipe's files; the folder's name is the hash of the task's arguments)
        mine = Path(self.path) if self.path else None
        if mine is not None and mine.parts[-2:] == train.parts[-2:] and mine.is_file():
            return self
        if self.path:
            raise ConfigError(
                f"data.task={self.task!r} and data.path={self.path!r}: set one of them"
            )
        train, held = materialize(*args)
        return replace(self, path=str(train), eval_path=self.eval_path or str(held))


@dataclass
class PromptItem:
    index: int  # row in the file
    prompt_ids: List[int]
    answer: str


class PromptData:
    def __init__(
        self,
        path: str,
        tokenizer,
        *,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        chat_template: bool = False,
        shuffle: bool = True,
        seed: int = 0,
        dp_rank: int = 0,
        dp_size: int = 1,
        add_bos: bool = True,
        split: str = "train",
    ):
        ds = read_dataset(path, split)
        for key in (prompt_key, answer_key):
            if key not in ds.column_names:
                raise DataError(f"{path}: no column {key!r} (columns: {ds.column_names})")
        # a list, not the dataset's lazy column: one Arrow read per prompt was ~0.2 ms, a tenth
        # of a tiny CPU step (32 prompts)
        self.prompts = list(ds[prompt_key])
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
        return encode_prompt(self.tok, text, self.chat, self.add_bos)

    def encode_all(self, texts: Sequence[str]) -> List[List[int]]:
        """:meth:`encode` of each text; plain texts in one tokenizer call (a batch encodes each
        text as a call of its own would: the same ids)."""
        if self.chat or not texts:
            return [self.encode(t) for t in texts]
        tok = self.tok
        bos = [tok.bos_token_id] if self.add_bos and tok.bos_token_id is not None else []
        return [bos + list(ids) for ids in tok(list(texts), add_special_tokens=False)["input_ids"]]

    def _shard_len(self) -> int:
        n = len(self._order)
        return (n - self.dp_rank + self.dp_size - 1) // self.dp_size

    def next(self, global_count: int) -> List[PromptItem]:
        """This DP rank's share of the next ``global_count`` prompts (global_count % dp == 0)."""
        if global_count % self.dp_size:
            raise DataError(f"{global_count} prompts do not split over dp={self.dp_size} ranks")
        return self.next_local(global_count // self.dp_size)

    def next_local(self, count: int) -> List[PromptItem]:
        """The next ``count`` prompts of this DP rank's shard (crossing into new epochs)."""
        if self._shard_len() == 0:
            raise DataError(
                f"data.path has {len(self.prompts)} prompts: none for DP rank {self.dp_rank} "
                f"of {self.dp_size}"
            )
        rows: List[int] = []
        while len(rows) < count:
            if self.pos >= self._shard_len():
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            rows.append(self._order[self.pos * self.dp_size + self.dp_rank])
            self.pos += 1
        ids = self.encode_all([self.prompts[i] for i in rows])
        return [PromptItem(i, p, self.answers[i]) for i, p in zip(rows, ids)]

    def state_dict(self) -> Dict[str, int]:
        """``pos`` counts this rank's prompts taken in ``epoch``; ``dp`` records the shard count."""
        return {"epoch": self.epoch, "pos": self.pos, "dp": self.dp_size}

    def load_state_dict(self, st: Dict[str, int]) -> None:
        if int(st.get("dp", self.dp_size)) != self.dp_size:
            raise CheckpointError(
                f"data cursor was saved with dp={st['dp']}, this run has dp={self.dp_size}: "
                "use remap_states"
            )
        self.epoch, self.pos = int(st["epoch"]), int(st["pos"])
        self._order = self._permutation(self.epoch)


def remap_states(states: List[Dict[str, int]], new_dp: int) -> List[Dict[str, int]]:
    """Cursors of ``len(states)`` DP ranks → cursors for ``new_dp`` ranks.

    The ranks restart together at the earliest global position any old rank had reached
    (``pos·dp_old`` in the earliest epoch): no prompt is skipped; a few may be seen again.
    """
    old_dp = len(states)
    epoch, pos = min((int(s["epoch"]), int(s["pos"])) for s in states)
    start = pos * old_dp
    return [{"epoch": epoch, "pos": start // new_dp, "dp": new_dp} for _ in range(new_dp)]


def read_dataset(path: str, split: str = "train", key: str = "data.path"):
    """A local ``.jsonl``/``.json``/``.parquet`` file, or else a hub dataset (or a local dataset
    directory) named ``path``, its ``split`` — through ``datasets``."""
    import datasets

    datasets.disable_progress_bars()  # "Generating train split" bars on every rank and file
    p = Path(path)
    if p.suffix in (".jsonl", ".json", ".parquet"):
        if not p.is_file():
            what = "is a directory, not a file" if p.is_dir() else "does not exist"
            raise InputFileError(f"{key}={path!r} {what}")
        if p.suffix != ".parquet":
            check_json_rows(p, key)
        kind = "parquet" if p.suffix == ".parquet" else "json"
        try:
            return datasets.load_dataset(kind, data_files=str(p), split="train")
        except Exception as e:  # noqa: BLE001 - datasets wraps every parse error: one line
            cause = e.__cause__ or e
            raise DataError(
                f"{key}={path!r}: cannot read it as {kind}: "
                f"{type(cause).__name__}: {str(cause)[:200]}"
            ) from None
    try:
        return datasets.load_dataset(path, split=split)
    except Exception as e:  # noqa: BLE001 - no network, a typo, a gated set: one line
        raise InputFileError(
            f"{key}={path!r} is neither a .jsonl/.json/.parquet file nor a readable dataset "
            f"(split {split!r}): {type(e).__name__}: {str(e)[:200]}"
        ) from None


def check_json_rows(path: Path, key: str = "data.path") -> None:
    """A JSON Lines file (``.jsonl``, or a ``.json`` that is not one JSON array) must be UTF-8
    with one JSON object per non-blank line. Why here: ``datasets`` reports a bad row in a
    68-line traceback that names neither the file nor the line; this names both."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(
            f"{key}={str(path)!r}: line {line} is not UTF-8 (byte 0x{raw[e.start]:02x})"
        ) from None
    if path.suffix == ".json" and _json_document(text, path, key):
        return  # one JSON document (an array, or {"data": [...]}): datasets reads it whole
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise DataError(
                f"{key}={str(path)!r}: line {n} is not valid JSON ({_why(e)}): {line[:80]!r}"
            ) from None
        if not isinstance(row, dict):
            raise DataError(
                f"{key}={str(path)!r}: line {n} is a JSON {type(row).__name__}, not an object "
                "with prompt and answer fields"
            )


def _json_document(text: str, path: Path, key: str) -> bool:
    """Whether ``text`` is one JSON document; a broken array is reported at its line (a
    ``.json`` file may also hold JSON Lines: that is for the caller to check)."""
    try:
        json.loads(text)
        return True
    except ValueError as e:
        if text.lstrip().startswith("["):
            raise DataError(
                f"{key}={str(path)!r}: line {getattr(e, 'lineno', '?')} is not valid JSON "
                f"({_why(e)})"
            ) from None
        return False


def _why(e: ValueError) -> str:
    """A JSONDecodeError's reason and column (its own line number counts from the line given)."""
    return f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)


def encode_prompt(tok, text: str, chat: bool = False, add_bos: bool = True) -> List[int]:
    """Prompt ids: through the tokenizer's chat template (a user turn, generation prompt
    added), or the plain text after BOS."""
    if chat:
        # return_dict=False: transformers 5 answers tokenize=True with a BatchEncoding
        return list(
            tok.apply_chat_template(
                [{"role": "user", "content": text}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )
    ids = tok.encode(text, add_special_tokens=False)
    return ([tok.bos_token_id] if add_bos and tok.bos_token_id is not None else []) + ids


def all_rows(
    path: str, tokenizer, prompt_key="prompt", answer_key="answer", add_bos=True, chat=False
) -> List[Tuple[List[int], str]]:
    """Every (prompt ids, answer) of a file, in order (evaluation sets), encoded as the training
    prompts are (``chat``: through the tokenizer's chat template, ``data.chat_template``)."""
    d = PromptData(
        path,
        tokenizer,
        prompt_key=prompt_key,
        answer_key=answer_key,
        chat_template=chat,
        shuffle=False,
        add_bos=add_bos,
    )
    return list(zip(d.encode_all(d.prompts), d.answers))


def prompt_texts(path: str, prompt_key: str = "prompt") -> List[str]:
    """Every prompt's text of a file, in order (a multi-turn environment starts from the text,
    not from token ids)."""
    return list(read_dataset(path)[prompt_key])
