"""Load a Hugging Face checkpoint directory (config.json + model.safetensors, sharded or not, or
pytorch_model.bin): ``GPT2LMHeadModel`` into Baton's GPT, ``LlamaForCausalLM`` into its Llama (``load_hf``
picks by the config's ``model_type``).

Llama: the config is read by ``baton.hf_config.llama_spec`` (what Baton's Llama does not compute, such as
rope scaling, a sliding window or biases, is refused in one line naming the field) and must describe the
plan's model; tensors keep their layout and take ``runtime.model.llama``'s names (``llama_name``).

GPT-2:
GPT-2's ``Conv1D`` stores weights as (in, out); ours are ``nn.Linear`` (out, in), so they are
transposed. Its LM head is tied to ``wte``; the causal-mask buffers are ignored. ``.bin`` files are
read with ``torch.load(weights_only=True)`` (no arbitrary pickle). The tensors are full and unpadded
(``wte.weight`` has ``vocab_size`` rows); vocabulary-parallel stages take their rows of it and fill the
rows past the vocabulary with zeros (``runtime/parallel/slicing.py``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from baton.errors import BatonError
from baton.hf_config import llama_spec
from baton.model_spec import ModelSpec
from runtime.model.gpt import parameter_shapes
from runtime.model.llama import parameter_shapes as llama_shapes

_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _check_config(config: dict, spec: ModelSpec, source: str) -> None:
    def need(field: str, want, got) -> None:
        if got != want:
            raise BatonError(f"is {got}, the plan's model '{spec.name}' needs {want}", source=source, field=field)

    if config.get("model_type", "gpt2") != "gpt2":
        raise BatonError(f"model_type '{config.get('model_type')}' is not gpt2", source=source, field="model_type")
    need("n_layer", spec.num_layers, config.get("n_layer"))
    need("n_embd", spec.hidden_dim, config.get("n_embd"))
    need("n_head", spec.num_heads, config.get("n_head"))
    need("n_inner", spec.ffn_dim, config.get("n_inner") or 4 * config.get("n_embd", 0))
    need("vocab_size", spec.vocab_size, config.get("vocab_size"))
    if config.get("n_positions", 0) < spec.seq_len:
        raise BatonError(f"is {config.get('n_positions')}, shorter than the plan's seq_len {spec.seq_len}",
                         source=source, field="n_positions")
    # gelu_pytorch_tanh is the same tanh approximation as gelu_new, computed by PyTorch's kernel.
    if config.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise BatonError(f"is {config.get('activation_function')}, Baton's GPT uses the tanh GELU (gelu_new or "
                         "gelu_pytorch_tanh)", source=source, field="activation_function")
    # resid_pdrop, embd_pdrop, attn_pdrop are training choices, not weights: the plan's model's dropout applies.
    need("layer_norm_epsilon", 1e-5, config.get("layer_norm_epsilon", 1e-5))
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        need(flag, False, bool(config.get(flag, False)))
    need("scale_attn_weights", True, bool(config.get("scale_attn_weights", True)))


def _read_config(root: Path) -> dict:
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise BatonError("no config.json (expected a Hugging Face checkpoint directory)", source=str(root), field="--init-from")
    try:
        config = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BatonError(f"malformed JSON: {str(exc).splitlines()[0]}", source=str(cfg_file)) from None
    if not isinstance(config, dict):
        raise BatonError("expected a JSON object", source=str(cfg_file))
    return config


def load_hf(path: str | Path, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Full tensors under the runtime's names from a Hugging Face directory of ``spec``'s architecture."""
    return (load_llama if spec.llama else load_gpt2)(path, spec)


