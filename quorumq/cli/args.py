"""The command line's argument types and its one-line errors (`UsageError`, `Parser`):
shared by every verb, and by the simulator's command line (`backoff_ms`)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn


class UsageError(Exception):
    """A bad argument: reported in one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse, with its errors in one line (no usage block): `quorumq X: what (see
    quorumq X --help)`, exit status 2, as every other error of the command."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def whole_number(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an int in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value > high):
            within = f"at least {low}" if high is None else f"between {low} and {high}"
            raise argparse.ArgumentTypeError(f"must be {within}, not {value}")
        return value

    return parse


def seconds(text: str) -> float:
    """An argparse type: seconds, zero or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, not {text}")
    return value


def backoff_ms(text: str) -> tuple[int, int]:
    """An argparse type: MIN:MAX, whole milliseconds (a queue's `retry_backoff_ms`; the
    simulator's `--retry-backoff` takes it too). The queue checks the range."""
    low, sep, high = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(low), int(high)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not MIN:MAX (milliseconds, e.g. 1000:60000)"
        ) from None


def queue_name(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("a queue name must not be empty")
    return text


def host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise argparse.ArgumentTypeError(f"{text!r} is not host:port")
    return host, int(port)


def peer(text: str) -> tuple[str, str]:
    name, sep, address = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NODE=host:port")
    host_port(address)
    return name, address


def timeout_pair(text: str) -> tuple[float, float]:
    low, sep, high = text.partition(",")
    try:
        pair = (float(low), float(high))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN,MAX seconds") from None
    if not sep or not 0 < pair[0] < pair[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 < MIN < MAX")
    return pair


def secret_from(file: str | None, env: str, what: str) -> str | None:
    if file is not None:
        try:
            value = Path(file).read_text().strip()
        except OSError as e:
            raise UsageError(f"cannot read the {what} file: {e}") from None
        if not value:
            raise UsageError(f"the {what} file {file} is empty")
        return value
    return os.environ.get(env) or None
