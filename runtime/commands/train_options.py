"""The options of ``baton train``, each declared once, and the ``TrainConfig`` they make.

``OPTIONS`` lists them in the order ``--help`` shows them. An option that sets a ``TrainConfig`` field
names it: its default and help are then that field's default and docstring, so the launcher's
configuration and the command line cannot describe an option twice. Options the command uses itself
(``--plan``, ``--config``, ``--report``, ...) carry their own default and help.

From this one list come the command's parameters (``option_parameters``, which typer reads as the
signature of the command), the keys of ``--config`` and ``resolved.yaml`` (``runtime.commands.train_config``
works from the command's parameters) and the ``TrainConfig`` of a run (``train_config``).
"""
from __future__ import annotations

import ast
import importlib.util
import inspect
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import typer

if TYPE_CHECKING:
    from runtime.launch.launcher import TrainConfig

TRAIN_CONFIG_MODULE = "runtime.launch.launcher"
_REQUIRED = object()


def _field_value(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


def _gpu_indices(text: str | None) -> tuple[int, ...] | None:
    from runtime.launch.devices import parse_gpus

    return parse_gpus(text)


@dataclass(frozen=True)
class TrainOption:
    """One option of ``baton train``."""

    name: str
    """The command's parameter, the key in --config and resolved.yaml; the flag is it with dashes."""
    kind: type
    """What the command line parses the value into: Path, str, int, float, or bool (a flag)."""
    field: str | None = None
    """The ``TrainConfig`` field it sets, which gives it its default and help; None: the command uses it."""
    to_field: Callable[[Any], Any] = _field_value
    """The field's value from the option's (by default paths become str)."""
    default: Any = None
    """Default of an option without a field."""
    help: str = ""
    """Help of an option without a field."""

    def __post_init__(self) -> None:
        if self.field is not None and (self.default is not None or self.help):
            raise ValueError(f"--{self.name}: its default and help are those of TrainConfig.{self.field}")
        if self.field is None and not self.help:
            raise ValueError(f"--{self.name} sets no TrainConfig field, so it needs a help text")

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


OPTIONS: tuple[TrainOption, ...] = (
    TrainOption("plan", Path, help="Plan JSON written by `baton solve` (required, here or in --config)."),
    TrainOption("steps", int, field="steps"),
    TrainOption("data", Path, field="data"),
    TrainOption("save_dir", Path, field="save_dir"),
    TrainOption("save_every", int, field="save_every"),
    TrainOption("keep", int, field="keep"),
    TrainOption("resume", bool, field="resume"),
    TrainOption("allow_other_data", bool, field="allow_other_data"),
    TrainOption("init_from", Path, field="init_from"),
    TrainOption("seed", int, field="seed"),
    TrainOption("lr", float, field="lr"),
    TrainOption("lr_min", float, field="lr_min"),
    TrainOption("warmup_steps", int, field="warmup_steps"),
    TrainOption("decay", str, field="decay"),
    TrainOption("clip_grad", float, field="clip_grad"),
    TrainOption("weight_decay", float, field="weight_decay"),
    TrainOption("eval_every", int, field="eval_every"),
    TrainOption("eval_windows", int, field="eval_windows"),
    TrainOption("run_dir", Path, field="run_dir"),
    TrainOption("log_every", int, default=10,
                help="When the output is not a terminal, print a progress line every N steps."),
    TrainOption("trace", Path, field="trace"),
    TrainOption("config", Path, help="YAML file of options (keys: option names); the command line overrides it."),
    TrainOption("device", str, field="device"),
    TrainOption("gpus", str, field="gpus", to_field=_gpu_indices),
    TrainOption("compile", bool, field="compile"),
    TrainOption("timeout", float, field="timeout_s"),
    TrainOption("rdzv_endpoint", str, field="rdzv_endpoint"),
    TrainOption("node", str, field="node"),
    TrainOption("elastic", bool, field="elastic"),
    TrainOption("interface", str, field="interface"),
    TrainOption("report", Path, help="Write measured vs predicted times and memory (JSON)."),
    TrainOption("report_timeline", Path,
                help="Draw one step after the first as predicted and as measured by every rank, two timelines over "
                     "one time axis (PNG; the format follows the suffix); needs --cluster."),
    TrainOption("cluster", Path, field="cluster_path"),
    TrainOption("profiles", Path, field="profiles_dir"),
)

COMMAND_FIELDS = ("plan", "collect_all_ranks")
"""``TrainConfig`` fields that no option sets but the command does (``train_config``'s keywords): the plan
loaded from --plan, and every rank's measurements when --report needs them."""
LAUNCHER_FIELDS = ("resume_from", "log_dir")
"""``TrainConfig`` fields the command leaves at their defaults: the launcher's own (the checkpoint
``prepare`` resolves; where tests collect a failing rank's traceback)."""


@dataclass(frozen=True)
class FieldSource:
    """A ``TrainConfig`` field as its source writes it."""

    default: Any
    """Its default value (``_REQUIRED`` when it has none)."""
    doc: str
    """Its docstring on one line."""


@lru_cache(maxsize=1)
def train_config_fields() -> dict[str, FieldSource]:
    """``TrainConfig``'s fields, read from the launcher's source, not imported: the launcher imports torch,
    which ``baton --help`` should not wait for, and a field's docstring is not kept at run time anyway."""
    spec = importlib.util.find_spec(TRAIN_CONFIG_MODULE)
    source = spec.loader.get_source(spec.name) if spec is not None and spec.loader is not None else None
    if source is None:
        raise RuntimeError(f"the source of {TRAIN_CONFIG_MODULE} is needed for the help of `baton train`")
    tree = ast.parse(source)
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "TrainConfig").body
    fields = {}
    for stmt, after in zip(body, [*body[1:], None]):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        doc = after.value.value if (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                                    and isinstance(after.value.value, str)) else ""
        default = _REQUIRED if stmt.value is None else ast.literal_eval(stmt.value)
        fields[stmt.target.id] = FieldSource(default, " ".join(doc.split()))
    return fields


def default_and_help(option: TrainOption) -> tuple[Any, str]:
    """The option's default and help: its own, or its field's."""
    if option.field is None:
        return option.default, option.help
    source = train_config_fields().get(option.field)
    if source is None or source.default is _REQUIRED:
        raise LookupError(f"--{option.name} sets TrainConfig.{option.field}, which is no field with a default")
    return source.default, source.doc


def option_parameters() -> list[inspect.Parameter]:
    """The options as keyword parameters with ``typer.Option`` defaults, in ``OPTIONS`` order."""
    params = []
    for option in OPTIONS:
        default, help_text = default_and_help(option)
        info = typer.Option(default, option.flag, help=help_text, metavar="" if option.kind is bool else None)
        annotation = Optional[option.kind] if default is None else option.kind
        params.append(inspect.Parameter(option.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation))
    return params


def train_config(values: dict[str, Any], **command_fields: Any) -> TrainConfig:
    """The ``TrainConfig`` of resolved option values (option name -> value): every option with a field, its
    value converted; ``command_fields`` are the fields of ``COMMAND_FIELDS``."""
    from runtime.launch.launcher import TrainConfig

    unknown = set(command_fields) - set(COMMAND_FIELDS)
    if unknown:
        raise TypeError(f"not fields the command sets: {', '.join(sorted(unknown))}")
    from_options = {o.field: o.to_field(values[o.name]) for o in OPTIONS if o.field is not None}
    return TrainConfig(**from_options, **command_fields)
