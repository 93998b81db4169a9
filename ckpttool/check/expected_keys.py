"""What transformers would load from a folder with a given config.json: the keys and shapes its
`save_pretrained` writes for a model built from that config, found without any weights.

The model is built on the meta device (no memory for weights), and its state dict goes through
what `save_pretrained` does to it (modeling_utils: `remove_tied_weights_from_state_dict`, then
core_model_loading `revert_weight_conversion`: fused experts back to per-expert keys, legacy
names), so the keys are those of a checkpoint transformers loads with nothing missing or
unexpected. Patterns the model ignores on load (`_keys_to_ignore_on_load_unexpected`, e.g.
DeepSeek-V3's MTP layers) come along. None when transformers is not importable or cannot build
the config's model (the caller falls back to its own tables).

Example:
    >>> expected = transformers_expected({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", ...})
    >>> expected.shapes["model.layers.0.self_attn.q_norm.weight"]
    (128,)
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any, Mapping

QUANTIZATION_KEY = "quantization_config"


@dataclass(frozen=True)
class Expected:
    """The keys -> shapes transformers writes for a config, its model class and the key patterns
    it ignores when they are there (unexpected) or absent (missing)."""

    model: str
    shapes: dict[str, tuple[int, ...]]
    ignore_unexpected: tuple[str, ...] = ()
    ignore_missing: tuple[str, ...] = ()

    def problems(self, shapes: Mapping[str, tuple[int, ...]]) -> list[tuple[str, str]]:
        """Return (key, what is wrong) for each key transformers would report missing,
        unexpected or mismatched, in key order."""
        found = []
        for key, shape in self.shapes.items():
            if key not in shapes:
                if not _any(self.ignore_missing, key):
                    found.append((key, f"the config expects {key} of shape {list(shape)}, which the weights do not "
                                       f"hold ({self.model} would initialise it at random; wrong --assets or --rename?)"))
            elif tuple(shapes[key]) != tuple(shape):
                found.append((key, f"{key} has shape {list(shapes[key])} in the weights, the config expects "
                                   f"{list(shape)} ({self.model})"))
        for key in sorted(shapes):
            if key not in self.shapes and not _any(self.ignore_unexpected, key):
                found.append((key, f"the weights hold {key} (shape {list(shapes[key])}), which {self.model} does not "
                                   "have (--rename?)"))
        return found


def _any(patterns: tuple[str, ...], key: str) -> bool:
    return any(re.search(pattern, key) for pattern in patterns)


def transformers_missing() -> str | None:
    """Return why transformers cannot be asked (not installed, or too old to say what
    `save_pretrained` writes), or None when it can."""
    try:
        import transformers
        from transformers.core_model_loading import revert_weight_conversion  # noqa: F401 - transformers >= 5
    except ImportError as error:
        version = getattr(sys.modules.get("transformers"), "__version__", None)
        found = f"transformers {version} is too old" if version else "transformers is not installed"
        return f"{found} ({type(error).__name__}: {error}); pip install 'transformers>=5'"
    del transformers
    return None


def transformers_expected(config: Mapping[str, Any]) -> Expected | None:
    """Return what transformers writes for a model of `config` (its `quantization_config` left
    out: the weights are checked as they are written), or None when it cannot tell."""
    try:
        import torch
        import transformers
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:
        return None
    settings = {key: value for key, value in config.items() if key != QUANTIZATION_KEY}
    architectures = settings.get("architectures") or []
    try:
        built = transformers.AutoConfig.for_model(**settings)
        model_class = getattr(transformers, architectures[0], None) if architectures else None
        with torch.device("meta"):
            model = (model_class._from_config(built) if model_class is not None
                     else transformers.AutoModelForCausalLM.from_config(built))
        state = remove_tied_weights_from_state_dict(model.state_dict(), model)
        state = revert_weight_conversion(model, state)
    except Exception:  # an unknown model_type, a config transformers refuses: no opinion
        return None
    # DeepSeek's multi-token-prediction layers follow the main ones (`num_nextn_predict_layers`);
    # transformers builds none and ignores them on load (its pattern `model\.layers\.61.*` is that
    # rule for DeepSeek-V3's 61 layers), so a checkpoint may carry them
    extra = int(settings.get("num_nextn_predict_layers") or 0)
    layers = int(settings.get("num_hidden_layers") or 0)
    next_layers = tuple(rf"^model\.layers\.{layer}\." for layer in range(layers, layers + extra))
    return Expected(
        model=type(model).__name__,
        shapes={key: tuple(value.shape) for key, value in state.items()},
        ignore_unexpected=tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()) + next_layers,
        ignore_missing=tuple(getattr(model, "_keys_to_ignore_on_load_missing", None) or ()),
    )
