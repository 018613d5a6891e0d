"""The error/exit skeleton every ``hp`` command shares, written once.

A command body raises :class:`CommandFailed` (or lets an expected error through
:func:`failing`, which turns it into one); :func:`command` catches it, prints
``hp NAME: error: MESSAGE`` (``problem`` instead of ``error`` for a problem a check found)
on the error console and returns its exit code: 1 for a problem, 2 for usage.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.text import Text

__all__ = ["CommandFailed", "Handler", "command", "failing", "one_line", "typed_message"]

#: A command handler: ``(args, out, err)`` (two rich consoles) → the exit code.
Handler = Callable[[argparse.Namespace, Console, Console], int]


class CommandFailed(Exception):
    """A command stops: ``code`` is the exit status (1 a problem, 2 usage), ``message`` what it
    prints after ``hp NAME: LABEL: `` (``label`` is ``error``, or ``problem`` for a problem a
    check found). Control flow inside the CLI only: :func:`command` catches every one."""

    def __init__(self, code: int, message: str, *, label: str = "error") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.label = label


def typed_message(error: BaseException) -> str:
    """``Type: message``: how a command reports an error hp raised (``PlanError: ...``)."""
    return f"{type(error).__name__}: {error}"


def one_line(error: BaseException, limit: int = 400) -> str:
    """``Type: message`` on one line (whitespace collapsed), at most ``limit`` characters."""
    text = " ".join(typed_message(error).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@contextmanager
def failing(
    code: int,
    *errors: type[BaseException],
    message: Callable[[BaseException], str] = typed_message,
) -> Iterator[None]:
    """Turn any of ``errors`` raised inside the block into ``CommandFailed(code, message(e))``."""
    try:
        yield
    except errors as e:
        raise CommandFailed(code, message(e)) from None


def command(name: str) -> Callable[[Handler], Handler]:
    """Decorate the handler of ``hp NAME``: a :class:`CommandFailed` it raises is printed as
    ``hp NAME: LABEL: MESSAGE`` on ``err`` and its code returned."""

    def decorate(body: Handler) -> Handler:
        @functools.wraps(body)
        def handler(args: argparse.Namespace, out: Console, err: Console) -> int:
            try:
                return body(args, out, err)
            except CommandFailed as e:
                err.print(Text(f"hp {name}: {e.label}: {e.message}"), soft_wrap=True)
                return e.code

        return handler

    return decorate
