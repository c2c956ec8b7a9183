"""``baton train``'s options and ``TrainConfig`` declared once: neither can gain an option the other misses."""
from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import typer
from typer.main import get_command
from typer.testing import CliRunner

from runtime.commands import train as train_command
from runtime.commands.train_options import (COMMAND_FIELDS, LAUNCHER_FIELDS, OPTIONS, TrainOption, default_and_help,
                                            train_config, train_config_fields)
from runtime.launch.launcher import TrainConfig
from tests.runtime_helpers import plan_of, tiny


def _app() -> typer.Typer:
    app = typer.Typer(pretty_exceptions_enable=False)

    @app.callback()
    def main() -> None:
        """test app"""

    train_command.register(app)
    return app


def _click_params():
    return get_command(_app()).commands["train"].params


def test_every_train_config_field_is_set_by_an_option_or_named_as_set_elsewhere():
    """Catches: a TrainConfig field that no option sets and nobody said why (added to the launcher only),
    two options setting one field, a field listed both as an option's and as the command's."""
    fields = [f.name for f in dataclasses.fields(TrainConfig)]
    by_options = [o.field for o in OPTIONS if o.field is not None]
    assert len(by_options) == len(set(by_options)), by_options
    groups = [set(by_options), set(COMMAND_FIELDS), set(LAUNCHER_FIELDS)]
    assert sum(len(g) for g in groups) == len(set().union(*groups)), "a field named in two places"
    assert set().union(*groups) == set(fields)


def test_every_option_reaches_a_field_or_the_command():
    """Catches: an option that the command line takes but nothing reads (added to OPTIONS only), or one the
    command reads that no longer exists."""
    source = Path(inspect.getsourcefile(train_command)).read_text()
    field_names = {f.name for f in dataclasses.fields(TrainConfig)}
    for option in OPTIONS:
        if option.field is not None:
            assert option.field in field_names, option
        else:
            assert f'options["{option.name}"]' in source, f"--{option.name} is read nowhere"
    read = set(re.findall(r'options\["(\w+)"\]', source))
    assert read <= {o.name for o in OPTIONS}, read - {o.name for o in OPTIONS}


def test_the_command_takes_exactly_the_declared_options_with_their_fields_defaults_and_help():
    """Catches: a parameter of the command outside OPTIONS, an option's default that is not its field's
    (the CLI and a TrainConfig built in Python would then train differently), a field without a docstring
    (an option without help), the source reader misreading a default."""
    params = _click_params()
    assert [p.name for p in params if p.name != "help"] == [o.name for o in OPTIONS]
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    for param, option in zip(params, OPTIONS):
        assert param.opts == [option.flag]
        default, help_text = default_and_help(option)
        assert param.default == default and param.help == help_text and help_text, option
        if option.field is not None:
            assert default == defaults[option.field], option
            assert help_text == train_config_fields()[option.field].doc
    assert {f.name for f in dataclasses.fields(TrainConfig)} == set(train_config_fields())


def test_train_config_of_the_defaults_is_the_default_train_config_and_options_convert():
    """Catches: a conversion lost between the command line and TrainConfig (paths as str, --gpus as a tuple,
    --timeout to timeout_s, --cluster to cluster_path)."""
    plan = plan_of(tiny(), [[1]], [4], 1)
    defaults = {o.name: default_and_help(o)[0] for o in OPTIONS}
    assert train_config(defaults, plan=plan) == TrainConfig(plan=plan)
    given = {**defaults, "gpus": "0,1", "timeout": 5.0, "cluster": Path("c.yaml"), "profiles": Path("p"),
             "data": Path("d.txt"), "run_dir": Path("r")}
    cfg = train_config(given, plan=plan, collect_all_ranks=True)
    assert (cfg.gpus, cfg.timeout_s, cfg.cluster_path, cfg.profiles_dir, cfg.data, cfg.run_dir, cfg.collect_all_ranks) == \
        ((0, 1), 5.0, "c.yaml", "p", "d.txt", "r", True)
    with pytest.raises(TypeError):
        train_config(defaults, plan=plan, trace="t.json")  # an option's field: set by the option


def test_a_config_file_knows_every_option_but_config(tmp_path):
    """Catches: a config key missing for an option, or one without an option."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("stepz: 3\n")
    result = CliRunner().invoke(_app(), ["train", "--config", str(cfg)])
    assert result.exit_code == 2, result.output
    known = " ".join(result.stderr.split()).split("known: ", 1)[1].split(")", 1)[0]
    assert known.split(", ") == [o.name.replace("_", "-") for o in OPTIONS if o.name != "config"]


def test_an_option_is_described_in_one_place():
    with pytest.raises(ValueError):
        TrainOption("steps", int, field="steps", help="a second description")
    with pytest.raises(ValueError):
        TrainOption("verbose", bool)  # neither a field nor a help
