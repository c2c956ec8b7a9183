"""Checkpoints out of Baton: a Hugging Face GPT-2 or Llama directory, and the tokenizer the data used.

A Llama checkpoint becomes a ``LlamaForCausalLM`` (``llama_config``, ``llama_state``: the tensors keep their
layout and take Hugging Face's names, ``runtime.model.hf_import.llama_name``); a GPT one a ``GPT2LMHeadModel``.

``export_hf`` writes ``config.json`` and ``model.safetensors`` that ``transformers.GPT2LMHeadModel``
loads with the logits of ``runtime.model.gpt.GPT`` (the inverse of ``runtime.model.hf_import.load_gpt2``: ``nn.Linear``
weights (out, in) become ``Conv1D`` weights (in, out); the LM head stays tied to ``wte``), plus the
tokenizer when the training data had one (``tokenizer.json``, ``tokenizer_config.json``).

A checkpoint is named by its ``step-XXXXXX`` directory or by the ``--save-dir`` holding it (then the
newest intact one is taken). Its tensors are checked against the SHA-256 recorded in ``meta.json``.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from baton.errors import BatonError
from baton.model_spec import ModelSpec, from_mapping
from runtime.train.checkpoint import CheckpointReader, checkpoints, find_resumable, verify_files
from runtime.model.family import parameter_shapes
from runtime.model.gpt import LN_EPS
from runtime.model.hf_import import llama_name

TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
"""Weights GPT-2 keeps in ``Conv1D`` layout (in, out)."""


def _spec_of(meta_file: Path) -> ModelSpec:
    try:
        meta = json.loads(meta_file.read_bytes().decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise BatonError("malformed meta.json: not UTF-8 JSON", source=str(meta_file)) from None
    model = meta.get("model") if isinstance(meta, dict) else None
    if not isinstance(model, dict):
        raise BatonError("has no model", source=str(meta_file), field="model")
    known = {f.name for f in dataclasses.fields(ModelSpec)}
    return from_mapping({k: v for k, v in model.items() if k in known}, source=f"{meta_file}: model")


def open_checkpoint(path: str | Path) -> tuple[CheckpointReader, ModelSpec]:
    """The checkpoint at ``path`` (a step directory, or a save directory: its newest intact checkpoint),
    verified against its checksums, and the model it holds."""
    p = Path(path)
    if (p / "meta.json").is_file():
        spec = _spec_of(p / "meta.json")
        reader = CheckpointReader(p, spec)
        verify_files(p, reader.meta)
        return reader, spec
    found = checkpoints(p)
    if not found:
        raise BatonError("not a checkpoint (no meta.json) nor a directory of checkpoints", source=str(p), field="CHECKPOINT")
    spec = _spec_of(found[-1] / "meta.json")
    ckpt, _, _ = find_resumable(p, spec)
    return CheckpointReader(ckpt, spec), spec


def full_tensors(reader: CheckpointReader, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Every parameter of the checkpoint as a full fp32 tensor, under ``runtime.model.gpt`` names."""
    return {name: reader.parameter(name).float() for name in parameter_shapes(spec)}


def gpt2_config(spec: ModelSpec, *, eot_id: int | None = None) -> dict:
    """A ``transformers`` GPT-2 config describing exactly ``runtime.model.gpt.GPT`` of ``spec``."""
    p = float(spec.dropout)
    cfg = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": spec.vocab_size, "n_positions": spec.seq_len, "n_embd": spec.hidden_dim, "n_layer": spec.num_layers,
        "n_head": spec.num_heads, "n_inner": spec.ffn_dim, "activation_function": "gelu_new",
        "layer_norm_epsilon": LN_EPS, "initializer_range": 0.02,
        # Baton's GPT drops out on both residual branches and (eager attention only) the attention
        # probabilities, never on the embeddings.
        "resid_pdrop": p, "attn_pdrop": p if spec.attention == "eager" else 0.0, "embd_pdrop": 0.0,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True, "use_cache": True, "torch_dtype": "float32",
    }
    # Stated even when None: transformers otherwise assumes GPT-2's 50256, outside a small vocabulary.
    cfg.update(bos_token_id=eot_id, eos_token_id=eot_id)
    return cfg


