"""The decoders Baton plans for (GPT-2's layer and Llama's): sizes, presets, and user-written YAML."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from baton.errors import BatonError
from baton.fields import Fields, excerpt

DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
TF32_MARK = "+tf32"
"""Appended to a model's name in its profile tables when its fp32 matmuls may use TF32."""
ATTENTION = ("eager", "fused")
DEFAULT_ATTENTION = "fused"
"""Attention implementations (baton/operators.py)."""
ARCHITECTURES = ("gpt", "llama")
"""Layer families (baton/operators.py): GPT-2's (LayerNorm, GELU MLP, learned positions, biases, tied head) and
Llama's (RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention, no biases, tied or untied head)."""

# Upper bounds of every size (documented in docs/errors.md, "Upper bounds"): far above any model trained today,
# low enough that no size makes a table, a plan search or a parameter count exhaust the machine.
LIMITS = {"num_layers": 1024, "hidden_dim": 65536, "num_heads": 1024, "ffn_dim": 262144, "seq_len": 1 << 20,
          "vocab_size": 1 << 22}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A pre-norm decoder: GPT-2's layer (learned positions, LayerNorm, GELU MLP, LM head tied to the token
    embedding) or Llama's (``architecture: llama``: rotary positions, RMSNorm, SwiGLU MLP, grouped-query
    attention, no biases, the head tied or not)."""

    name: str
    """Preset key or the user's label."""
    num_layers: int
    """Transformer layers."""
    hidden_dim: int
    """Model width h."""
    num_heads: int
    """Attention (query) heads a; the head dim is h / a."""
    ffn_dim: int
    """MLP inner width f (4h for GPT; the SwiGLU width for Llama: gate and up are h x f each)."""
    seq_len: int
    """Tokens per sample s."""
    vocab_size: int
    """Vocabulary V (rows of the tied embedding)."""
    dtype: str = "fp16"
    """Training precision of weights and activations: fp16, bf16 or fp32 (optimizer state is fp32)."""
    dropout: float = 0.1
    """Dropout probability on attention probabilities (eager attention only) and both residual branches."""
    attention: str = DEFAULT_ATTENTION
    """'eager' (scores, softmax, dropout, product with values as four operators, keeping the s x s
    matrices) or 'fused' (one flash-style kernel keeping q, k, v, its output and row statistics; no
    dropout on the attention probabilities). See baton/operators.py."""
    tf32: bool = False
    """Whether fp32 matmuls may run on TF32 tensor cores (Ampere and later): the runtime sets PyTorch's
    ``allow_tf32`` flags to it on CUDA, and derived tables follow it. False is PyTorch's default. Tables
    of the two settings never mix: see ``profile_name``."""
    architecture: str = "gpt"
    """'gpt' or 'llama' (``ARCHITECTURES``)."""
    num_kv_heads: int | None = None
    """Key/value heads of grouped-query attention (Llama only): each serves num_heads / num_kv_heads query
    heads; None (or num_heads) is plain multi-head attention. A tensor-parallel unit is one KV head with its
    query heads, so a layer has at most this many units."""
    rope_theta: float = 10000.0
    """Base of the rotary position frequencies (Llama only)."""
    norm_eps: float = 1e-5
    """Epsilon of the RMSNorms (Llama only; GPT's LayerNorms use 1e-5)."""
    tie_embeddings: bool = True
    """Whether the LM head is the token embedding (always for GPT; Llama 2/3 8B untie it, Llama 3.2 ties)."""

    @property
    def head_dim(self) -> int:
        return self.hidden_dim // self.num_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads (num_heads unless grouped-query attention says fewer)."""
        return self.num_kv_heads or self.num_heads

    @property
    def llama(self) -> bool:
        return self.architecture == "llama"

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def num_params(self) -> int:
        """Parameters, a tied embedding counted once (the unpadded vocabulary, as published counts are)."""
        h, f = self.hidden_dim, self.ffn_dim
        if self.llama:
            kv = self.kv_heads * self.head_dim
            per_layer = 2 * h + (h * h + 2 * h * kv) + h * h + 3 * h * f
            heads = 1 if self.tie_embeddings else 2
            return self.num_layers * per_layer + heads * self.vocab_size * h + h
        per_layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
        return self.num_layers * per_layer + self.vocab_size * h + self.seq_len * h + 2 * h

    def with_overrides(self, **changes) -> "ModelSpec":
        data = asdict(self)
        data.update({k: v for k, v in changes.items() if v is not None})
        return validate(ModelSpec(**data), source=f"model '{self.name}'")

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def profile_name(self) -> str:
        """The name its profile tables carry, in their file name and ``model`` column: the model's name,
        with ``+tf32`` when fp32 matmuls may use TF32, so a table of one setting is never found for the
        other (``split_profile_name`` reads it back)."""
        return f"{self.name}{TF32_MARK}" if self.tf32 else self.name


