"""``baton data prepare`` and the token dataset the runtime reads (runtime/data/tokens.py, runtime/data/source.py).

Corpora are a few kilobytes of seeded random words written by the tests."""
from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch

from baton.errors import BatonError
from baton.model_spec import PRESETS
from runtime.data.source import (TokenDataset, TokenSource, ValidationSource, check_data_file, data_fingerprint, model_validation_loss,
                          open_dataset, validation_loss)
from runtime.data.tokens import TokenizerChoice, load_tokenizer, prepare, token_dtype
from tests.conftest import run_cli

WORDS = "the quick brown fox jumps over a lazy dog while baton plans uneven pipeline stages on mixed gpus".split()


def corpus(tmp_path, *, lines=300, seed=0):
    """A text file, a JSONL file and a directory holding copies of both."""
    rng = random.Random(seed)
    text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(lines)) + "\n"
    (tmp_path / "a.txt").write_text(text)
    with open(tmp_path / "b.jsonl", "w") as fh:
        for _ in range(lines // 3):
            fh.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(25)), "id": 1}) + "\n\n")
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    (d / "one.txt").write_text(text)
    (d / "sub" / "two.jsonl").write_text((tmp_path / "b.jsonl").read_text())
    (d / ".hidden.txt").write_text("never read")
    (d / "image.png").write_bytes(b"\x89PNG never read")
    return tmp_path


def small(**changes):
    return PRESETS["tiny"].with_overrides(dropout=0.0, **changes)


def test_trained_bpe_dataset_holds_the_corpus_and_a_tail_validation_split(tmp_path):
    """Catches a split that loses or duplicates tokens, tokens that do not decode to the corpus, a missing
    end-of-text token between documents, and a meta.json whose counts or hashes disagree with the files."""
    corpus(tmp_path)
    meta = prepare([tmp_path / "a.txt", tmp_path / "b.jsonl"], tmp_path / "ds", TokenizerChoice(train_vocab_size=300),
                   val_fraction=0.1)
    ds = TokenDataset(tmp_path / "ds")
    train, val = ds.split("train"), ds.split("val")
    assert meta["dtype"] == "uint16" and train.dtype == np.uint16 and 257 <= ds.vocab_size <= 300
    total = len(train) + len(val)
    assert len(val) == round(total * 0.1) and meta["splits"]["train"]["tokens"] == len(train)
    tok = load_tokenizer(tmp_path / "ds")
    eot = meta["tokenizer"]["eot_id"]
    stream = np.concatenate([train, val]).astype(np.int64)
    assert int(stream.max()) < ds.vocab_size
    docs = [tok.decode(list(map(int, part))) for part in np.split(stream, np.flatnonzero(stream == eot))]
    docs = [d for d in docs if d]
    want = [(tmp_path / "a.txt").read_text()] + [json.loads(l)["text"] for l in (tmp_path / "b.jsonl").read_text().split("\n") if l]
    assert docs == want
    assert meta["read"] == {"files": 2, "documents": len(want), "bytes": (tmp_path / "a.txt").stat().st_size
                            + (tmp_path / "b.jsonl").stat().st_size}
    ds.verify()  # the recorded SHA-256 of each split is the file's


def test_directory_input_bytes_tokenizer_and_a_given_tokenizer_json(tmp_path):
    """A directory reads its text and JSONL files in sorted order, skipping hidden and other files; bytes
    give token id = byte value; a given tokenizer.json is used as is and copied into the dataset."""
    corpus(tmp_path)
    meta = prepare([tmp_path / "docs"], tmp_path / "bytes", TokenizerChoice(bytes=True), val_fraction=0.0)
    ds = TokenDataset(tmp_path / "bytes")
    one = (tmp_path / "docs" / "one.txt").read_bytes()
    assert meta["read"]["files"] == 2 and meta["tokenizer"]["eot_token"] is None and ds.vocab_size == 256
    assert bytes(ds.split("train")[: len(one)].tolist()) == one and ds.num_tokens("val") == 0
    prepare([tmp_path / "a.txt"], tmp_path / "bpe", TokenizerChoice(train_vocab_size=280))
    given = prepare([tmp_path / "docs"], tmp_path / "given", TokenizerChoice(path=tmp_path / "bpe" / "tokenizer.json"))
    assert given["tokenizer"]["kind"] == "huggingface" and given["vocab_size"] == 280
    assert (tmp_path / "given" / "tokenizer.json").read_text() == (tmp_path / "bpe" / "tokenizer.json").read_text()
    # the same corpus and tokenizer give the same tokens: the content hash is a fingerprint of the data
    again = prepare([tmp_path / "docs"], tmp_path / "given", TokenizerChoice(path=tmp_path / "bpe"))
    assert again["content_sha256"] == given["content_sha256"]


