"""Loading a recipe: YAML read strictly into the frozen dataclasses (unknown keys name the nearest
known one, values type-checked), ``--set`` overrides, the task's defaults, and the comparison of a
resumed run's saved config with the new one. Loading reads files and nothing else."""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple

import yaml

from megatron_p3o.config.train_config import TrainConfig
from megatron_p3o.runtime.errors import (
    ConfigError,
    InputFileError,
    one_line,
    read_user_text,
)
from megatron_p3o.runtime.fields import check_choice

_FLOAT_LITERAL = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(path: str, value: Any, tp) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(path, value, a)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{path}: None is not allowed")
    if origin is Literal:  # the choices live in the annotation, checked once here
        if isinstance(value, bool) and ("off" if not value else "on") in args:
            value = "off" if not value else "on"  # YAML 1.1 reads a bare off/on as a bool
        check_choice(path, value, args)
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(
                f"{path}: expected a mapping for {tp.__name__}, got {type(value).__name__}"
            )
        return _build(tp, value, path)
    if tp is Any:
        return value
    if origin in (dict, Dict):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        inner = args[1] if len(args) == 2 else Any
        return {k: _coerce(f"{path}.{k}", v, inner) for k, v in value.items()}
    if origin in (tuple, Tuple, list, List):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__}")
        inner = args[0] if args else Any
        items = [_coerce(f"{path}[{i}]", v, inner) for i, v in enumerate(value)]
        return tuple(items) if origin in (tuple, Tuple) else items
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _FLOAT_LITERAL.match(value.strip()):
            return float(value)  # PyYAML (YAML 1.1) reads 3e-3 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported field type {_type_name(tp)}")


def load_yaml_mapping(p: Path, what: str) -> dict:
    """A user's YAML file (a recipe, a stress grid) whose top level is a mapping; a missing,
    non-UTF-8 or malformed file is one :class:`ConfigError` naming it."""
    try:
        text = read_user_text(p, what)
    except InputFileError as e:
        raise ConfigError(str(e)) from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {p}: invalid YAML: {one_line(e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {p}: the top level must be a mapping")
    return data


def _build(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            path = f"{prefix}.{key}" if prefix else key
            near = difflib.get_close_matches(key, names, n=1)
            hint = ""
            if near:
                hint = f" (did you mean {(prefix + '.' if prefix else '') + near[0]!r}?)"
            raise ConfigError(
                f"unknown config key {path!r}{hint}; known under "
                f"{prefix or 'the top level'}: {names}"
            )
    kwargs = {k: _coerce(f"{prefix}.{k}" if prefix else k, v, hints[k]) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(_at(prefix, str(e), names)) from None


def _at(prefix: str, msg: str, names: Sequence[str]) -> str:
    """A component's own check (``__post_init__``) says ``temperature=0 …`` or
    ``sampling.temperature=0 …``; the user wrote ``rollout.sampling.temperature``: name it so."""
    if not prefix:
        head = re.match(r"[A-Za-z_]\w*", msg)
        return msg if head and head.group(0) in names else f"config: {msg}"
    head = re.match(r"[A-Za-z_][\w.]*", msg)
    key = head.group(0) if head else ""
    if key.startswith(prefix + ".") or key == prefix:
        return msg
    last = prefix.rsplit(".", 1)[-1]
    if key.startswith(last + "."):
        return prefix + msg[len(last) :]
    if key.split(".", 1)[0] in names:
        return f"{prefix}.{msg}"
    return f"{prefix}: {msg}"


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """``["optim.lr=1e-6", "loss.objective=grpo"]`` applied to a nested dict (values are YAML)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key.sub=value")
        key, raw = item.split("=", 1)
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {p!r} is not a section")
        node[parts[-1]] = yaml.safe_load(raw)
    return data


def load_config(path: Optional[str | Path], overrides: Sequence[str] = ()) -> TrainConfig:
    """Read a YAML recipe (or only defaults when ``path`` is None) and apply ``--set`` items.
    Reads files and nothing else: each component's config checks its own fields as it is built
    (``__post_init__``), :class:`TrainConfig` what spans components; a ``data.task``'s splits
    are written by :meth:`TrainConfig.with_task_files`, which the entry points call."""
    data: dict = {}
    if path is not None:
        data = load_yaml_mapping(Path(path), "recipe")
    return _build(TrainConfig, apply_overrides(data, overrides))


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


# Keys a resumed run may change freely: where and how long it runs, its layout, logging,
# evaluation, checkpoint cadence, where the servers are and how weights reach them.
RESUME_FREE = (
    "run.", "steps", "parallel.", "checkpoint.", "eval.", "wandb.", "data.eval_",
    "model.checkpoint", "model.hf_config", "rollout.sglang.", "rollout.sglang_workers",
    "rollout.weight_sync", "rollout.device",
)  # fmt: skip
# ... except these: the seed orders the prompts, so another seed changes the data mid-epoch
RESUME_BOUND = ("run.seed",)


def _flat(d: dict, prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(saved: dict, now: dict) -> List[Tuple[str, Any, Any]]:
    """``(key, saved value, current value)`` of every training-relevant key that differs
    between the recipe a checkpoint was written with and the current one."""
    a, b = _flat(saved), _flat(now)
    return [
        (k, a.get(k), b.get(k))
        for k in sorted(set(a) | set(b))
        if (k in RESUME_BOUND or not k.startswith(RESUME_FREE)) and a.get(k) != b.get(k)
    ]
