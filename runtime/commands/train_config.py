"""``baton train --config run.yaml``: a YAML file whose keys are the command's options.

Keys are option names without the dashes, with ``-`` or ``_`` (``warmup-steps`` or ``warmup_steps``);
values are what the option takes on the command line, converted by the option's own type, so the file
and the command line accept exactly the same things (``lr: 3e-4`` too, which YAML reads as a string). An
option given on the command line wins over the file. The run directory keeps the result
(``resolved.yaml``: every option's value, defaults included), which ``--config`` reads back as it is.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from baton.errors import BatonError
from baton.fields import load_yaml

RESOLVED_FILE = "resolved.yaml"
NOT_IN_FILE = ("config",)
"""Options a config file cannot set (a config naming another config would be a chain to follow)."""


def _given_on_command_line(ctx, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT", "PROMPT")


def resolve_options(ctx, config: Path | None) -> dict:
    """The command's option values (``ctx.params``) with the file's values put in for every option not
    given on the command line. Unknown keys and unconvertible values are one-line errors naming the key."""
    values = dict(ctx.params)
    if config is None:
        return values
    data = load_yaml(config)
    if data is None:
        return values
    if not isinstance(data, dict):
        raise BatonError("a train config must be a mapping of option names to values", source=str(config))
    params = {p.name: p for p in ctx.command.params}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in params or name in NOT_IN_FILE or not isinstance(key, str):
            known = ", ".join(n.replace("_", "-") for n in params if n not in NOT_IN_FILE)
            raise BatonError(f"unknown option '{key}' (known: {known})", source=str(config), field=str(key))
        if value is None or _given_on_command_line(ctx, name):
            continue
        if isinstance(value, (dict, list)):
            raise BatonError(f"must be a single value, got a {type(value).__name__}", source=str(config), field=str(key))
        try:
            values[name] = params[name].process_value(ctx, value)
        except Exception as exc:  # the option type's own message (BadParameter), as the command line would say
            message = getattr(exc, "message", None) or str(exc)
            raise BatonError(f"{message.splitlines()[0] if message else 'invalid value'} (got {value!r})",
                             source=str(config), field=str(key)) from None
    return values


def write_resolved(run_dir: str | Path, values: dict) -> Path:
    """Write ``values`` (option name -> value) as ``run_dir/resolved.yaml``; options left unset are omitted."""
    out = {}
    for name, value in values.items():
        if name in NOT_IN_FILE or value is None:
            continue
        # Absolute paths: the file then works as a --config from any directory.
        out[name.replace("_", "-")] = str(value.absolute()) if isinstance(value, Path) else value
    path = Path(run_dir) / RESOLVED_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(out, sort_keys=False))
    return path
