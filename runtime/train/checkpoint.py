"""Checkpoints that do not depend on the plan: full tensors, so a run can resume under any plan.

A checkpoint is a directory ``<save-dir>/step-000123/`` holding

* ``model.safetensors``: every parameter as a full fp32 tensor under its ``runtime.model.gpt`` name (in
  fp16/bf16 training, the fp32 master weights: a checkpoint loses no precision and resumes under any
  dtype);
* ``optimizer.safetensors``: ``exp_avg.<name>`` and ``exp_avg_sq.<name>`` (AdamW moments, full tensors);
* ``meta.json``: format, model spec, step, samples consumed, seed, optimizer settings (learning-rate
  schedule, gradient clipping and weight decay among them), the fp16 loss
  scale (``loss_scale``: scale, clean steps, skipped steps; fp16 runs only), data source, and the size
  and SHA-256 of every other file (``files``).

Rank 0 gathers the state point-to-point from the ranks that keep it (``runtime.train.replica_sync``: every
peer group's first holder, or with ``zero_stage`` 1-3 each owner of a shard, at 2 and 3 of each unit group;
at 3 the weights come from the owners' weight shards; any split sizes, gloo or NCCL), writes into a temporary
directory beside the final one and renames it, so a partly written checkpoint never has the final name.
Loading uses safetensors and JSON only (no pickle); every rank reads the slices it needs (with
``zero_stage`` 1, the moments of its owned shards only). Nothing in a checkpoint depends on the plan: a run
saved under one sharding stage, replica shapes and batch split resumes under any other, and a device that keeps its
optimizer state in host memory (``offload_optimizer``) saves and restores it there, the same full tensors.

Resuming picks the newest checkpoint whose files match their checksums (``find_resumable``) and says
which newer ones it skipped and why: a checkpoint damaged on disk costs the steps since the previous
one, not the run. Temporary directories of writers that died (``.tmp-step-*``) are removed.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from baton.errors import BatonError
from baton.model_spec import ModelSpec
from runtime.model.family import parameter_shapes
from runtime.launch.processes import pid_alive
from runtime.parallel.slicing import parameter_slice, put_slice, take_slice

FORMAT = "baton-checkpoint/1"
ARCHITECTURE = ("num_layers", "hidden_dim", "num_heads", "ffn_dim", "seq_len", "vocab_size", "architecture", "num_kv_heads",
                "tie_embeddings")
_ARCHITECTURE_DEFAULTS = {"architecture": "gpt", "num_kv_heads": None, "tie_embeddings": True}
"""What a checkpoint written before Llama existed says by leaving the field out."""
TENSOR_FILES = ("model.safetensors", "optimizer.safetensors")
_STEP_DIR = re.compile(r"step-[0-9]{6,}")
_TMP_DIR = re.compile(r"\.(tmp|old)-step-[0-9]+-([0-9]+)-")


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def checkpoints(save_dir: str | Path) -> list[Path]:
    """Checkpoint directories (``step-XXXXXX`` with a meta.json) in ``save_dir``, oldest step first."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.fullmatch(p.name) and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def latest_checkpoint(save_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step in ``save_dir`` (temporary directories ignored)."""
    found = checkpoints(save_dir)
    return found[-1] if found else None


