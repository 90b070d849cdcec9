"""Checks of a Hugging Face model folder before ``fisherprune prune`` does any work with it:
its tokenizer files are there, its weight files are readable, and its ``config.json`` describes
the weights' shapes. Each failure is one ``ValueError`` line naming the file, field or tensor
(transformers would otherwise build an empty tokenizer, or fail with a traceback).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fisherprune._errors import first_line

try:
    from safetensors import safe_open
except ImportError:  # pragma: no cover - comes with transformers
    safe_open = None

__all__ = ["TOKENIZER_FILES", "check_hf_folder"]

#: files that hold a tokenizer's vocabulary (``tokenizer_config.json`` alone holds none)
TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def check_hf_folder(folder: Path, config: Any, model_class: Any) -> None:
    """Refuse ``folder`` unless it holds a tokenizer, readable weights, and a ``config`` whose
    ``model_class`` has the weights' shapes (built on the meta device: no memory, no weights
    read). Reads only the files' headers (safetensors) or maps them (``.bin``); changes
    nothing.

    Raises:
        ValueError: no tokenizer files; a weight file that cannot be read (named); the first
            tensor whose shape the config does not give, with the config field of the width.
    """
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"{folder} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): the sentences "
            "could not be read as the model was trained on them; save the tokenizer into the "
            "folder (tokenizer.save_pretrained(folder))"
        )
    with torch.device("meta"):
        skeleton = (
            model_class.from_config(config)
            if hasattr(model_class, "from_config")
            else model_class(config)
        )
    want = {k: tuple(v.shape) for k, v in skeleton.state_dict().items()}
    prefix = f"{skeleton.base_model_prefix}."
    for file, name, shape in _weight_shapes(folder):
        key = next((k for k in (name, name.removeprefix(prefix), prefix + name) if k in want), None)
        if key is not None and want[key] != shape:
            raise ValueError(_mismatch(folder, config, file, name, shape, want[key]))


def _mismatch(
    folder: Path, config: Any, file: str, name: str, shape: tuple[int, ...], want: tuple[int, ...]
) -> str:
    """One line: the config field whose value gives the differing width, and the tensor."""
    dim = next((i for i, (a, b) in enumerate(zip(shape, want, strict=False)) if a != b), 0)
    value = want[dim] if dim < len(want) else None
    fields = [f for f, v in config.to_dict().items() if v == value and not isinstance(v, bool)]
    said = f"{fields[0]}={value}" if fields else f"a width of {value}"
    return (
        f"{folder}/config.json says {said}, but {file} holds {name} of shape {list(shape)} "
        f"(the config gives {list(want)}): the config does not describe these weights; save "
        "the model with save_pretrained so that both are written together"
    )


def _weight_shapes(folder: Path) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(file, tensor name, shape)`` of every tensor in the folder's weight files (safetensors
    headers, or ``.bin`` files mapped, not read).

    Raises:
        ValueError: a weight file cannot be read; it names the file.
    """
    found = []
    for path in sorted(folder.glob("*.safetensors")) if safe_open is not None else []:
        try:
            with safe_open(str(path), "pt") as f:
                found += [(path.name, k, tuple(f.get_slice(k).get_shape())) for k in f.keys()]  # noqa: SIM118
        except Exception as e:
            raise _unreadable(path, e) from None
    for path in sorted(folder.glob("pytorch_model*.bin")):
        try:
            state = torch.load(path, map_location="meta", weights_only=True)
        except Exception as e:
            raise _unreadable(path, e) from None
        found += [(path.name, k, tuple(v.shape)) for k, v in state.items()]
    return found


def _unreadable(path: Path, e: Exception) -> ValueError:
    return ValueError(
        f"weight file {path} cannot be read ({first_line(e)}): it is damaged or cut short; "
        "save the model again (save_pretrained)"
    )