def test_prepare_command_line_and_its_one_line_errors(tmp_path):
    """The CLI writes the dataset and says what it holds; bad input is one line, exit 2, and no directory."""
    corpus(tmp_path)
    code, out, err = run_cli("data", "prepare", tmp_path / "a.txt", tmp_path / "b.jsonl", "--out", tmp_path / "ds",
                             "--train-tokenizer", "--vocab-size", 300)
    assert code == 0, err
    assert "train +" in out and "trained-bpe" in out and (tmp_path / "ds" / "train.bin").is_file()
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    cases = [
        (["data", "prepare", tmp_path / "bad.jsonl", "--out", tmp_path / "x", "--tokenizer", "bytes"], "line 2: no string field 'text'"),
        (["data", "prepare", tmp_path / "latin1.txt", "--out", tmp_path / "x", "--tokenizer", "bytes"], "not UTF-8"),
        (["data", "prepare", tmp_path / "a.txt", "--out", tmp_path / "x"], "choose one of"),
        (["data", "prepare", tmp_path / "a.txt", "--out", tmp_path / "x", "--train-tokenizer"], "--vocab-size"),
        (["data", "prepare", tmp_path / "a.txt", "--out", tmp_path / "x", "--train-tokenizer", "--vocab-size", 100], "257"),
        (["data", "prepare", tmp_path / "a.txt", "--out", tmp_path / "x", "--tokenizer", tmp_path / "nope.json"], "not found"),
        (["data", "prepare", tmp_path / "a.txt", "--out", tmp_path / "x", "--tokenizer", tmp_path / "a.txt"], "tokenizer.json"),
        (["data", "prepare", tmp_path / "a.txt", "--out", tmp_path / "mine", "--tokenizer", "bytes"], "not a token dataset"),
        (["data", "prepare", tmp_path / "a.txt", "--out", tmp_path / "x", "--tokenizer", "bytes", "--val-fraction", 1], "[0, 1)"),
        (["data", "prepare", tmp_path / "a.txt", "--out", tmp_path / "x", "--tokenizer", "bytes", "--eot", "<x>"], "end-of-text"),
    ]
    for args, needle in cases:
        code, out, err = run_cli(*args)
        assert code == 2, (args, out, err)
        assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (args, err)
        assert not (tmp_path / "x").exists()
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_vocabulary_and_size_checks_against_the_model(tmp_path):
    """A dataset whose tokenizer has more tokens than the model is refused with the numbers; a model with
    more tokens (a padded vocabulary) is fine; a truncated split is named."""
    corpus(tmp_path)
    prepare([tmp_path / "a.txt"], tmp_path / "ds", TokenizerChoice(train_vocab_size=300))
    with pytest.raises(BatonError, match="300 tokens, more than the model's vocab_size 256"):
        check_data_file(tmp_path / "ds", small())
    check_data_file(tmp_path / "ds", small(vocab_size=320))
    with pytest.raises(BatonError, match="fewer than seq_len"):
        open_dataset(tmp_path / "ds", small(vocab_size=320, seq_len=1 << 16))
    with open(tmp_path / "ds" / "train.bin", "r+b") as fh:
        fh.truncate(100)
    with pytest.raises(BatonError, match="train.bin has 100 bytes"):
        TokenSource(small(vocab_size=320), path=str(tmp_path / "ds"))
    (tmp_path / "ds" / "meta.json").write_text("{}")
    with pytest.raises(BatonError, match="unsupported token dataset format"):
        check_data_file(tmp_path / "ds", small(vocab_size=320))
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def test_token_id_files_are_not_read_as_text(tmp_path):
    """Catches --data silently training on the bytes of token ids: nanoGPT's uint16 train.bin, and one split
    of a prepared dataset given in place of its directory, are refused in one line naming the file; text
    with any non-NUL bytes (Latin-1 included) still trains as bytes."""
    nano = tmp_path / "train.bin"
    np.array([50256, 464, 13, 262, 1110] * 100, dtype=np.uint16).tofile(nano)
    with pytest.raises(BatonError, match="binary.*nanoGPT") as err:
        check_data_file(nano, small())
    assert err.value.source == str(nano)
    corpus(tmp_path)
    prepare([tmp_path / "a.txt"], tmp_path / "ds", TokenizerChoice(train_vocab_size=300))
    with pytest.raises(BatonError, match="give its directory"):
        check_data_file(tmp_path / "ds" / "train.bin", small(vocab_size=320))
    text = tmp_path / "latin.txt"
    text.write_bytes(("caf\xe9 " * 200).encode("latin-1"))
    check_data_file(text, small())


