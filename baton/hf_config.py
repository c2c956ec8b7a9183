"""A Hugging Face model directory's ``config.json`` as a ``ModelSpec``: plan exactly the checkpoint you have.

``LlamaForCausalLM`` configs (``model_type: llama``) become ``architecture: llama`` specs; GPT-2 configs
(``model_type: gpt2``) GPT specs. What Baton's layers do not compute is refused in one line naming the
field: rope scaling other than none, a sliding window, biases, an activation other than SiLU, a head width
other than hidden / heads. The context is ``max_position_embeddings`` (``--seq-len`` overrides it where a
command has one); the dtype is the checkpoint's ``torch_dtype`` (fp16 when it names none).

Pure JSON: the planner reads it without torch (``runtime.model.hf_import`` checks the weights against it).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from baton.errors import BatonError
from baton.model_spec import ModelSpec, validate

CONFIG = "config.json"
_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def is_hf_dir(path: str | Path) -> bool:
    """A directory holding a Hugging Face ``config.json``."""
    p = Path(path)
    return p.is_dir() and (p / CONFIG).is_file()


def read_config(root: str | Path) -> dict:
    path = Path(root) / CONFIG
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise BatonError(f"malformed JSON: {str(exc).splitlines()[0]}", source=str(path)) from None
    if not isinstance(config, dict):
        raise BatonError("expected a JSON object", source=str(path))
    return config


def spec_from_hf_dir(root: str | Path) -> ModelSpec:
    """The spec of the model in ``root`` (its ``config.json``), named after the directory."""
    root = Path(root)
    config = read_config(root)
    source = str(root / CONFIG)
    name = re.sub(r"[^A-Za-z0-9._-]", "-", root.resolve().name)[:100] or "hf-model"
    kind = config.get("model_type")
    if kind == "llama":
        return llama_spec(config, name=name, source=source)
    if kind == "gpt2":
        return _gpt2_spec(config, name=name, source=source)
    raise BatonError(f"model_type {kind!r} is not supported (Baton plans 'llama' and 'gpt2' layers)", source=source,
                     field="model_type")


def _get(config: dict, key: str, source: str, default=...):
    if key not in config:
        if default is ...:
            raise BatonError("missing", source=source, field=key)
        return default
    return config[key]


def _dtype(config: dict, source: str) -> str:
    raw = config.get("torch_dtype") or config.get("dtype") or "float16"
    if raw not in _DTYPES:
        raise BatonError(f"is {raw!r}; Baton trains float16, bfloat16 or float32", source=source, field="torch_dtype")
    return _DTYPES[raw]


def llama_spec(config: dict, *, name: str, source: str) -> ModelSpec:
    """A ``LlamaConfig`` as a spec; one line naming the field for what the runtime's Llama does not compute."""
    # transformers 4 writes rope_theta and rope_scaling; 5 one rope_parameters block with both.
    rope = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    for field, scaling in (("rope_scaling", config.get("rope_scaling")), ("rope_parameters", rope or None)):
        if scaling not in (None, {}) and not (isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "default"):
            raise BatonError(f"is {json.dumps(scaling)[:120]}; Baton's rotary positions are unscaled (rope type 'default')",
                             source=source, field=field)
    theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
    for field, value in (("rope_theta", theta), ("rms_norm_eps", config.get("rms_norm_eps", 1e-6))):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BatonError(f"must be a number, got {json.dumps(value)[:60]}", source=source, field=field)
    for key in ("sliding_window", "attention_bias", "mlp_bias"):
        if config.get(key):
            what = "sliding-window attention" if key == "sliding_window" else "biases"
            raise BatonError(f"is {config[key]!r}; Baton's Llama has no {what}", source=source, field=key)
    if config.get("hidden_act", "silu") != "silu":
        raise BatonError(f"is {config['hidden_act']!r}; Baton's Llama uses SiLU (SwiGLU)", source=source, field="hidden_act")
    hidden, heads = _get(config, "hidden_size", source), _get(config, "num_attention_heads", source)
    head_dim = config.get("head_dim")
    if head_dim is not None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and head_dim * heads != hidden:
        raise BatonError(f"is {head_dim}, not hidden_size / num_attention_heads = {hidden // heads}", source=source, field="head_dim")
    spec = ModelSpec(
        name=name, architecture="llama", num_layers=_get(config, "num_hidden_layers", source), hidden_dim=hidden, num_heads=heads,
        # As the presets say plain multi-head attention: no KV head count of its own.
        num_kv_heads=None if config.get("num_key_value_heads") in (None, heads) else config["num_key_value_heads"],
        ffn_dim=_get(config, "intermediate_size", source),
        seq_len=_get(config, "max_position_embeddings", source), vocab_size=_get(config, "vocab_size", source),
        dtype=_dtype(config, source), dropout=float(config.get("attention_dropout") or 0.0),
        rope_theta=float(theta), norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    )
    return validate(spec, source=source)


def _gpt2_spec(config: dict, *, name: str, source: str) -> ModelSpec:
    hidden = _get(config, "n_embd", source)
    spec = ModelSpec(
        name=name, num_layers=_get(config, "n_layer", source), hidden_dim=hidden, num_heads=_get(config, "n_head", source),
        ffn_dim=config.get("n_inner") or 4 * hidden, seq_len=_get(config, "n_positions", source),
        vocab_size=_get(config, "vocab_size", source), dtype=_dtype(config, source),
        dropout=float(config.get("resid_pdrop", 0.1)),
    )
    return validate(spec, source=source)