def load_gpt2(path: str | Path, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Full tensors under ``runtime.model.gpt`` names from a GPT-2 directory, checked against ``spec``."""
    root = Path(path)
    config = _read_config(root)
    _check_config(config, spec, str(root / "config.json"))
    raw = _read_weights(root)
    raw = {k.removeprefix("transformer."): v for k, v in raw.items()}
    _refuse_untied_head(raw, config, root)
    out = {}
    for name, shape in parameter_shapes(spec).items():
        if name not in raw:
            raise BatonError(f"weights have no tensor '{name}'", source=str(root))
        t = raw[name].float()
        if name.endswith(_TRANSPOSED):
            t = t.t()
        if name == "wpe.weight":
            t = t[: spec.seq_len]
        if tuple(t.shape) != shape:
            raise BatonError(f"tensor '{name}' has shape {tuple(t.shape)}, expected {shape}", source=str(root))
        out[name] = t.contiguous()
    return out


_LLAMA_FIELDS = (("num_layers", "num_hidden_layers"), ("hidden_dim", "hidden_size"), ("num_heads", "num_attention_heads"),
                 ("kv_heads", "num_key_value_heads"), ("ffn_dim", "intermediate_size"), ("vocab_size", "vocab_size"),
                 ("tie_embeddings", "tie_word_embeddings"), ("rope_theta", "rope_theta"), ("norm_eps", "rms_norm_eps"))
"""(spec attribute, config field) that must agree between the plan's model and a Llama checkpoint."""


def llama_name(name: str) -> str:
    """``LlamaForCausalLM``'s name of a ``runtime.model.llama`` parameter."""
    fixed = {"wte.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight"}
    if name in fixed:
        return fixed[name]
    _, layer, rest = name.split(".", 2)
    rest = {"ln_1.weight": "input_layernorm.weight", "ln_2.weight": "post_attention_layernorm.weight",
            "attn.c_proj.weight": "self_attn.o_proj.weight", "mlp.c_proj.weight": "mlp.down_proj.weight"}.get(
        rest, rest.replace("attn.", "self_attn."))
    return f"model.layers.{layer}.{rest}"


def load_llama(path: str | Path, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Full tensors under ``runtime.model.llama`` names from a ``LlamaForCausalLM`` directory, checked against
    ``spec`` (the config's every size, head tying, rope theta and norm epsilon; a context at least the plan's)."""
    root = Path(path)
    config = _read_config(root)
    source = str(root / "config.json")
    if config.get("model_type") != "llama":
        raise BatonError(f"model_type {config.get('model_type')!r} is not llama (the plan's model is a Llama)", source=source,
                         field="model_type")
    theirs = llama_spec(config, name=spec.name, source=source)
    for attr, field in _LLAMA_FIELDS:
        if getattr(theirs, attr) != getattr(spec, attr):
            raise BatonError(f"is {getattr(theirs, attr)}, the plan's model '{spec.name}' needs {getattr(spec, attr)}",
                             source=source, field=field)
    if theirs.seq_len < spec.seq_len:
        raise BatonError(f"is {theirs.seq_len}, shorter than the plan's seq_len {spec.seq_len}", source=source,
                         field="max_position_embeddings")
    raw = _read_weights(root)
    out = {}
    for name, shape in llama_shapes(spec).items():
        theirs_name = llama_name(name)
        if theirs_name not in raw:
            raise BatonError(f"weights have no tensor '{theirs_name}'", source=str(root))
        t = raw[theirs_name].float()
        if tuple(t.shape) != shape:
            raise BatonError(f"tensor '{theirs_name}' has shape {tuple(t.shape)}, expected {shape}", source=str(root))
        out[name] = t.contiguous()
    return out


def _read_weights(root: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's weights: one safetensors file, a sharded set, or a plain .bin."""
    if (root / "model.safetensors").is_file():
        raw = load_file(str(root / "model.safetensors"))
    elif (root / "model.safetensors.index.json").is_file():
        raw = _load_sharded(root / "model.safetensors.index.json")
    elif (root / "pytorch_model.bin").is_file():
        try:
            raw = torch.load(root / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as exc:  # unpickling refused or corrupt file
            raise BatonError(f"cannot read weights safely: {exc}".splitlines()[0], source=str(root / "pytorch_model.bin")) from None
    else:
        raise BatonError("neither model.safetensors nor pytorch_model.bin found", source=str(root), field="--init-from")
    return raw


def _load_sharded(index_file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded safetensors checkpoint (``weight_map``: tensor name -> shard file)."""
    try:
        weight_map = json.loads(index_file.read_text()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise BatonError("malformed index: expected a 'weight_map' of tensor name -> file", source=str(index_file), field="weight_map")
    raw: dict[str, torch.Tensor] = {}
    for name in sorted(set(weight_map.values())):
        shard = index_file.parent / name
        if Path(name).name != name or not shard.is_file():
            raise BatonError(f"shard '{name}' is missing", source=str(index_file), field="weight_map")
        raw.update(load_file(str(shard)))
    return raw


def _refuse_untied_head(raw: dict[str, torch.Tensor], config: dict, root: Path) -> None:
    """Baton's GPT ties its LM head to ``wte``: a checkpoint whose own ``lm_head.weight`` differs would give
    other logits (by up to 4.5 in a random GPT-2), so it is refused rather than silently dropped."""
    head, wte = raw.get("lm_head.weight"), raw.get("wte.weight")
    if head is not None and wte is not None and not (head.shape == wte.shape and torch.equal(head, wte)):
        raise BatonError("the LM head is not tied to the token embedding (lm_head.weight differs from wte.weight); "
                         "Baton's GPT ties them", source=str(root), field="lm_head.weight")
    if head is None and config.get("tie_word_embeddings", True) is False:
        raise BatonError("tie_word_embeddings is false but the weights have no lm_head.weight; Baton's GPT ties the LM head "
                         "to the token embedding", source=str(root / "config.json"), field="tie_word_embeddings")
