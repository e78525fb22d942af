"""The `bench` subcommand, registered through ``register_commands`` like any third-party command."""
from __future__ import annotations

import click

from ..core.hookspecs import CommandFactory, hookimpl
from ..core.registry import Register


def bench_command() -> click.Command:
    """The command object; its module imports torch and the engine only when the command runs."""
    from ..bench.command import bench

    return bench


@hookimpl
def register_commands(register: Register[CommandFactory]) -> None:
    register("bench", bench_command)