def validate(spec: ModelSpec, *, source: str) -> ModelSpec:
    """Check sizes are positive and consistent; return the spec unchanged."""
    for field in ("num_layers", "hidden_dim", "num_heads", "ffn_dim", "seq_len", "vocab_size"):
        value = getattr(spec, field)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise BatonError(f"must be a positive integer, got {excerpt(value)}", source=source, field=field)
        if value > LIMITS[field]:
            raise BatonError(f"must be <= {LIMITS[field]}, got {value}", source=source, field=field)
    if spec.hidden_dim % spec.num_heads:
        raise BatonError(
            f"hidden_dim {spec.hidden_dim} is not divisible by num_heads {spec.num_heads}", source=source, field="num_heads"
        )
    if spec.dtype not in DTYPE_BYTES:
        raise BatonError(f"unknown dtype {excerpt(spec.dtype)} (expected fp16, bf16 or fp32)", source=source, field="dtype")
    if spec.attention not in ATTENTION:
        raise BatonError(f"unknown attention {excerpt(spec.attention)} (expected {' or '.join(ATTENTION)})", source=source,
                         field="attention")
    if isinstance(spec.dropout, bool) or not isinstance(spec.dropout, (int, float)) or not 0.0 <= spec.dropout < 1.0:
        raise BatonError(f"must be in [0, 1), got {excerpt(spec.dropout)}", source=source, field="dropout")
    if not isinstance(spec.tf32, bool):
        raise BatonError(f"must be true or false, got {excerpt(spec.tf32)}", source=source, field="tf32")
    _validate_architecture(spec, source)
    # '+' is reserved for the marks of ``profile_name``: a model named 'x+tf32' would take x's TF32 tables.
    if not isinstance(spec.name, str) or not spec.name or len(spec.name) > 100 or any(c in spec.name for c in "/\\\0\n+"):
        raise BatonError(f"must be a short name without path separators or '+', got {excerpt(spec.name)}", source=source,
                         field="name")
    return spec


