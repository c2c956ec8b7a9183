"""Text to token files: tokenizers, corpus reading, and the prepared-dataset directory.

A prepared dataset is a directory in the format of the nanoGPT family (flat token arrays, one per
split, plus a little metadata):

* ``train.bin``, ``val.bin``: token ids as a flat little-endian array, ``uint16`` when the vocabulary
  has at most 65,536 tokens, else ``uint32`` (``np.memmap(path, dtype)`` reads them);
* ``meta.json``: ``format``, ``dtype``, ``vocab_size``, the tokenizer (kind, file, end-of-text token),
  per split its file, token count and SHA-256, a ``content_sha256`` over both (what identifies the data
  in a checkpoint), and what was read (files, documents, bytes);
* ``tokenizer.json`` and ``tokenizer_config.json``: the tokenizer in the Hugging Face ``tokenizers``
  format, so the directory decodes its own tokens (and ``baton export`` can ship it with a model).

Tokenizers: a Hugging Face ``tokenizer.json`` (or a directory holding one, or GPT-2's older
``vocab.json`` + ``merges.txt``), loaded offline; a byte-level BPE trained on the corpus; or plain bytes
(token id = byte value, vocabulary 256). Every document is followed by the end-of-text token when the
tokenizer has one. The validation split is the last ``val_fraction`` of the token stream (as nanoGPT's
character-level Shakespeare): exact in size, the same for any tokenizer, and one pass over the corpus.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from baton.errors import BatonError

FORMAT = "baton-tokens/1"
TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst")
JSONL_SUFFIXES = (".jsonl",)
EOT_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eos|>")
"""End-of-text tokens looked for, in this order, in a tokenizer the user gives."""
TRAINED_EOT = "<|endoftext|>"
MIN_TRAINED_VOCAB = 257
"""A trained byte-level BPE starts from the 256 bytes and the end-of-text token."""
MAX_VOCAB = 1 << 22
"""The largest vocabulary a model may have (docs/errors.md, "Upper bounds")."""
CHUNK_CHARS = 1 << 22
"""Long text files are read in pieces of about this many characters (cut at a line end)."""
BATCH_CHARS = 1 << 23
"""Characters handed to the tokenizer at once (it encodes a batch on all cores)."""


# --- tokenizers ------------------------------------------------------------------------------------


def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters, which the ByteLevel pre-tokenizer applies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer():
    """Token id = byte value (vocabulary 256, no end-of-text token): ``--data file.txt``'s reading as a
    tokenizer, so byte-level models can be exported and sampled like any other."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _byte_to_char().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def load_tokenizer(path: str | Path, *, field: str = "--tokenizer"):
    """A Hugging Face tokenizer from ``tokenizer.json``, a directory holding one, or a directory with
    GPT-2's ``vocab.json`` + ``merges.txt``; read from disk only."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if file.is_file():
        try:
            return Tokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises plain Exceptions for malformed files
            raise BatonError(f"not a Hugging Face tokenizer.json: {str(exc).splitlines()[0][:200]}", source=str(file),
                             field=field) from None
    if p.is_dir() and (p / "vocab.json").is_file() and (p / "merges.txt").is_file():
        try:
            model = models.BPE.from_file(str(p / "vocab.json"), str(p / "merges.txt"))
        except Exception as exc:
            raise BatonError(f"unreadable vocab.json / merges.txt: {str(exc).splitlines()[0][:200]}", source=str(p),
                             field=field) from None
        tok = Tokenizer(model)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return tok
    what = "has no tokenizer.json (nor vocab.json + merges.txt)" if p.is_dir() else "file not found"
    raise BatonError(what, source=str(p), field=field)


def train_bpe(texts: Iterator[str], vocab_size: int):
    """A byte-level BPE (GPT-2's design) with ``vocab_size`` tokens at most, learnt from ``texts``;
    the end-of-text token is id 0. Fewer tokens result when the corpus has fewer distinct merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[TRAINED_EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def find_eot(tok, requested: str | None = None) -> tuple[str, int] | None:
    """(token, id) of the tokenizer's end-of-text token: ``requested`` (an error if absent), else the
    first of ``EOT_CANDIDATES`` it has, else None."""
    if requested is not None:
        tid = tok.token_to_id(requested)
        if tid is None:
            raise BatonError(f"the tokenizer has no token {requested!r}", field="--eot")
        return requested, tid
    for cand in EOT_CANDIDATES:
        tid = tok.token_to_id(cand)
        if tid is not None:
            return cand, tid
    return None


def vocab_size_of(tok) -> int:
    """Ids run from 0 to this minus one (added tokens included)."""
    return tok.get_vocab_size(with_added_tokens=True)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (the nanoGPT convention), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


# --- reading the corpus ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Piece:
    """A piece of text; ``ends_document`` when the end-of-text token follows it."""

    text: str
    ends_document: bool
    bytes_read: int
    """Input bytes this piece accounts for (for the progress bar)."""


def input_files(inputs: list[Path]) -> list[Path]:
    """The files to read, in a fixed order: each given file, and every text or JSONL file under each given
    directory (sorted; hidden ones skipped)."""
    files: list[Path] = []
    for p in inputs:
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES + JSONL_SUFFIXES
                           and not any(part.startswith(".") for part in f.relative_to(p).parts))
            if not found:
                raise BatonError(f"holds no {', '.join(TEXT_SUFFIXES + JSONL_SUFFIXES)} files", source=str(p), field="INPUT")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise BatonError("file not found", source=str(p), field="INPUT")
    return files


def _decode(raw: bytes, source: Path, offset: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BatonError(f"not UTF-8 text ({exc.reason} at byte {offset + exc.start})", source=str(source), field="INPUT") from None


def _text_file(path: Path) -> Iterator[Piece]:
    """One document, read in pieces cut after a newline (whole lines, whole UTF-8 characters)."""
    offset = 0
    with open(path, "rb") as fh:
        carry = b""
        while True:
            block = fh.read(CHUNK_CHARS)
            data = carry + block
            if not block:
                yield Piece(_decode(data, path, offset), True, len(data))
                return
            cut = data.rfind(b"\n") + 1
            if cut == 0:
                carry = data  # one very long line: keep reading until it ends
                continue
            yield Piece(_decode(data[:cut], path, offset), False, cut)
            offset += cut
            carry = data[cut:]


def _jsonl_file(path: Path, field: str) -> Iterator[Piece]:
    """One document per line: the string under ``field`` of each JSON object (blank lines skipped)."""
    with open(path, "rb") as fh:
        offset = 0
        for number, line in enumerate(fh, start=1):
            offset += len(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                why = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
                raise BatonError(f"line {number}: not JSON ({why})", source=str(path), field="INPUT") from None
            text = record.get(field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise BatonError(f"line {number}: no string field '{field}'", source=str(path), field="--text-field")
            yield Piece(text, True, len(line))


def read_corpus(files: list[Path], text_field: str = "text") -> Iterator[Piece]:
    """Every document of ``files`` in order: a text file is one document, a JSONL line is one."""
    for f in files:
        if f.suffix.lower() in JSONL_SUFFIXES:
            yield from _jsonl_file(f, text_field)
        else:
            yield from _text_file(f)


# --- preparing a dataset ---------------------------------------------------------------------------


def _sha256_region(path: Path, start: int, length: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        fh.seek(start)
        left = length
        while left:
            block = fh.read(min(left, 1 << 22))
            if not block:
                break
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def content_sha256(dtype: str, split_hashes: dict[str, str]) -> str:
    """What identifies a dataset's tokens: its dtype and the hash of each split, in split order."""
    h = hashlib.sha256(dtype.encode())
    for name in sorted(split_hashes):
        h.update(f"{name}:{split_hashes[name]}".encode())
    return h.hexdigest()


def _tokenizer_config(eot: tuple[str, int] | None) -> dict:
    """What ``transformers.AutoTokenizer`` needs beside tokenizer.json."""
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    if eot is not None:
        cfg.update(bos_token=eot[0], eos_token=eot[0], unk_token=eot[0])
    return cfg


def write_tokenizer(tok, eot: tuple[str, int] | None, directory: Path) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``."""
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(eot), indent=2) + "\n")


def encode_corpus(pieces: Iterator[Piece], tok, eot_id: int | None, out, dtype: np.dtype,
                  on_progress: Callable[[int], None] | None = None) -> int:
    """Tokenise ``pieces`` into the open binary file ``out`` (ids as ``dtype``); returns the token count."""
    count, batch, batch_chars = 0, [], 0
    limit = np.iinfo(dtype).max

    def flush() -> None:
        nonlocal count, batch, batch_chars
        if not batch:
            return
        encodings = tok.encode_batch([p.text for p in batch], add_special_tokens=False)
        for piece, enc in zip(batch, encodings):
            ids = list(enc.ids) + ([eot_id] if piece.ends_document and eot_id is not None else [])
            arr = np.asarray(ids, dtype=np.int64)
            if arr.size and int(arr.max()) > limit:  # cannot happen with a consistent tokenizer; never wrap silently
                raise BatonError(f"token id {int(arr.max())} does not fit {dtype.name}", field="--tokenizer")
            arr.astype(dtype).tofile(out)
            count += arr.size
            if on_progress is not None:
                on_progress(piece.bytes_read)
        batch, batch_chars = [], 0

    for piece in pieces:
        batch.append(piece)
        batch_chars += len(piece.text)
        if batch_chars >= BATCH_CHARS:
            flush()
    flush()
    return count


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenizerChoice:
    """Which tokenizer ``prepare`` uses: exactly one of the fields is set."""

    path: Path | None = None
    """A Hugging Face tokenizer.json or directory."""
    train_vocab_size: int | None = None
    """Train a byte-level BPE of this many tokens on the corpus."""
    bytes: bool = False
    """Token id = byte value."""


def prepare(inputs: list[Path], out: Path, choice: TokenizerChoice, *, val_fraction: float = 0.05, text_field: str = "text",
            eot: str | None = None, on_phase: Callable[[str, int], None] | None = None,
            on_progress: Callable[[int], None] | None = None) -> dict:
    """Tokenise ``inputs`` into the dataset directory ``out`` (written atomically: a failure leaves no
    half-written directory, and an older dataset there is replaced only at the end); returns its meta.

    ``on_phase(name, total_bytes)`` announces each pass over the corpus ('train tokenizer', 'tokenize');
    ``on_progress(bytes)`` reports the bytes consumed since the last call."""
    from runtime.train.checkpoint import write_dir_atomically

    if not 0.0 <= val_fraction < 1.0:
        raise BatonError(f"must be in [0, 1), got {val_fraction!r}", field="--val-fraction")
    check_output_dir(out)
    files = input_files(inputs)
    total_bytes = sum(f.stat().st_size for f in files)
    phase = on_phase or (lambda name, total: None)
    if choice.bytes:
        tok, kind, source = byte_tokenizer(), "bytes", None
    elif choice.path is not None:
        tok, kind, source = load_tokenizer(choice.path), "huggingface", str(choice.path)
    else:
        n = choice.train_vocab_size
        if n is None or not MIN_TRAINED_VOCAB <= n <= MAX_VOCAB:
            raise BatonError(f"must be in {MIN_TRAINED_VOCAB}..{MAX_VOCAB} (256 bytes + end-of-text at least), got {n}",
                             field="--vocab-size")
        phase("train tokenizer", total_bytes)

        def texts() -> Iterator[str]:
            for piece in read_corpus(files, text_field):
                if on_progress is not None:
                    on_progress(piece.bytes_read)
                yield piece.text

        tok, kind, source = train_bpe(texts(), n), "trained-bpe", None
    eot_tok = None if kind == "bytes" else find_eot(tok, eot)
    if kind == "bytes" and eot is not None:
        raise BatonError("byte-level tokens have no end-of-text token", field="--eot")
    vocab = vocab_size_of(tok)
    if vocab > MAX_VOCAB:
        raise BatonError(f"the tokenizer has {vocab} tokens, more than {MAX_VOCAB}", field="--tokenizer")
    dtype = token_dtype(vocab)
    meta: dict = {}

    def write(tmp: Path) -> None:
        phase("tokenize", total_bytes)
        train_file, val_file = tmp / "train.bin", tmp / "val.bin"
        documents = 0

        def counted() -> Iterator[Piece]:
            nonlocal documents
            for piece in read_corpus(files, text_field):
                documents += piece.ends_document
                yield piece

        with open(train_file, "wb") as fh:
            total = encode_corpus(counted(), tok, None if eot_tok is None else eot_tok[1], fh, dtype, on_progress)
        n_val = int(round(total * val_fraction))
        n_train = total - n_val
        if n_train < 2:
            raise BatonError(f"the corpus gives {total} tokens, too few to train on", source=str(inputs[0]), field="INPUT")
        # The stream was written whole into train.bin: move its tail into val.bin and cut it off.
        with open(train_file, "r+b") as src, open(val_file, "wb") as dst:
            src.seek(n_train * dtype.itemsize)
            while block := src.read(1 << 22):
                dst.write(block)
            src.truncate(n_train * dtype.itemsize)
        hashes = {"train": _sha256_region(train_file, 0, n_train * dtype.itemsize),
                  "val": _sha256_region(val_file, 0, n_val * dtype.itemsize)}
        write_tokenizer(tok, eot_tok, tmp)  # every dataset decodes its own tokens, bytes included
        meta.update({
            "format": FORMAT, "dtype": dtype.name, "vocab_size": vocab,
            "tokenizer": {"kind": kind, "source": source, "file": "tokenizer.json",
                          "eot_token": None if eot_tok is None else eot_tok[0],
                          "eot_id": None if eot_tok is None else eot_tok[1]},
            "splits": {"train": {"file": "train.bin", "tokens": n_train, "sha256": hashes["train"]},
                       "val": {"file": "val.bin", "tokens": n_val, "sha256": hashes["val"]}},
            "content_sha256": content_sha256(dtype.name, hashes),
            "val_fraction": val_fraction,
            "read": {"files": len(files), "documents": documents, "bytes": total_bytes},
        })
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")

    write_dir_atomically(out, write)
    return meta


def check_output_dir(out: Path) -> None:
    """``out`` may be created, or replaced when it is an earlier dataset; any other existing path is
    refused (a typo must not replace a directory of the user's)."""
    from baton.cli_support import check_writable_dir

    if out.exists():
        if not out.is_dir():
            raise BatonError("exists and is not a directory", source=str(out), field="--out")
        if any(out.iterdir()) and not _is_dataset(out):
            raise BatonError("exists and is not a token dataset (no meta.json of ours): choose another --out", source=str(out),
                             field="--out")
    check_writable_dir(out.parent if not out.exists() else out, "--out")


def _is_dataset(path: Path) -> bool:
    try:
        return json.loads((path / "meta.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def is_dataset_dir(path: str | Path) -> bool:
    """Whether ``path`` is a directory written by ``prepare``."""
    p = Path(path)
    return p.is_dir() and _is_dataset(p)