def remove_stale_temporaries(save_dir: str | Path) -> list[Path]:
    """Remove ``.tmp-step-*`` / ``.old-step-*`` directories left by a writer that died mid-save (their
    names carry the writer's pid; those of a live writer stay). Returns what was removed."""
    root = Path(save_dir)
    removed = []
    if not root.is_dir():
        return removed
    for p in root.iterdir():
        if not p.name.startswith((".tmp-step-", ".old-step-")) or not p.is_dir():
            continue
        m = _TMP_DIR.match(p.name)
        if m is None or not pid_alive(int(m.group(2))) or int(m.group(2)) == os.getpid():
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify_files(path: str | Path, meta: dict) -> None:
    """Check every tensor file against the size and checksum in ``meta['files']``; raise a BatonError
    naming the first file that is missing, truncated or changed. Checkpoints written before checksums
    existed get a cheaper check: each file must open as safetensors."""
    path = Path(path)
    files = meta.get("files")
    if not isinstance(files, dict):
        for name in TENSOR_FILES:
            if not (path / name).is_file():
                raise BatonError(f"incomplete checkpoint: {name} is missing", source=str(path))
            try:
                with safe_open(str(path / name), framework="pt") as fh:
                    fh.keys()
            except Exception as exc:  # SafetensorError: truncated or not a safetensors file
                raise BatonError(f"corrupt checkpoint: {name}: {str(exc).splitlines()[0][:200]}", source=str(path)) from None
        return
    for name in TENSOR_FILES:
        if name not in files:
            raise BatonError(f"meta.json has no checksum for {name}", source=str(path))
    for name, want in files.items():
        f = path / str(name)
        if os.sep in str(name) or not f.is_file():
            raise BatonError(f"incomplete checkpoint: {name} is missing", source=str(path))
        if not isinstance(want, dict) or f.stat().st_size != want.get("bytes"):
            raise BatonError(f"corrupt checkpoint: {name} has {f.stat().st_size} bytes, meta.json recorded "
                             f"{want.get('bytes') if isinstance(want, dict) else '?'}", source=str(path))
        if sha256_of(f) != want.get("sha256"):
            raise BatonError(f"corrupt checkpoint: {name} does not match its SHA-256 in meta.json", source=str(path))


def find_resumable(save_dir: str | Path, spec: ModelSpec) -> tuple[Path, dict, list[str]]:
    """The newest intact checkpoint of ``spec`` in ``save_dir``: (path, meta, why each newer one was
    skipped). A checkpoint of another model is an error, not a reason to fall back."""
    found = checkpoints(save_dir)
    if not found:
        raise BatonError("no checkpoint to resume from", source=str(save_dir), field="--save-dir")
    skipped = []
    for path in reversed(found):
        try:
            meta = read_meta(path, spec)
            verify_files(path, meta)
        except BatonError as exc:
            if "another model" in exc.message:
                raise
            skipped.append(f"{path.name}: {exc.message}")
            continue
        return path, meta, skipped
    raise BatonError(f"no intact checkpoint to resume from ({'; '.join(skipped[:3])})", source=str(save_dir), field="--save-dir")


def prune_checkpoints(save_dir: str | Path, keep: int) -> list[Path]:
    """Remove all but the ``keep`` newest checkpoints (0: keep all); returns what was removed."""
    if keep <= 0:
        return []
    old = checkpoints(save_dir)[:-keep]
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return old


def _describe(d: dict) -> str:
    return ", ".join(f"{k}={d.get(k)}" for k in ARCHITECTURE)


def read_meta(path: str | Path, spec: ModelSpec) -> dict:
    """Parse ``meta.json`` and refuse a checkpoint of another model (one line)."""
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise BatonError("not a checkpoint directory (no meta.json)", source=str(path))
    try:
        meta = json.loads(meta_file.read_bytes().decode("utf-8"))
    except json.JSONDecodeError as exc:
        raise BatonError(f"malformed meta.json: {exc.msg}", source=str(meta_file)) from None
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise BatonError("malformed meta.json: not UTF-8 JSON", source=str(meta_file)) from None
    if not isinstance(meta, dict) or not isinstance(meta.get("model", {}), dict):
        raise BatonError("malformed meta.json: expected a JSON object", source=str(meta_file))
    if meta.get("format") != FORMAT:
        raise BatonError(f"unsupported checkpoint format {meta.get('format')!r} (expected '{FORMAT}')", source=str(meta_file))
    theirs, ours = meta.get("model", {}), spec.to_dict()
    if any(theirs.get(k, _ARCHITECTURE_DEFAULTS.get(k)) != ours[k] for k in ARCHITECTURE):
        raise BatonError(f"checkpoint is of another model ({theirs.get('name')}: {_describe(theirs)}); "
                         f"the plan trains {spec.name}: {_describe(ours)}", source=str(path))
    return meta


# --- saving ---------------------------------------------------------------------------------------