def _validate_architecture(spec: ModelSpec, source: str) -> None:
    if spec.architecture not in ARCHITECTURES:
        raise BatonError(f"unknown architecture {excerpt(spec.architecture)} (expected {' or '.join(ARCHITECTURES)})",
                         source=source, field="architecture")
    if not isinstance(spec.tie_embeddings, bool):
        raise BatonError(f"must be true or false, got {excerpt(spec.tie_embeddings)}", source=source, field="tie_embeddings")
    if not spec.llama:
        for field, default in (("num_kv_heads", None), ("tie_embeddings", True)):
            if getattr(spec, field) not in (default, spec.num_heads if field == "num_kv_heads" else default):
                raise BatonError(f"is a Llama setting: GPT's layer has {'as many KV heads as heads' if default is None else 'a tied head'} "
                                 "(set architecture: llama)", source=source, field=field)
        return
    kv = spec.num_kv_heads
    if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0 or spec.num_heads % kv):
        raise BatonError(f"must be a positive integer dividing num_heads {spec.num_heads}, got {excerpt(kv)}", source=source,
                         field="num_kv_heads")
    if spec.head_dim % 2:
        raise BatonError(f"head dim {spec.head_dim} is odd: rotary positions rotate pairs of channels", source=source, field="hidden_dim")
    for field in ("rope_theta", "norm_eps"):
        value = getattr(spec, field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1e12:
            raise BatonError(f"must be a positive number, got {excerpt(value)}", source=source, field=field)
    if spec.attention != "fused":
        raise BatonError("Llama layers run fused attention only (the eager operators are GPT's)", source=source, field="attention")


def split_profile_name(table_model: str) -> tuple[str, bool]:
    """(model name, tf32) of a profile table's ``model`` column: ``ModelSpec.profile_name`` read back."""
    if table_model.endswith(TF32_MARK):
        return table_model[: -len(TF32_MARK)], True
    return table_model, False


def splits_into(spec: ModelSpec, units: int) -> bool:
    """Whether a layer of ``spec`` can be cut into ``units`` units (the partition granularity U of a
    stage): each unit holds whole heads and as many FFN columns as every other, so U divides both the
    head count and the FFN width (docs/cost-model.md, symbol table). Under grouped-query attention a unit
    holds whole KV heads with their query heads, so U divides the KV head count."""
    return units >= 1 and spec.kv_heads % units == 0 and spec.ffn_dim % units == 0


def unit_counts(spec: ModelSpec) -> list[int]:
    """Every partition granularity a layer of ``spec`` allows, ascending."""
    return [u for u in range(1, spec.kv_heads + 1) if splits_into(spec, u)]


def _gpt(name, layers, hidden, heads, seq=2048, vocab=50257, ffn=None):
    return ModelSpec(
        name=name, num_layers=layers, hidden_dim=hidden, num_heads=heads,
        ffn_dim=ffn or 4 * hidden, seq_len=seq, vocab_size=vocab,
    )


def _llama(name, layers, hidden, heads, ffn, *, kv=None, seq=4096, vocab=32000, theta=10000.0, eps=1e-5, tied=False):
    return ModelSpec(
        name=name, num_layers=layers, hidden_dim=hidden, num_heads=heads, ffn_dim=ffn, seq_len=seq, vocab_size=vocab,
        dropout=0.0, architecture="llama", num_kv_heads=kv, rope_theta=theta, norm_eps=eps, tie_embeddings=tied,
    )


# GPT-3 family as in Brown et al. table 2.1 (1.3B as Megatron configures it: 24 x 2048, 16 heads).
# Llama entries are the published configs (Touvron et al. 2023; Meta's Llama 3 / 3.2 config.json), trained
# at 4k (Llama 2) and 8k (Llama 3, and 3.2 before its long-context stage) tokens.
PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        _gpt("gpt3-125m", 12, 768, 12),
        _gpt("gpt3-350m", 24, 1024, 16),
        _gpt("gpt3-760m", 24, 1536, 16),
        _gpt("gpt3-1.3b", 24, 2048, 16),
        _gpt("gpt3-2.7b", 32, 2560, 32),
        _gpt("gpt3-6.7b", 32, 4096, 32),
        _gpt("gpt3-13b", 40, 5120, 40),
        _llama("llama2-7b", 32, 4096, 32, 11008),
        _llama("llama2-13b", 40, 5120, 40, 13824),
        _llama("llama3-8b", 32, 4096, 32, 14336, kv=8, seq=8192, vocab=128256, theta=500000.0),
        _llama("llama3.2-1b", 16, 2048, 32, 8192, kv=8, seq=8192, vocab=128256, theta=500000.0, tied=True),
        _llama("llama3.2-3b", 28, 3072, 24, 8192, kv=8, seq=8192, vocab=128256, theta=500000.0, tied=True),
        # Tiny configs: tests and CPU runs of the runtime. They keep eager attention, whose four operators
        # exercise per-operator recomputation and the tensor model; `attention: fused` in a model YAML
        # (base: tiny) trains them with the fused kernel.
        ModelSpec(name="tiny", num_layers=4, hidden_dim=64, num_heads=4, ffn_dim=256, seq_len=32, vocab_size=256, dtype="fp32",
                  attention="eager"),
        ModelSpec(name="tiny-8l", num_layers=8, hidden_dim=64, num_heads=8, ffn_dim=256, seq_len=32, vocab_size=256, dtype="fp32",
                  attention="eager"),
        ModelSpec(name="small", num_layers=6, hidden_dim=256, num_heads=8, ffn_dim=1024, seq_len=128, vocab_size=512, dtype="fp32",
                  attention="eager"),
        # Tiny Llamas: 8 query heads over 4 KV heads (units of 2 query heads; uneven splits such as 3:1), untied
        # and tied heads.
        ModelSpec(name="tiny-llama", num_layers=4, hidden_dim=64, num_heads=8, ffn_dim=192, seq_len=32, vocab_size=256,
                  dtype="fp32", dropout=0.0, architecture="llama", num_kv_heads=4, tie_embeddings=False),
        ModelSpec(name="tiny-llama-tied", num_layers=4, hidden_dim=64, num_heads=8, ffn_dim=192, seq_len=32, vocab_size=256,
                  dtype="fp32", dropout=0.0, architecture="llama", num_kv_heads=4, tie_embeddings=True),
    ]
}

