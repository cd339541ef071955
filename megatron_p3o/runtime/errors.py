"""User errors and how the command-line tools report them.

Why: a typo in a recipe, a missing checkpoint or a dead rollout server is the user's to fix, and
a 30-line traceback (prefixed ``[rank0]:`` under torchrun) buries the one line that says how.
Every such error derives from :class:`UserError`; :func:`run_cli` prints its message once (rank 0
under torchrun), on one line, on stderr, and exits with status 2. ``--debug`` or ``P3O_DEBUG=1``
re-raises it with its traceback. Anything else is a programming error and keeps its traceback.

The specific classes also derive from the builtin a caller would catch (``ValueError``,
``FileNotFoundError``, …), so library code can keep catching those.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

EXIT_USER_ERROR = 2


class UserError(Exception):
    """Bad input: a recipe key or value, a file, a layout, a checkpoint, rollout data."""


class InputFileError(UserError, FileNotFoundError):
    """A file or directory the user named does not exist or is not what it should be."""


class OutputExistsError(UserError, FileExistsError):
    """An output directory exists already; nothing is overwritten."""


class CheckpointError(UserError, ValueError):
    """A checkpoint is missing, incomplete, or does not match the model it is loaded into."""


class ConfigError(UserError, ValueError):
    """One bad key or value; the message names its dotted path."""


class DataError(UserError, ValueError):
    """A prompt file or a rollout sample is malformed (the message names the row or sample)."""


def read_user_text(path, what: str) -> str:
    """The text of a file the user named (a recipe, a grid, ...): a missing file, a directory,
    an unreadable or a non-UTF-8 file is one line naming it (``what``: "recipe", ...), not an
    ``IsADirectoryError`` / ``UnicodeDecodeError`` traceback from deep inside a reader."""
    p = Path(path)
    if p.is_dir():
        raise InputFileError(f"{what} {p} is a directory, not a file")
    if not p.is_file():
        raise InputFileError(f"{what} {p} does not exist")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise InputFileError(f"{what} {p}: cannot read it: {e.strerror or e}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise InputFileError(
            f"{what} {p}: not UTF-8 text (byte 0x{raw[e.start]:02x} on line {line})"
        ) from None


def count_arg(text: str) -> int:
    """argparse ``type=`` for counts and sizes (--tp, --pp, ...): an integer >= 1, refused by
    argparse in one line, not by a ZeroDivisionError deep in the layout arithmetic."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _debug(argv: Sequence[str]) -> bool:
    return "--debug" in argv or os.environ.get("P3O_DEBUG", "") not in ("", "0")


def _is_reporting_rank() -> bool:
    """Rank 0 reports (every rank raises the same error; one line is enough)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass
    return os.environ.get("RANK", "0") == "0"


def one_line(err: BaseException) -> str:
    """The error's message on a single line."""
    text = str(err).strip() or type(err).__name__
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def run_cli(main: Callable[[Optional[Sequence[str]]], int], prog: str) -> None:
    """``sys.exit(main(argv))``, reporting a :class:`UserError` as ``prog: error: message``."""
    from megatron_p3o.runtime.quiet import silence_known_warnings

    silence_known_warnings()
    argv = sys.argv[1:]
    debug = _debug(argv)
    try:
        code = main([a for a in argv if a != "--debug"])
    except UserError as e:
        if debug:
            raise
        if _is_reporting_rank():
            print(f"{prog}: error: {one_line(e)}", file=sys.stderr, flush=True)
        elif os.environ.get("WORLD_SIZE", "1") != "1":
            # Under torchrun the first rank to exit makes the launcher kill the others: give
            # rank 0 the moment it needs to print the one line (measured: a loaded machine can
            # take ~1 s between the ranks' identical errors).
            import time

            time.sleep(5.0)
        code = EXIT_USER_ERROR
    sys.exit(code)