def _gather_full_state(engine) -> dict[str, torch.Tensor] | None:
    """Collective. On rank 0: parameter name -> (3, *full shape) fp32, the (master) weights and both
    AdamW moments (zeros before the first step); None on the other ranks.

    The state is read group by group (``baton.peers``' peer groups, ``runtime.train.replica_sync``), from the
    ranks that keep it: at stage 0 each group's first holder (all holders have the same), at stages 1-3
    each owner of a shard; only the pieces a group is the first to hold are read. Each region of a full
    tensor is assembled from the shards that cover it and written into place; ranks send point-to-point
    in the same order rank 0 receives, so any split sizes work on gloo and NCCL."""
    rank, spec, sync = dist.get_rank(), engine.plan.model, engine.sync
    full = {name: torch.zeros((3, *shape)) for name, shape in parameter_shapes(spec).items()} if rank == 0 else None
    for index, layout in enumerate(sync.layouts):
        owners = sync.state_owners(index)
        if rank != 0 and all(r != rank for r, _, _ in owners):
            continue
        for e in layout.entries:
            if not any(a < e.offset + e.numel and e.offset < b for a, b in layout.counted):
                continue  # a copy of pieces an earlier group holds (a TP rank's LayerNorms, the head's rows)
            region = torch.empty((3, e.numel)) if rank == 0 else None
            for r, lo, hi in owners:
                a, b = max(lo, e.offset), min(hi, e.offset + e.numel)
                if a >= b:
                    continue
                if r == rank:
                    part = engine.state_range(index, a, b)
                    if rank == 0:
                        region[:, a - e.offset:b - e.offset] = part.cpu()
                    else:
                        dist.send(part.contiguous(), 0)
                elif rank == 0:
                    part = torch.empty((3, b - a), device=engine.device)
                    dist.recv(part, r)
                    region[:, a - e.offset:b - e.offset] = part.cpu()
            if rank == 0:
                for k in range(3):
                    put_slice(full[e.name][k], region[k].view(e.shape), e.where)
    return full


def save_checkpoint(engine, save_dir: str | Path, *, step: int, samples_seen: int, extra: dict, keep: int = 0) -> Path:
    """Collective: every rank calls it. Rank 0 writes ``save_dir/step-XXXXXX`` atomically, then keeps
    only the ``keep`` newest checkpoints (0: all)."""
    rank, spec = dist.get_rank(), engine.plan.model
    full = _gather_full_state(engine)
    final = Path(save_dir) / checkpoint_name(step)
    if rank == 0:
        tensors = {name: t[0] for name, t in full.items()}
        moments = {f"{kind}.{name}": t[k] for name, t in full.items() for k, kind in ((1, "exp_avg"), (2, "exp_avg_sq"))}
        g = engine.optimizer_settings()
        # The schedule is a function of the step, so its settings (and the step) are its whole state.
        meta = {"format": FORMAT, "model": spec.to_dict(), "step": step, "samples_seen": samples_seen,
                "seed": engine.seed, "optimizer": {"name": "adamw", "step": engine.optimizer_steps(), "lr": g["lr"],
                                                   "betas": g["betas"], "eps": g["eps"],
                                                   "weight_decay": engine.weight_decay, "weight_decay_skips": "biases, LayerNorms",
                                                   "clip_grad": engine.clip_grad,
                                                   "schedule": engine.schedule.as_dict()}, **extra}
        if engine.precision.scaler is not None:
            meta["loss_scale"] = engine.precision.scaler.state_dict()

        def write(tmp: Path) -> None:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
            save_file({k: v.contiguous() for k, v in moments.items()}, str(tmp / "optimizer.safetensors"))
            # Hashed from disk after writing (the page cache makes this cheap): what resume checks is
            # exactly what was written.
            meta["files"] = {f: {"bytes": (tmp / f).stat().st_size, "sha256": sha256_of(tmp / f)} for f in TENSOR_FILES}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")

        remove_stale_temporaries(save_dir)
        write_dir_atomically(final, write)
        prune_checkpoints(save_dir, keep)
    dist.barrier()
    return final