FIELDS = {"name", "num_layers", "hidden_dim", "num_heads", "ffn_dim", "seq_len", "vocab_size", "dtype", "dropout", "attention", "tf32",
           "architecture", "num_kv_heads", "rope_theta", "norm_eps", "tie_embeddings", "base"}


def from_mapping(data, *, source: str) -> ModelSpec:
    """Build a spec from a mapping; ``base: <preset>`` starts from a preset and overrides fields."""
    f = Fields(data, source=source)
    f.check_known(FIELDS, what="a model file")
    base = None
    if f.has("base"):
        base = PRESETS.get(f.string("base"))
        if base is None:
            raise f.error("base", f"unknown preset {excerpt(f.data['base'])} (known: {', '.join(PRESETS)})")
    def pick(key, reader, **kw):
        if base is not None and not f.has(key):
            return getattr(base, key)
        return reader(key, **kw)
    spec = ModelSpec(
        name=f.string("name", default=base.name if base else Path(source).stem),
        num_layers=pick("num_layers", f.integer),
        hidden_dim=pick("hidden_dim", f.integer),
        num_heads=pick("num_heads", f.integer),
        ffn_dim=pick("ffn_dim", f.integer) if (base or f.has("ffn_dim")) else 4 * f.integer("hidden_dim"),
        seq_len=pick("seq_len", f.integer),
        vocab_size=pick("vocab_size", f.integer),
        dtype=f.string("dtype", default=base.dtype if base else "fp16"),
        # Llama trains without dropout: a Llama written out in full has none unless it says so.
        dropout=f.number("dropout", default=base.dropout if base else (0.0 if f.data.get("architecture") == "llama" else 0.1),
                         allow_zero=True),
        attention=f.string("attention", default=base.attention if base else DEFAULT_ATTENTION),
        tf32=f.boolean("tf32", default=base.tf32 if base else False),
        **_llama_fields(f, base),
    )
    return validate(spec, source=source)


