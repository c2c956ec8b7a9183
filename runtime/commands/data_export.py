"""``baton data prepare``, ``baton export`` and ``baton generate``: data into a run, models out of it.

The work lives in ``runtime.data.tokens`` (tokenizers, token files), ``runtime.model.hf_export`` (Hugging Face
directories) and ``runtime.model.generate`` (sampling); these are the command lines around them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from baton.cli_support import console, guarded, say
from baton.errors import BatonError

MAX_NEW_TOKENS = 1_000_000


def register(app: typer.Typer) -> None:
    data_app = typer.Typer(help="Prepare training data.", no_args_is_help=True)
    data_app.callback()(data_group)
    data_app.command("prepare")(guarded(prepare_cmd))
    app.add_typer(data_app, name="data")
    app.command("export")(guarded(export_cmd))
    app.command("generate")(guarded(generate_cmd))


def data_group() -> None:
    """Prepare training data: text into token files (``baton train --data DIR``)."""


def prepare_cmd(
    inputs: Annotated[list[Path], typer.Argument(help="Text files (.txt, .md), JSONL files (one document per line), or "
                                                     "directories of them.")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Dataset directory to write (train.bin, val.bin, meta.json, "
                                                            "tokenizer.json).")],
    tokenizer: Annotated[Optional[str], typer.Option(help="Hugging Face tokenizer.json or directory (read offline), or "
                                                          "'bytes' (token id = byte value).")] = None,
    train_tokenizer: Annotated[bool, typer.Option("--train-tokenizer", help="Train a byte-level BPE on the corpus.")] = False,
    vocab_size: Annotated[Optional[int], typer.Option(help="With --train-tokenizer: tokens of the BPE (at most).")] = None,
    val_fraction: Annotated[float, typer.Option(help="Share of the tokens (the end of the stream) kept for validation.")] = 0.05,
    text_field: Annotated[str, typer.Option(help="Field of each JSONL record holding its text.")] = "text",
    eot: Annotated[Optional[str], typer.Option(help="End-of-text token appended to every document (default: the "
                                                    "tokenizer's <|endoftext|>, </s> or <eos>).")] = None,
) -> None:
    """Tokenise text into the nanoGPT family's token files, with a validation split."""
    from runtime.data.tokens import TokenizerChoice, prepare

    if train_tokenizer == (tokenizer is not None):
        raise BatonError("choose one of --tokenizer (a Hugging Face tokenizer, or 'bytes') or --train-tokenizer",
                         field="--tokenizer")
    if vocab_size is not None and not train_tokenizer:
        raise BatonError("only with --train-tokenizer", field="--vocab-size")
    if train_tokenizer and vocab_size is None:
        raise BatonError("--train-tokenizer needs --vocab-size", field="--vocab-size")
    choice = TokenizerChoice(bytes=True) if tokenizer == "bytes" else \
        TokenizerChoice(path=Path(tokenizer)) if tokenizer is not None else TokenizerChoice(train_vocab_size=vocab_size)
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=console) as progress:
        tasks: dict[str, int] = {}

        def on_phase(name: str, total: int) -> None:
            tasks["now"] = progress.add_task(name, total=total)

        def on_progress(done: int) -> None:
            progress.advance(tasks["now"], done)

        meta = prepare(list(inputs), out, choice, val_fraction=val_fraction, text_field=text_field, eot=eot,
                       on_phase=on_phase, on_progress=on_progress)
    split = meta["splits"]
    tok = meta["tokenizer"]
    eot_note = f", documents end with {tok['eot_token']}" if tok["eot_token"] else ""
    say(f"wrote {out}: {split['train']['tokens']:,} train + {split['val']['tokens']:,} val tokens ({meta['dtype']}) from "
        f"{meta['read']['documents']:,} document(s) in {meta['read']['files']} file(s); vocabulary {meta['vocab_size']:,} "
        f"({tok['kind']}){eot_note}")


