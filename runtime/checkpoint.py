"""Checkpoints that do not depend on the plan: full tensors, so a run can resume under any plan.

A checkpoint is a directory ``<save-dir>/step-000123/`` holding

* ``model.safetensors``: every parameter as a full tensor under its ``runtime.model`` name;
* ``optimizer.safetensors``: ``exp_avg.<name>`` and ``exp_avg_sq.<name>`` (AdamW moments, full tensors);
* ``meta.json``: format, model spec, step, samples consumed, seed, optimizer settings, data source.

Rank 0 gathers the slices point-to-point (any split sizes, gloo or NCCL), writes into a temporary
directory beside the final one and renames it, so a partly written checkpoint never has the final name.
Loading uses safetensors and JSON only (no pickle); every rank reads the slices it needs.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from baton.errors import BatonError
from baton.model_spec import ModelSpec
from runtime.model import parameter_shapes
from runtime.stage import parameter_slice, put_slice, take_slice

FORMAT = "baton-checkpoint/1"
ARCHITECTURE = ("num_layers", "hidden_dim", "num_heads", "ffn_dim", "seq_len", "vocab_size")


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def latest_checkpoint(save_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step in ``save_dir`` (temporary directories ignored)."""
    root = Path(save_dir)
    if not root.is_dir():
        return None
    found = sorted(p for p in root.glob("step-*") if (p / "meta.json").is_file())
    return found[-1] if found else None


def _describe(d: dict) -> str:
    return ", ".join(f"{k}={d.get(k)}" for k in ARCHITECTURE)


def read_meta(path: str | Path, spec: ModelSpec) -> dict:
    """Parse ``meta.json`` and refuse a checkpoint of another model (one line)."""
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise BatonError("not a checkpoint directory (no meta.json)", source=str(path))
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as exc:
        raise BatonError(f"malformed meta.json: {exc.msg}", source=str(meta_file)) from None
    if meta.get("format") != FORMAT:
        raise BatonError(f"unsupported checkpoint format {meta.get('format')!r} (expected '{FORMAT}')", source=str(meta_file))
    theirs, ours = meta.get("model", {}), spec.to_dict()
    if any(theirs.get(k) != ours[k] for k in ARCHITECTURE):
        raise BatonError(f"checkpoint is of another model ({theirs.get('name')}: {_describe(theirs)}); "
                         f"the plan trains {spec.name}: {_describe(ours)}", source=str(path))
    return meta


# --- saving ---------------------------------------------------------------------------------------


def _owners(engine, name: str) -> list[tuple[int, object]]:
    """(rank, slice) of the pipeline-0 ranks whose local tensors make up parameter ``name``."""
    topo, spec = engine.topo, engine.plan.model
    out = []
    for si, stage in enumerate(engine.plan.pipelines[0].stages):
        holds = (name.startswith("wte.") and si in (0, topo.num_stages - 1)) or \
                (name.startswith("wpe.") and si == 0) or \
                (name.startswith("ln_f.") and si == topo.num_stages - 1) or \
                (name.startswith("h.") and int(name.split(".")[1]) in stage.layers)
        if not holds:
            continue
        for r in topo.ranks[0][si]:
            pos = topo.position(r)
            where = parameter_slice(spec, name, pos.heads, pos.ffn_cols)
            out.append((r, where))
            if where is None:
                return out  # replicated: one copy is enough
    return out


def _local_shape(shape, where):
    if where is None:
        return tuple(shape)
    dim, pieces = where
    s = list(shape)
    s[dim] = sum(b - a for a, b in pieces)
    return tuple(s)


def _local_state(engine, name: str) -> torch.Tensor:
    """(3, *local shape): the parameter and its two AdamW moments (zeros before the first step)."""
    p = dict(engine.model.named_parameters())[name]
    st = engine.optimizer.state.get(p, {})
    m = st.get("exp_avg", torch.zeros_like(p))
    v = st.get("exp_avg_sq", torch.zeros_like(p))
    return torch.stack([p.detach(), m, v])


def _optimizer_step_count(engine) -> int:
    for st in engine.optimizer.state.values():
        if "step" in st:
            return int(st["step"])
    return 0


def save_checkpoint(engine, save_dir: str | Path, *, step: int, samples_seen: int, extra: dict) -> Path:
    """Collective: every rank calls it. Rank 0 writes ``save_dir/step-XXXXXX`` atomically."""
    rank, spec = dist.get_rank(), engine.plan.model
    tensors, moments = {}, {}
    for name, shape in parameter_shapes(spec).items():
        owners = _owners(engine, name)
        if rank == 0:
            full = torch.empty((3, *shape))
            for r, where in owners:
                if r == 0:
                    local = _local_state(engine, name)
                else:
                    local = torch.empty((3, *_local_shape(shape, where)), device=engine.device)
                    dist.recv(local, r)
                local = local.cpu()
                for k in range(3):
                    put_slice(full[k], local[k], where)
            tensors[name], moments[f"exp_avg.{name}"], moments[f"exp_avg_sq.{name}"] = full[0], full[1], full[2]
        elif any(r == rank for r, _ in owners):
            dist.send(_local_state(engine, name).contiguous(), 0)
    final = Path(save_dir) / checkpoint_name(step)
    if rank == 0:
        g = engine.optimizer.param_groups[0]
        meta = {"format": FORMAT, "model": spec.to_dict(), "step": step, "samples_seen": samples_seen,
                "seed": engine.seed, "optimizer": {"name": "adamw", "step": _optimizer_step_count(engine), "lr": g["lr"],
                                                   "betas": list(g["betas"]), "eps": g["eps"],
                                                   "weight_decay": g["weight_decay"]}, **extra}

        def write(tmp: Path) -> None:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
            save_file({k: v.contiguous() for k, v in moments.items()}, str(tmp / "optimizer.safetensors"))
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")

        write_dir_atomically(final, write)
    dist.barrier()
    return final


def write_dir_atomically(final: Path, write) -> None:
    """Call ``write(tmp_dir)`` on a fresh temporary directory beside ``final``, then rename it to
    ``final`` (replacing an older one); on any failure nothing named ``final`` is left half written."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".tmp-{final.name}-"))
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(tmp, 0o777 & ~umask)
        write(tmp)
        if final.exists():
            old = final.with_name(f".old-{final.name}-{os.getpid()}")
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
        for f in ("model.safetensors", "optimizer.safetensors"):
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
            return fh.get_tensor(key)

    def parameter(self, name: str) -> torch.Tensor:
        return self._get("model.safetensors", name)

    def load_into(self, engine) -> None:
        """Set this rank's parameters and AdamW state from the checkpoint's full tensors."""
        engine.model.load_full(self.parameter)
        steps = int(self.meta.get("optimizer", {}).get("step", 0))
        if steps == 0:
            return
        with self._open("optimizer.safetensors") as fh:
            for name, p in engine.model.named_parameters():
                where = parameter_slice(self.spec, name, engine.pos.heads, engine.pos.ffn_cols)
                engine.optimizer.state[p] = {
                    "step": torch.tensor(float(steps)),
                    "exp_avg": take_slice(fh.get_tensor(f"exp_avg.{name}"), where).to(p.device).clone(),
                    "exp_avg_sq": take_slice(fh.get_tensor(f"exp_avg_sq.{name}"), where).to(p.device).clone(),
                }