def test_batches_depend_on_seed_and_sample_only_so_a_resumed_run_sees_the_same_ones(tmp_path):
    """A run resumed at step 3 (under a plan with another global batch, as the checkpoint's sample count
    says) reads exactly the windows the uninterrupted run would have read from there on; every window
    is a slice of the train split, never of val."""
    corpus(tmp_path)
    prepare([tmp_path / "a.txt"], tmp_path / "ds", TokenizerChoice(train_vocab_size=300))
    spec = small(vocab_size=300)
    train = TokenDataset(tmp_path / "ds").split("train").astype(np.int64)
    whole = TokenSource(spec, path=str(tmp_path / "ds"), seed=7, global_batch=8)
    seen = [whole.batch(step, torch.arange(8)) for step in range(6)]
    for x, y in seen:
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row in torch.cat([x, y[:, -1:]], dim=1).numpy():
            starts = np.flatnonzero(train[: len(train) - spec.seq_len] == row[0])
            assert any((train[s: s + spec.seq_len + 1] == row).all() for s in starts)
    # resume after 3 steps of 8 samples under a plan whose global batch is 4: step 3 reads samples 24..27
    resumed = TokenSource(spec, path=str(tmp_path / "ds"), seed=7, global_batch=4, start_step=3, start_sample=24)
    for step, (lo, hi) in ((3, (0, 4)), (4, (4, 8))):
        x, _ = resumed.batch(step, torch.arange(4))
        assert torch.equal(x, seen[3][0][lo:hi])
    # how a step's samples are cut into micro-batches and replicas does not matter, the seed does
    parts = [whole.batch(2, torch.tensor(ks))[0] for ks in ([0, 1, 2], [3], [4, 5, 6, 7])]
    assert torch.equal(torch.cat(parts), seen[2][0])
    other = TokenSource(spec, path=str(tmp_path / "ds"), seed=8, global_batch=8)
    assert not torch.equal(other.batch(0, torch.arange(8))[0], seen[0][0])


