"""The one way a component's config checks its own fields: ``check_ranges(self, RANGES)`` in its
``__post_init__`` (so a config built in code is checked as a loaded one is), ``check_choice``
for a closed set of strings, ``check_url`` for a server address.

Messages name the field by its recipe key (``optim.lr=-0.001 must be > 0``), for a config loaded
from YAML and one built in code alike. What spans components is checked once, by ``TrainConfig``:
without the environment in its ``__post_init__``, with it (the launch's world size, the SGLang
interpreter) in ``validate``.
"""

from __future__ import annotations

import difflib
import math
from typing import Any, Callable, Dict, Mapping, Optional, Sequence

from megatron_p3o.runtime.errors import ConfigError

RULES: Dict[str, Callable[[Any], bool]] = {
    "> 0": lambda v: v > 0,
    ">= 0": lambda v: v >= 0,
    ">= 1": lambda v: v >= 1,
    ">= 2": lambda v: v >= 2,
    "in (0, 1]": lambda v: 0 < v <= 1,
    "in [0, 1)": lambda v: 0 <= v < 1,
    "in [0, 1]": lambda v: 0 <= v <= 1,
    "a port in [1, 65535]": lambda v: 1 <= v <= 65535,
    "in [0, 65535] (0: a free port)": lambda v: 0 <= v <= 65535,
}


def check_ranges(obj: Any, ranges: Mapping[str, str], key: str) -> None:
    """Each ``field: rule`` of ``ranges`` (a rule of :data:`RULES`) holds on ``obj`` and the value
    is finite; ``None`` (an optional value left unset) is not checked. One error, the first,
    naming the field under the component's recipe ``key`` (``optim`` → ``optim.lr``)."""
    for field, rule in ranges.items():
        v = getattr(obj, field)
        name = f"{key}.{field}" if key else field
        if v is None:
            continue
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{name}={v} must be a finite number")
        if not RULES[rule](v):
            raise ConfigError(f"{name}={v} must be {rule}")


def check_choice(path: str, value, choices: Sequence) -> None:
    """``value`` is one of ``choices``; else the error names the nearest one."""
    if value not in choices:
        near = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        raise ConfigError(
            f"{path}={value!r}; choose one of {list(choices)}"
            f"{f' (did you mean {near[0]!r}?)' if near else ''}"
        )


def check_url(path: str, url: Optional[str]) -> None:
    """``http(s)://host:port``: without a scheme urllib raises ``unknown url type`` mid-run."""
    from urllib.parse import urlsplit

    if url is None:
        return
    try:
        parts = urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number in range
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"{path}={url!r} is not a URL like http://HOST:PORT")
