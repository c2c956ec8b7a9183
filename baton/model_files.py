"""Where a model comes from: a preset name, a model YAML, or a Hugging Face model directory.

Above both ``baton.model_spec`` (the spec and its presets) and ``baton.hf_config`` (Hugging Face configs read
into specs), which each need the other's names only through this one entry point.
"""
from __future__ import annotations

from pathlib import Path

from baton.errors import BatonError
from baton.fields import excerpt, load_yaml
from baton.hf_config import is_hf_dir, spec_from_hf_dir
from baton.model_spec import PRESETS, ModelSpec, from_mapping, own_name


def load_model(name_or_path: str) -> ModelSpec:
    """A preset name (``gpt3-1.3b``) or a path to a model YAML (``own_name``: one that changes a preset's
    sizes gets a name of its own)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if is_hf_dir(path):  # a Hugging Face model directory: its config.json
        return spec_from_hf_dir(path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        data = load_yaml(path)
        return own_name(from_mapping(data, source=str(path)), named=isinstance(data, dict) and data.get("name") is not None,
                        source=str(path))
    raise BatonError(f"unknown model {excerpt(name_or_path)}: not a preset ({', '.join(PRESETS)}) and not a YAML file", field="model")
