"""A Hugging Face model's ``config`` after its widths changed.

``save_pretrained`` writes ``model.config`` and ``from_pretrained`` builds the model from it
before loading the weights, so after ``shrink`` the config must describe the smaller model:
its hidden width, head counts, MLP and experts' width, expert count. This module reads those
widths off the shrunk modules (the first norm's width; each attention module's query and key
widths over its head size; each MLP's first projection; each mixture-of-experts layer's
stacked ``down_proj``, its width and its count of experts),
writes them into the config when every block agrees, and
proves the result by building the model class from the new config on the meta device and
comparing every parameter's shape. When the blocks differ (pruned without ``uniform=True``)
or the config has no field for a width, the config is left as it was and the reason returned:
the model then needs its ``PruningPlan`` to be rebuilt.

Nothing here imports ``transformers``: a model counts as a Hugging Face model when it has a
``config`` with ``to_dict`` and its class a ``config_class``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
from torch import nn

from fisherprune._errors import first_line

__all__ = ["CONFIG_FIELDS", "is_hf_model", "read_widths", "update_config"]

_QUERY = ("query", "q_proj", "q", "q_lin")
_KEY = ("key", "k_proj", "k", "k_lin")
_FUSED_QKV = ("c_attn", "qkv", "Wqkv", "query_key_value")
_EMBEDDING_PROJECTIONS = ("embeddings_project", "embedding_hidden_mapping_in")
_KV_HEADS = ("num_kv_heads", "num_key_value_heads")
_HEAD_SIZE = ("head_dim", "attention_head_size", "key_value_proj_dim", "head_size")
_MLP_IN = ("up_proj", "fc1", "c_fc", "wi", "wi_0", "lin1", "fc_in", "dense_h_to_4h", "w1", "ffn")
#: an MLP's first projection named by its parent too (the name alone is too common):
#: XLNet's ``ff.layer_1``, Funnel's ``ffn.linear_1``, BERT's ``intermediate.dense``
_MLP_IN_PAIRS = (("ff", "layer_1"), ("ffn", "linear_1"), ("intermediate", "dense"))
#: a gated MLP's fused first projection, its gate's and its values' rows stacked (twice the
#: MLP's width): Phi-3's ``gate_up_proj``, ModernBERT's ``mlp.Wi``
_MLP_IN_GLU = ("gate_up_proj",)
_MLP_IN_GLU_PAIRS = (("mlp", "Wi"),)


def _out_width(mod: nn.Module) -> int | None:
    """Output width of a projection: ``nn.Linear`` or GPT-2's transposed ``Conv1D``."""
    w = getattr(mod, "out_features", None) or getattr(mod, "nf", None)
    return w if isinstance(w, int) else None


def _head_size(mod: nn.Module) -> int | None:
    return next(
        (getattr(mod, a) for a in _HEAD_SIZE if isinstance(getattr(mod, a, None), int)), None
    )


