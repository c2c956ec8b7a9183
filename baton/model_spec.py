"""The GPT-style decoder Baton plans for: sizes, presets, and user-written YAML."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from baton.errors import BatonError
from baton.fields import Fields, excerpt, load_yaml

DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
TF32_MARK = "+tf32"
"""Appended to a model's name in its profile tables when its fp32 matmuls may use TF32."""
ATTENTION = ("eager", "fused")
DEFAULT_ATTENTION = "fused"
"""Attention implementations (baton/operators.py)."""

# Upper bounds of every size (documented in the README, "Errors"): far above any model trained today,
# low enough that no size makes a table, a plan search or a parameter count exhaust the machine.
LIMITS = {"num_layers": 1024, "hidden_dim": 65536, "num_heads": 1024, "ffn_dim": 262144, "seq_len": 1 << 20,
          "vocab_size": 1 << 22}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A pre-LayerNorm GPT (learned positions, GELU MLP, LM head tied to the token embedding)."""

    name: str
    """Preset key or the user's label."""
    num_layers: int
    """Transformer layers."""
    hidden_dim: int
    """Model width h."""
    num_heads: int
    """Attention heads a; the head dim is h / a."""
    ffn_dim: int
    """MLP inner width f (4h for GPT)."""
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

    @property
    def head_dim(self) -> int:
        return self.hidden_dim // self.num_heads

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def num_params(self) -> int:
        """Parameters, the tied embedding counted once."""
        h, f = self.hidden_dim, self.ffn_dim
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
    # '+' is reserved for the marks of ``profile_name``: a model named 'x+tf32' would take x's TF32 tables.
    if not isinstance(spec.name, str) or not spec.name or len(spec.name) > 100 or any(c in spec.name for c in "/\\\0\n+"):
        raise BatonError(f"must be a short name without path separators or '+', got {excerpt(spec.name)}", source=source,
                         field="name")
    return spec


def split_profile_name(table_model: str) -> tuple[str, bool]:
    """(model name, tf32) of a profile table's ``model`` column: ``ModelSpec.profile_name`` read back."""
    if table_model.endswith(TF32_MARK):
        return table_model[: -len(TF32_MARK)], True
    return table_model, False


def splits_into(spec: ModelSpec, units: int) -> bool:
    """Whether a layer of ``spec`` can be cut into ``units`` units (the partition granularity U of a
    stage): each unit holds whole heads and as many FFN columns as every other, so U divides both the
    head count and the FFN width (docs/cost-model.md, symbol table)."""
    return units >= 1 and spec.num_heads % units == 0 and spec.ffn_dim % units == 0


def unit_counts(spec: ModelSpec) -> list[int]:
    """Every partition granularity a layer of ``spec`` allows, ascending."""
    return [u for u in range(1, spec.num_heads + 1) if splits_into(spec, u)]


def _gpt(name, layers, hidden, heads, seq=2048, vocab=50257, ffn=None):
    return ModelSpec(
        name=name, num_layers=layers, hidden_dim=hidden, num_heads=heads,
        ffn_dim=ffn or 4 * hidden, seq_len=seq, vocab_size=vocab,
    )


# GPT-3 family as in Brown et al. table 2.1 (1.3B as Megatron configures it: 24 x 2048, 16 heads).
# Llama-2 entries keep Llama's sizes (width, depth, heads, FFN, 4k context, 32k vocab) on our GPT
# architecture so figures can be compared with papers that train them.
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
        _gpt("llama2-7b", 32, 4096, 32, seq=4096, vocab=32000, ffn=11008),
        _gpt("llama2-13b", 40, 5120, 40, seq=4096, vocab=32000, ffn=13824),
        # Tiny configs: tests and CPU runs of the runtime. They keep eager attention, whose four operators
        # exercise per-operator recomputation and the tensor model; `attention: fused` in a model YAML
        # (base: tiny) trains them with the fused kernel.
        ModelSpec(name="tiny", num_layers=4, hidden_dim=64, num_heads=4, ffn_dim=256, seq_len=32, vocab_size=256, dtype="fp32",
                  attention="eager"),
        ModelSpec(name="tiny-8l", num_layers=8, hidden_dim=64, num_heads=8, ffn_dim=256, seq_len=32, vocab_size=256, dtype="fp32",
                  attention="eager"),
        ModelSpec(name="small", num_layers=6, hidden_dim=256, num_heads=8, ffn_dim=1024, seq_len=128, vocab_size=512, dtype="fp32",
                  attention="eager"),
    ]
}

_FIELDS = {"name", "num_layers", "hidden_dim", "num_heads", "ffn_dim", "seq_len", "vocab_size", "dtype", "dropout", "attention", "tf32", "base"}


def from_mapping(data, *, source: str) -> ModelSpec:
    """Build a spec from a mapping; ``base: <preset>`` starts from a preset and overrides fields."""
    f = Fields(data, source=source)
    f.check_known(_FIELDS)
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
        dropout=f.number("dropout", default=base.dropout if base else 0.1, allow_zero=True),
        attention=f.string("attention", default=base.attention if base else DEFAULT_ATTENTION),
        tf32=f.boolean("tf32", default=base.tf32 if base else False),
    )
    return validate(spec, source=source)


def load_model(name_or_path: str) -> ModelSpec:
    """A preset name (``gpt3-1.3b``) or a path to a model YAML."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return from_mapping(load_yaml(path), source=str(path))
    raise BatonError(f"unknown model {excerpt(name_or_path)}: not a preset ({', '.join(PRESETS)}) and not a YAML file", field="model")