def export_cmd(
    checkpoint: Annotated[Path, typer.Argument(help="Checkpoint directory (step-XXXXXX), or a --save-dir (its newest "
                                                    "intact checkpoint).")],
    out: Annotated[Path, typer.Argument(help="Directory to write.")],
    to: Annotated[str, typer.Option("--to", help="Format: hf (a Hugging Face GPT-2 directory).")] = "hf",
    tokenizer: Annotated[Optional[Path], typer.Option(help="Tokenizer to ship (default: the one the data used).")] = None,
) -> None:
    """Write a checkpoint as a Hugging Face GPT-2 model (config.json, model.safetensors, tokenizer)."""
    from runtime.model.hf_export import export_hf, open_checkpoint

    if to != "hf":
        raise BatonError(f"unknown format {to!r} (expected hf)", field="--to")
    reader, spec = open_checkpoint(checkpoint)
    notes = export_hf(reader, spec, out, tokenizer=tokenizer)
    say(f"wrote {out}: GPT-2 '{spec.name}' ({spec.num_params() / 1e6:,.2f}M parameters) from {reader.path}; {notes[0]}")


def generate_cmd(
    checkpoint: Annotated[Path, typer.Argument(help="Checkpoint directory, or a --save-dir (its newest intact checkpoint).")],
    prompt: Annotated[str, typer.Option(help="Text to continue.")] = "\n",
    max_new_tokens: Annotated[int, typer.Option(help="Tokens to sample.")] = 100,
    temperature: Annotated[float, typer.Option(help="Softmax temperature; 0 takes the most likely token.")] = 0.8,
    top_k: Annotated[Optional[int], typer.Option(help="Sample among the k most likely tokens only.")] = 200,
    seed: Annotated[int, typer.Option(help="Seed of the draws (the same seed gives the same text).")] = 0,
    num_samples: Annotated[int, typer.Option(help="Independent samples (seeds seed, seed + 1, ...).")] = 1,
    tokenizer: Annotated[Optional[Path], typer.Option(help="Tokenizer (default: the one the data used).")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
) -> None:
    """Sample text from a checkpoint with the single-device model."""
    import math

    import torch

    from runtime.model.generate import sample
    from runtime.model.hf_export import data_tokenizer, full_tensors, open_checkpoint, trained_on_bytes
    from runtime.model.family import reference_model
    from runtime.data.tokens import byte_tokenizer, find_eot, load_tokenizer

    if not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise BatonError(f"must be in 1..{MAX_NEW_TOKENS}, got {max_new_tokens}", field="--max-new-tokens")
    if not (math.isfinite(temperature) and temperature >= 0.0):
        raise BatonError(f"must be a finite number >= 0, got {temperature!r}", field="--temperature")
    if top_k is not None and top_k < 1:
        raise BatonError(f"must be >= 1, got {top_k}", field="--top-k")
    if not 1 <= num_samples <= 1000:
        raise BatonError(f"must be in 1..1000, got {num_samples}", field="--num-samples")
    if not 0 <= seed < 2**63 - 1000:
        raise BatonError(f"must be in 0..2^63-1001, got {seed}", field="--seed")
    if device not in ("cpu", "cuda") or (device == "cuda" and not torch.cuda.is_available()):
        raise BatonError(f"'{device}' is not available here (expected cpu, or cuda on a machine with a GPU)", field="--device")
    reader, spec = open_checkpoint(checkpoint)
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    else:
        found, why = data_tokenizer(reader.meta)
        if found is not None:
            tok = load_tokenizer(found)
        elif trained_on_bytes(reader.meta, spec):
            tok = byte_tokenizer()
        else:
            raise BatonError(f"no tokenizer: {why}; pass --tokenizer", field="--tokenizer")
    eot = find_eot(tok)
    model = reference_model(spec).to(device)
    weights = full_tensors(reader, spec)
    model.load_full(weights.__getitem__)
    ids = tok.encode(prompt, add_special_tokens=False).ids
    for k in range(num_samples):
        out = sample(model, spec, ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                     seed=seed + k, stop_id=None if eot is None else eot[1])
        if num_samples > 1:
            say(f"--- sample {k + 1} (seed {seed + k})")
        say(tok.decode(out, skip_special_tokens=False))