def _attention(model: nn.Module) -> list[tuple[int, int]]:
    """(query heads, key/value heads) of every attention module, in model order."""
    found = []
    for mod in model.modules():
        children = dict(mod.named_children())
        size = _head_size(mod)
        if not size:
            continue
        q = next((children[n] for n in _QUERY if n in children), None)
        k = next((children[n] for n in _KEY if n in children), None)
        fused = next((children[n] for n in _FUSED_QKV if n in children), None)
        if q is not None and k is not None and _out_width(q) and _out_width(k):
            # ConvBERT's attention keeps num_attention_heads / head_ratio of the config's heads
            ratio = getattr(mod, "head_ratio", 1)
            ratio = ratio if isinstance(ratio, int) and ratio > 0 else 1
            found.append((_out_width(q) // size * ratio, _out_width(k) // size * ratio))
        elif fused is not None and _out_width(fused):
            rows = _out_width(fused) // size  # query, key and value heads, stacked
            kv = next(
                (getattr(mod, a) for a in _KV_HEADS if isinstance(getattr(mod, a, None), int)),
                1 if getattr(mod, "multi_query", None) is True else None,  # (GPTBigCode's flag)
            )
            if kv is None:  # as many of each (GPT-2, GPT-NeoX)
                found.append((rows // 3, rows // 3))
            else:  # fewer key/value heads (Falcon's multi-query attention)
                found.append((rows - 2 * kv, kv))
    return found


def _mlp(model: nn.Module) -> list[int]:
    """Width of every MLP (its first projection's outputs, half of them for a fused gated
    one), in model order."""
    widths = []
    for name, mod in model.named_modules():
        parts = name.split(".")
        glu = parts[-1] in _MLP_IN_GLU or tuple(parts[-2:]) in _MLP_IN_GLU_PAIRS
        if glu or parts[-1] in _MLP_IN or tuple(parts[-2:]) in _MLP_IN_PAIRS:
            w = _out_width(mod)
            if w:
                widths.append(w // 2 if glu else w)
    return widths


def _experts(model: nn.Module) -> list[int]:
    """Width of every mixture-of-experts layer's experts: the contracted dim of the 3-D
    ``down_proj`` (E, hidden, width), or (E, width, hidden) when the module says its weights
    are stored transposed (Hugging Face's ``is_transposed``, as gpt-oss stores them)."""
    widths = []
    for mod in model.modules():
        w = getattr(mod, "down_proj", None)
        if isinstance(w, nn.Parameter) and w.dim() == 3:
            widths.append(int(w.shape[1] if getattr(mod, "is_transposed", False) else w.shape[2]))
    return widths


def _expert_counts(model: nn.Module) -> list[int]:
    """Experts of every mixture-of-experts layer: the leading dim of its 3-D ``down_proj``."""
    return [
        int(w.shape[0])
        for mod in model.modules()
        if isinstance(w := getattr(mod, "down_proj", None), nn.Parameter) and w.dim() == 3
    ]


def _mlp_or_experts(model: nn.Module) -> list[int]:
    """The MLP width, which a config with no field of its own for the experts' width
    (Mixtral's ``intermediate_size``) also gives its experts."""
    config = getattr(model, "config", None)
    own = hasattr(config, "moe_intermediate_size")
    return _mlp(model) + ([] if own else _experts(model))


def _hidden(model: nn.Module) -> list[int]:
    """The residual stream's width: the output width of the projection that lifts narrower
    embeddings to it (ELECTRA's ``embeddings_project``, ALBERT's
    ``embedding_hidden_mapping_in``; their embedding norm is ``embedding_size`` wide), else
    the width the first normalisation layer normalises, leaving out those of an attention
    module (Qwen3's per-head ``q_norm`` and ``k_norm``, one head wide)."""
    for name, mod in model.named_modules():
        if name.rsplit(".", 1)[-1] in _EMBEDDING_PROJECTIONS and (width := _out_width(mod)):
            return [width]
    for mod in model.modules():
        if _head_size(mod):
            continue
        for child in mod.children():
            w = getattr(child, "weight", None)
            if "Norm" in type(child).__name__ and isinstance(w, torch.Tensor) and w.dim() == 1:
                return [w.numel()]
    return []


def _embedding(model: nn.Module) -> list[int]:
    """The width of the input embeddings (``get_input_embeddings``), where the model has them."""
    try:
        emb = model.get_input_embeddings()  # type: ignore[operator]
    except (AttributeError, NotImplementedError, TypeError):
        return []
    width = getattr(emb, "embedding_dim", None)
    return [width] if isinstance(width, int) else []


#: config fields by what they hold, and how the shrunk model's values are read
CONFIG_FIELDS: dict[tuple[str, ...], Callable[[nn.Module], list[int]]] = {
    ("hidden_size", "n_embd", "d_model", "dim", "embed_dim"): _hidden,
    (
        "num_attention_heads",
        "n_head",
        "num_heads",
        "n_heads",
        "encoder_attention_heads",
        "decoder_attention_heads",
    ): lambda m: [q for q, _ in _attention(m)],
    ("num_key_value_heads", "n_kv_heads", "num_kv_heads"): lambda m: [k for _, k in _attention(m)],
    (
        "intermediate_size",
        "n_inner",
        "d_ff",
        "ffn_dim",
        "encoder_ffn_dim",
        "decoder_ffn_dim",
        "ffn_hidden_size",
        "hidden_dim",  # DistilBERT's MLP width (its hidden width is ``dim``)
        "d_inner",  # XLNet's and Funnel's
    ): _mlp_or_experts,
    ("moe_intermediate_size",): _experts,
    ("num_experts", "num_local_experts", "n_routed_experts"): _expert_counts,
    ("head_dim",): lambda m: [s for s in (_head_size(x) for x in m.modules()) if s],
    ("embedding_size",): _embedding,
}
#: fields written even when the config lacks them (a model reading ``config.head_dim`` with a
#: default then follows it; one that does not is caught by the shape check)
_ADDED = ("head_dim",)


def _sub_model(model: nn.Module, prefix: str) -> nn.Module | None:
    """The submodule a composite config's ``{prefix}_config`` describes (CLIP's and SigLIP's
    ``vision_model`` and ``text_model``, LLaVA's ``vision_tower`` and ``language_model``,
    BLIP-2's ``qformer``), the one nearest the root; None when the model has none (SigLIP's
    image classifier keeps no text tower)."""
    names = {f"{prefix}_model", f"{prefix}_tower", f"{prefix}_encoder", prefix}
    if prefix == "text":
        names.add("language_model")
    found = [
        (name.count("."), name, mod)
        for name, mod in model.named_modules()
        if name and name.rsplit(".", 1)[-1] in names
    ]
    return min(found, key=lambda t: t[:2])[2] if found else None


def _parts(model: nn.Module, config: object) -> list[tuple[str, nn.Module]]:
    """What each part of ``config`` describes: ``(key, module)`` for every sub-config
    ``key`` (``vision_config``...) whose submodule the model has, or ``[("", model)]`` for a
    config with none (its own fields describe the whole model)."""
    subs = [
        (key, mod)
        for key, sub in vars(config).items()
        if key.endswith("_config")
        and callable(getattr(sub, "to_dict", None))
        and (mod := _sub_model(model, key[: -len("_config")])) is not None
    ]
    return subs or [("", model)]


def _part(config: object, key: str) -> object:
    return getattr(config, key) if key else config


def read_widths(model: nn.Module) -> dict[str, list[int]]:
    """The widths each group of config fields would take from ``model`` (one per block, in
    model order), keyed by the group's first field name (after ``vision_config.``, or another
    sub-config's key, for each part of a composite config)."""
    config = getattr(model, "config", None)
    parts = _parts(model, config) if is_hf_model(model) else [("", model)]
    return {
        f"{key}.{fields[0]}" if key else fields[0]: read(mod)
        for key, mod in parts
        for fields, read in CONFIG_FIELDS.items()
    }


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` carries a Hugging Face config (duck-typed: no import of transformers)."""
    config = getattr(model, "config", None)
    return callable(getattr(config, "to_dict", None)) and hasattr(type(model), "config_class")


def update_config(model: nn.Module) -> str | None:
    """Write the shrunk ``model``'s widths into its Hugging Face ``config``.

    Changes: ``model.config``'s width fields (hidden size, head and key/value head counts,
    MLP width, in whichever spellings it has), only when every block has the same widths and
    ``type(model)(new config)`` has exactly the model's parameter shapes. A composite config
    (CLIP's, SigLIP's: ``vision_config``, ``text_config``) has each sub-config's fields read
    off the submodule it describes. A model without a Hugging Face config is left alone.

    Returns:
        None when the config describes the model (or there is none); otherwise why it
        cannot (the config is then unchanged).
    """
    if not is_hf_model(model):
        return None
    config = model.config
    new = copy.deepcopy(config)
    parts = _parts(model, config)
    for key, mod in parts:
        problem = _write_widths(mod, _part(config, key), _part(new, key), key)
        if problem:
            return problem
    problem = _shape_mismatch(model, new)
    if problem:
        return problem
    for key, _ in parts:
        old, fresh = _part(config, key), _part(new, key)
        for fields in CONFIG_FIELDS:
            for f in fields:
                if getattr(fresh, f, None) != getattr(old, f, None):
                    setattr(old, f, getattr(fresh, f))
    return None


def _write_widths(module: nn.Module, config: object, new: object, key: str) -> str | None:
    """Set ``new``'s width fields (a copy of ``config``, the part ``key`` of the model's
    config) to those read off ``module``; why they cannot be (None if they can)."""
    where = f"{key}." if key else ""
    for fields, read in CONFIG_FIELDS.items():
        present = [f for f in fields if _holds_width(config, f)] or [
            f for f in fields if f in _ADDED and not _read_only(config, f)
        ]
        values = sorted(set(read(module)))
        if not present or not values:
            continue
        held = {f: getattr(config, f) for f in present if _holds_width(config, f)}
        if len(set(held.values())) > 1:
            listed = ", ".join(f"{where}{f}={v}" for f, v in held.items())
            return (
                f"its config holds different widths in {listed} "
                "(stages of their own, as in a hierarchical vision model): fields that one "
                "width would set cannot describe it; keep the PruningPlan to rebuild it"
            )
        if len(values) > 1:
            return (
                f"its blocks keep different widths for {where}{present[0]} ({values}): a "
                "Hugging Face config holds one per model; prune with uniform=True, or keep "
                "the PruningPlan to rebuild it"
            )
        for f in present:
            setattr(new, f, values[0])
    return None


def _read_only(config: object, field: str) -> bool:
    """Whether ``field`` is a property of the config's class with no setter."""
    attr = getattr(type(config), field, None)
    return isinstance(attr, property) and attr.fset is None


def _holds_width(config: object, field: str) -> bool:
    """Whether the config has ``field`` as a width it stores: an int, or None for "derived"
    (GPT-2's ``n_inner``); not a read-only property computed from other fields (Falcon's
    ``head_dim``), which follows them."""
    if _read_only(config, field) or not hasattr(config, field):
        return False
    v = getattr(config, field)
    return v is None or (isinstance(v, int) and not isinstance(v, bool))


def _shape_mismatch(model: nn.Module, config: object) -> str | None:
    """Why ``type(model)(config)`` would not have ``model``'s parameter shapes (None if it
    would); built on the meta device, so no memory is used for weights."""
    try:  # as from_pretrained will: the config rebuilt from its dict (its validators run)
        config = type(config).from_dict(config.to_dict())
        with torch.device("meta"):
            fresh = type(model)(config)
    except Exception as e:  # the class refuses the widths (hidden size not a multiple of heads)
        return f"{type(model).__name__} cannot be built with the shrunk widths ({first_line(e)})"
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in fresh.state_dict().items()}
    differ = [k for k in want if k in got and got[k] != want[k]]
    if differ:
        k = differ[0]
        return (
            f"a config with the shrunk widths gives {k} the shape {got[k]}, the shrunk model "
            f"has {want[k]} ({len(differ)} tensor(s) differ): the config has no field for "
            "such a width (e.g. a hidden size that is not heads x head size)"
        )
    return _derived_mismatch(model, fresh)


#: int attributes that a class derives from a width at construction and its forward reads
#: (most int width attributes a module keeps are not read, and shrink leaves them): T5's
#: ``model_dim`` (``d_model``), whose inverse square root scales the tied output embedding
DERIVED_INTS: frozenset[str] = frozenset({"model_dim"})


def _derived_mismatch(model: nn.Module, fresh: nn.Module) -> str | None:
    """Why a module of ``fresh`` (built from the new config) holds a different number than the
    same module of ``model``: a constant its class derives from a width at construction, not
    stored in the weights (Gemma's embedding scale, the square root of the hidden size; T5's
    ``model_dim``, whose inverse square root scales the tied output embedding), which
    ``from_pretrained`` would recompute; None if every such float, and every int named in
    ``DERIVED_INTS``, agrees."""
    built = dict(fresh.named_modules())
    for name, mod in model.named_modules():
        other = built.get(name)
        if other is None:
            continue
        for attr, value in vars(mod).items():
            if attr.startswith("_") or not (
                type(value) is float or (type(value) is int and attr in DERIVED_INTS)
            ):
                continue
            new = getattr(other, attr, None)
            if type(new) is type(value) and not math.isclose(new, value, rel_tol=1e-12):
                return (
                    f"a config with the shrunk widths gives {name or type(model).__name__}."
                    f"{attr} = {new:g} where the shrunk model has {value:g}: the class derives "
                    "it from a width at construction, so from_pretrained would change the "
                    "outputs; keep that width whole (uniform=True does) or keep the PruningPlan"
                )
    return None
