"""The ``baton`` command: each area of the package registers its own subcommands here."""
from __future__ import annotations

import typer

app = typer.Typer(
    name="baton",
    help="Plan and run LLM training on heterogeneous GPU clusters.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"baton {version('baton')}")
        except PackageNotFoundError:  # run from a checkout that was never installed
            print("baton (not installed)")
        raise typer.Exit()


@app.callback()
def main(
    show_version: bool = typer.Option(False, "--version", metavar="", callback=_version, is_eager=True,
                                      help="Print the version and exit."),
) -> None:
    """Baton: uneven pipelines, uneven tensor shards and per-operator recomputation, planned as one MILP."""


def _register() -> None:
    # Each area owns its subcommands; their heavy imports (torch, pyomo) happen inside the commands.
    from baton import commands as core_commands
    from runtime import commands as runtime_commands
    from solver import commands as solver_commands

    core_commands.register(app)
    solver_commands.register(app)
    runtime_commands.register(app)


_register()

if __name__ == "__main__":
    app()
