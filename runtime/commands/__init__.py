"""The runtime's subcommands of ``baton``: ``train``, ``launch``, ``data prepare``, ``export``, ``generate``, and the
measuring branches of ``profile`` (``--device``, ``--comm --peer``), which the planning core cannot run without
torch."""
from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    from runtime.commands import data_export, launch, profile, train

    profile.register()  # `baton profile --device` measures with the runtime's layer
    data_export.register(app)
    train.register(app)
    launch.register(app)