def test_validation_windows_and_loss(tmp_path):
    """Validation reads the val split only, in fixed seed-free windows, and the loss is the mean over
    every window counted once (compared with a direct computation on the model)."""
    corpus(tmp_path, lines=600)
    prepare([tmp_path / "a.txt"], tmp_path / "ds", TokenizerChoice(train_vocab_size=300), val_fraction=0.2)
    spec = small(vocab_size=300)
    val = TokenDataset(tmp_path / "ds").split("val").astype(np.int64)
    source = ValidationSource(spec, tmp_path / "ds", global_batch=3, max_windows=7)
    assert source.num_windows == 7 and source.num_batches == 3
    windows = [val[j * source.stride: j * source.stride + spec.seq_len + 1] for j in range(7)]
    span = len(val) - (spec.seq_len + 1)
    assert 0 <= span - 6 * source.stride < 6 and all(len(w) == spec.seq_len + 1 for w in windows)  # spread to the end
    x, y = source.batch(2, torch.arange(3))  # the last batch wraps to window 0
    assert torch.equal(x[0], torch.from_numpy(windows[6][:-1])) and torch.equal(x[1], torch.from_numpy(windows[0][:-1]))
    from runtime.model.gpt import GPT

    model = GPT(spec, seed=3)
    got = model_validation_loss(model, source)
    with torch.no_grad():
        w = torch.from_numpy(np.stack(windows))
        want = model(w[:, :-1], w[:, 1:])[1].item()
    assert got == pytest.approx(want, rel=1e-5)
    calls = []
    validation_loss(lambda a, b: calls.append(len(a)) or 1.0, source)
    assert calls == [3, 3, 1]
    prepare([tmp_path / "a.txt"], tmp_path / "noval", TokenizerChoice(train_vocab_size=300), val_fraction=0.0)
    with pytest.raises(BatonError, match="the val split has 0 tokens"):
        ValidationSource(spec, tmp_path / "noval", global_batch=2)


def test_fingerprint_of_a_dataset_is_its_content_hash(tmp_path):
    """A checkpoint records the dataset by content: the same tokens elsewhere match, other tokens do not."""
    corpus(tmp_path)
    a = prepare([tmp_path / "a.txt"], tmp_path / "one", TokenizerChoice(bytes=True))
    prepare([tmp_path / "a.txt"], tmp_path / "two", TokenizerChoice(bytes=True))
    prepare([tmp_path / "b.jsonl"], tmp_path / "three", TokenizerChoice(bytes=True))
    f1, f2, f3 = (data_fingerprint(tmp_path / n) for n in ("one", "two", "three"))
    assert f1["fingerprint"] == f2["fingerprint"] == a["content_sha256"] != f3["fingerprint"]
    assert data_fingerprint(None) == {"path": None}
    assert data_fingerprint(tmp_path / "a.txt")["bytes"] == (tmp_path / "a.txt").stat().st_size


@pytest.mark.long  # three runs; resuming under another plan and a dataset's batches per sample are checked quick elsewhere
def test_train_reads_a_dataset_directory_and_resumes_under_another_plan(tmp_path):
    """End to end through `baton train --data DIR`: the resumed run (another plan) continues with the
    uninterrupted run's losses and weights, so it saw the same batches."""
    from baton.plan import save_plan
    from tests.runtime_helpers import plan_of

    corpus(tmp_path)
    prepare([tmp_path / "a.txt"], tmp_path / "ds", TokenizerChoice(bytes=True))
    spec = small()
    save_plan(plan_of(spec, [[1], [1]], [2, 2], 1, m=2, mbs=2), tmp_path / "pp.json")
    save_plan(plan_of(spec, [[1, 1]], [4], 2, m=2, mbs=2), tmp_path / "tp.json")
    losses = {}
    for name, runs in (("whole", [("pp.json", 4)]), ("resumed", [("pp.json", 2), ("tp.json", 4)])):
        for plan, steps in runs:
            code, out, err = run_cli("train", "--plan", tmp_path / plan, "--steps", steps, "--data", tmp_path / "ds",
                                     "--save-dir", tmp_path / name, "--timeout", 60, *(["--resume"] if steps == 4 and name == "resumed" else []))
            assert code == 0, err
        losses[name] = re.search(r"step 4: loss ([0-9.]+)", out).group(1)
    assert losses["whole"] == losses["resumed"]
    # the weights after step 4 agree too (other batches at step 3 or 4 would move them apart)
    from safetensors.torch import load_file

    whole, resumed = (load_file(str(tmp_path / n / "step-000004" / "model.safetensors")) for n in ("whole", "resumed"))
    assert all(torch.allclose(whole[k], resumed[k], atol=1e-5) for k in whole)
    assert json.loads((tmp_path / "resumed" / "step-000004" / "meta.json").read_text())["data"]["kind"] == "tokens"
