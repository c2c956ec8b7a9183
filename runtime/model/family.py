"""The two layer families' single-device models behind one door: the parameters' full shapes and initial
values, and the reference model, for a spec of either architecture (``ModelSpec.architecture``)."""
from __future__ import annotations

import torch

from baton.model_spec import ModelSpec
from runtime.model import gpt, llama


def parameter_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every parameter's full shape, in model order (``runtime.model.gpt`` or ``runtime.model.llama``)."""
    return (llama if spec.llama else gpt).parameter_shapes(spec)


def init_parameter(spec: ModelSpec, name: str, seed: int) -> torch.Tensor:
    """The full initial value of one parameter: a function of (seed, name) only (``gpt.init_value``)."""
    return gpt.init_value(name, parameter_shapes(spec)[name], spec.num_layers, seed)


def reference_model(spec: ModelSpec, *, seed: int = 0) -> torch.nn.Module:
    """The single-device model of ``spec``: ``gpt.GPT`` or ``llama.Llama``."""
    return llama.Llama(spec, seed=seed) if spec.llama else gpt.GPT(spec, seed=seed)