def gpt2_state(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``runtime.model.gpt`` tensors under GPT2LMHeadModel's names and layouts (the tied head is not stored)."""
    out = {}
    for name, t in full.items():
        if name.endswith(TRANSPOSED):
            t = t.t()
        out[f"transformer.{name}"] = t.contiguous()
    return out


def llama_config(spec: ModelSpec, *, eot_id: int | None = None) -> dict:
    """A ``transformers`` Llama config describing exactly ``runtime.model.llama.Llama`` of ``spec``."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_dim, "intermediate_size": spec.ffn_dim,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim, "max_position_embeddings": spec.seq_len, "hidden_act": "silu",
        "rms_norm_eps": spec.norm_eps, "rope_theta": spec.rope_theta, "rope_scaling": None,
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "tie_word_embeddings": spec.tie_embeddings, "use_cache": True, "torch_dtype": "float32",
        "bos_token_id": eot_id, "eos_token_id": eot_id,
    }


def llama_state(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``runtime.model.llama`` tensors under LlamaForCausalLM's names (a tied head is not stored)."""
    return {llama_name(name): t.contiguous() for name, t in full.items()}


def data_tokenizer(meta: dict) -> tuple[Path | None, str]:
    """(tokenizer.json of the data the checkpoint was trained on, or None; why not / where from)."""
    from runtime.data.source import TokenDataset
    from runtime.data.tokens import is_dataset_dir

    data = meta.get("data") if isinstance(meta.get("data"), dict) else {}
    path = data.get("path")
    if path is None:
        return None, "the checkpoint was trained on synthetic tokens"
    if not Path(path).exists():
        return None, f"its data '{path}' is not found from here"
    if is_dataset_dir(path):
        f = TokenDataset(path).tokenizer_file
        return (f, f"the tokenizer of '{path}'") if f else (None, f"'{path}' has no tokenizer.json")
    return None, f"the checkpoint was trained on the bytes of '{path}'"


def trained_on_bytes(meta: dict, spec: ModelSpec) -> bool:
    """Whether ``--data`` was a plain file, read as bytes (token id = byte value)."""
    data = meta.get("data") if isinstance(meta.get("data"), dict) else {}
    return data.get("path") is not None and "bytes" in data and spec.vocab_size >= 256


def export_hf(reader: CheckpointReader, spec: ModelSpec, out: str | Path, *, tokenizer: str | Path | None = None) -> list[str]:
    """Write the Hugging Face GPT-2 or Llama directory ``out`` (atomically: all of it or nothing); returns what
    was written about the tokenizer (one line for the user).

    ``tokenizer``: a tokenizer.json or directory to ship; by default the data's own tokenizer (a prepared
    dataset's, or the byte-level one when the data was a file read as bytes)."""
    from runtime.train.checkpoint import write_dir_atomically
    from runtime.data.tokens import byte_tokenizer, find_eot, load_tokenizer, vocab_size_of, write_tokenizer

    out = Path(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "config.json").is_file())):
        raise BatonError("exists and is not a Hugging Face model directory: choose another directory", source=str(out), field="DIR")
    tok, note = None, ""
    if tokenizer is not None:
        tok, note = load_tokenizer(tokenizer), f"tokenizer from {tokenizer}"
    else:
        found, why = data_tokenizer(reader.meta)
        if found is not None:
            tok, note = load_tokenizer(found), f"tokenizer: {why}"
        elif trained_on_bytes(reader.meta, spec):
            tok, note = byte_tokenizer(), "tokenizer: byte-level (token id = byte value), as the data was read"
        else:
            note = f"no tokenizer written: {why} (pass --tokenizer)"
    if tok is not None and vocab_size_of(tok) > spec.vocab_size:
        raise BatonError(f"the tokenizer has {vocab_size_of(tok)} tokens, more than the model's {spec.vocab_size}",
                         field="--tokenizer")
    eot = find_eot(tok) if tok is not None else None
    full = full_tensors(reader, spec)
    eot_id = None if eot is None else eot[1]
    if spec.llama:
        state, config = llama_state(full), llama_config(spec, eot_id=eot_id)
    else:
        state, config = gpt2_state(full), gpt2_config(spec, eot_id=eot_id)

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(
            {k: config[k] for k in ("bos_token_id", "eos_token_id")}, indent=2) + "\n")
        if tok is not None:
            write_tokenizer(tok, eot, tmp)

    write_dir_atomically(out, write)
    return [note]