def write_dir_atomically(final: Path, write) -> None:
    """Call ``write(tmp_dir)`` on a fresh temporary directory beside ``final``, then rename it to
    ``final`` (replacing an older one); on any failure nothing named ``final`` is left half written."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    # The pid in the name lets a later run tell a dead writer's leftover from a live writer's work.
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".tmp-{final.name}-{os.getpid()}-"))
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(tmp, 0o777 & ~umask)
        write(tmp)
        if final.exists():
            old = final.with_name(f".old-{final.name}-{os.getpid()}-")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# --- loading --------------------------------------------------------------------------------------


class CheckpointReader:
    """Full tensors of a checkpoint, read lazily (safetensors: no pickle)."""

    def __init__(self, path: str | Path, spec: ModelSpec):
        self.path, self.spec = Path(path), spec
        self.meta = read_meta(self.path, spec)
        for f in TENSOR_FILES:
            if not (self.path / f).is_file():
                raise BatonError(f"incomplete checkpoint: {f} is missing", source=str(self.path))

    def _open(self, file: str):
        try:
            return safe_open(str(self.path / file), framework="pt")
        except Exception as exc:  # SafetensorError: truncated or not a safetensors file
            raise BatonError(f"corrupt checkpoint: {file}: {exc}".splitlines()[0], source=str(self.path)) from None

    def _get(self, file: str, key: str) -> torch.Tensor:
        with self._open(file) as fh:
            if key not in fh.keys():
                raise BatonError(f"{file} has no tensor '{key}'", source=str(self.path))
            return self._finite(file, key, fh.get_tensor(key))

    def _finite(self, file: str, key: str, t: torch.Tensor) -> torch.Tensor:
        """Refuse NaN or Inf: a checkpoint written before checksums existed may carry them unnoticed,
        and training from them only produces NaN losses later."""
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise BatonError(f"corrupt checkpoint: {file}: tensor '{key}' holds NaN or Inf", source=str(self.path))
        return t

    def parameter(self, name: str) -> torch.Tensor:
        return self._get("model.safetensors", name)

    def load_into(self, engine) -> None:
        """Set this rank's parameters (and fp32 master weights), AdamW state and fp16 loss scale from the
        checkpoint's full tensors."""
        engine.load_full(self.parameter)
        scale = self.meta.get("loss_scale")
        if engine.precision.scaler is not None and isinstance(scale, dict):
            try:
                engine.precision.scaler.load_state_dict(scale)
            except (KeyError, TypeError, ValueError) as exc:
                raise BatonError(f"malformed loss_scale in meta.json: {exc}", source=str(self.path)) from None
        steps = int(self.meta.get("optimizer", {}).get("step", 0))
        file = "optimizer.safetensors"
        if engine.sharded:
            # Each rank reads the regions of its owned shards; one full tensor of each kind is kept at a time.
            if steps == 0:
                engine.precision.load_moments(None, 0)
                return
            with self._open(file) as fh:
                cache: dict = {}

                def full_of(kind: str, name: str) -> torch.Tensor:
                    if (kind, name) not in cache:
                        if len(cache) >= 2:
                            cache.clear()
                        key = f"{kind}.{name}"
                        cache[(kind, name)] = self._finite(file, key, fh.get_tensor(key))
                    return cache[(kind, name)]

                engine.precision.load_moments(full_of, steps)
            return
        if steps == 0:
            return
        # Where torch's own load_state_dict puts the step count: on the weights' device for the fused kernel, else
        # on the host.
        fused = bool(engine.optimizer.defaults.get("fused"))
        with self._open(file) as fh:
            for name, p in engine.master_parameters().items():
                where = parameter_slice(self.spec, name, engine.pos.heads, engine.pos.ffn_cols)
                engine.optimizer.state[p] = {
                    "step": torch.tensor(float(steps), dtype=torch.float32, device=p.device if fused else "cpu"),
                    "exp_avg": take_slice(self._finite(file, f"exp_avg.{name}", fh.get_tensor(f"exp_avg.{name}")), where)
                    .to(p.device).clone(),
                    "exp_avg_sq": take_slice(self._finite(file, f"exp_avg_sq.{name}", fh.get_tensor(f"exp_avg_sq.{name}")), where)
                    .to(p.device).clone(),
                }