def _llama_fields(f: Fields, base: ModelSpec | None) -> dict:
    """The architecture fields of a model YAML (a Llama base keeps its own unless the file says)."""
    arch = f.string("architecture", default=base.architecture if base else "gpt")
    llama = arch == "llama"
    out = {"architecture": arch}
    given = f.has("num_kv_heads") and f.raw("num_kv_heads") is not None  # null: as many as the query heads
    if given or (base is not None and base.num_kv_heads is not None):
        out["num_kv_heads"] = f.integer("num_kv_heads") if given else base.num_kv_heads
    if f.has("rope_theta") or base is not None:
        out["rope_theta"] = f.number("rope_theta") if f.has("rope_theta") else base.rope_theta
    if f.has("norm_eps") or base is not None:
        out["norm_eps"] = f.number("norm_eps") if f.has("norm_eps") else base.norm_eps
    out["tie_embeddings"] = f.boolean("tie_embeddings", default=base.tie_embeddings if base else not llama)
    return out


SAME_TABLES_UNDER_A_PRESET_NAME = ("seq_len", "attention", "tf32")
"""What a model YAML may change of a preset and keep its name: profile tables are keyed by name, and these
three the tables already tell apart (the sequence length is in the file name, a derived table holds both
attention implementations, TF32 tables are named '<name>+tf32'). Anything else would find the preset's
tables, made for other sizes."""

_NAME_LABELS = {"num_layers": "l", "hidden_dim": "h", "num_heads": "a", "ffn_dim": "f", "vocab_size": "v", "dropout": "drop",
                "num_kv_heads": "kv", "rope_theta": "theta", "norm_eps": "eps"}
"""Short labels of the fields a made-up name lists (``gpt3-1.3b-l10``); other fields show their value alone
(``bf16``, ``llama``) or their own name."""


def preset_differences(spec: ModelSpec) -> list[tuple[str, object, object]]:
    """(field, preset's value, spec's value) where ``spec`` differs from the preset of its name in what keys
    its profile tables; [] when its name is no preset's."""
    preset = PRESETS.get(spec.name)
    if preset is None:
        return []
    mine, theirs = spec.to_dict(), preset.to_dict()
    return [(k, theirs[k], mine[k]) for k in mine
            if k != "name" and k not in SAME_TABLES_UNDER_A_PRESET_NAME and mine[k] != theirs.get(k)]


def variant_name(preset: str, differences) -> str:
    """A name for a preset changed by ``differences``, made of them (``gpt3-1.3b-l10-bf16``): the same
    changes always give the same name, so tables derived for one such file serve every copy of it and
    never a model of other sizes."""
    def label(field, value):
        if isinstance(value, bool):
            return ("" if value else "no-") + field.replace("_", "-")
        if isinstance(value, str):
            return value
        return _NAME_LABELS.get(field, field.replace("_", "-")) + (f"{value:g}" if isinstance(value, float) else str(value))

    name = "-".join([preset] + [label(f, v) for f, _, v in differences]).replace("+", "")
    if len(name) > 100 or any(c in name for c in "/\\\0\n"):
        import hashlib

        name = f"{preset}-{hashlib.sha256(repr(differences).encode()).hexdigest()[:10]}"
    return name


def own_name(spec: ModelSpec, *, named: bool, source: str) -> ModelSpec:
    """A model YAML under a preset's name with other sizes (``base: gpt3-1.3b`` plus changes, or a file
    whose stem is a preset's) would find that preset's profile tables. Without a ``name`` it is named
    after its changes (``variant_name``); with one it is refused, since that name was asked for."""
    differences = preset_differences(spec)
    if not differences:
        return spec
    made_up = variant_name(spec.name, differences)
    if named:
        listed = ", ".join(f"{f} {excerpt(p)} vs {excerpt(v)}" for f, p, v in differences[:4])
        raise BatonError(f"'{spec.name}' is a preset with other sizes ({listed}{', ...' if len(differences) > 4 else ''}), and "
                         f"profile tables are found by name; give the model a name of its own, or leave out 'name' to have "
                         f"it named '{made_up}'", source=source, field="name")
    return validate(ModelSpec(**{**spec.to_dict(), "name": made_up}), source=source)
