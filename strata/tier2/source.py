"""What makes a path a tier-2 checkpoint, and the requirement it brings (mlx-lm).

A directory with a `config.json` and safetensors weights is a checkpoint that mlx-lm's model
files read; strata runs it as tier 2 (strata.tier2). Stat calls only: a wrong path fails at
once, before anything is imported."""

from __future__ import annotations

from pathlib import Path

from strata.errors import ConfigError

__all__ = ["is_tier2_source", "require_mlx_lm", "tier_line", "tier2_has", "MLX_LM_VERSION", "EXTRA_HINT"]

MLX_LM_VERSION = "0.32.2"  # the version pyproject's `mlx-lm` extra pins (tested against it)
EXTRA_HINT = "pip install 'strata-moe[mlx-lm]'"


def is_tier2_source(path: Path) -> bool:
    """A directory holding config.json and at least one .safetensors file."""
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def require_mlx_lm(path: Path | str) -> None:
    """Raise a one-line ConfigError naming the extra when mlx-lm is not importable here, or is
    not the version tier 2 was built and tested against."""
    try:
        import mlx_lm
    except ImportError:
        raise ConfigError(f"{path}: a Hugging Face checkpoint directory runs as it is on mlx-lm's model files "
                          f"(tier 2), which needs mlx-lm: {EXTRA_HINT}; or run `strata convert {path} OUT` for a "
                          "native family") from None
    version = getattr(mlx_lm, "__version__", None)
    if version != MLX_LM_VERSION:
        raise ConfigError(f"{path}: tier 2 is tested with mlx-lm {MLX_LM_VERSION}, this is {version}: {EXTRA_HINT}")


def _mlx_lm_has(model_type: str) -> bool:
    """Whether mlx-lm has a model file for `model_type` (its own file, or its remapping's)."""
    import importlib.util

    if importlib.util.find_spec(f"mlx_lm.models.{model_type}") is not None:
        return True
    from mlx_lm.utils import MODEL_REMAPPING  # imports mlx-lm's tokenizer helpers: only when needed

    mapped = MODEL_REMAPPING.get(model_type)
    return mapped is not None and importlib.util.find_spec(f"mlx_lm.models.{mapped}") is not None


def tier2_has(model_type: str | None) -> bool:
    """Whether tier 2 can run `model_type` here: mlx-lm importable, with a model file for it."""
    import importlib.util

    return bool(model_type) and importlib.util.find_spec("mlx_lm") is not None and _mlx_lm_has(model_type)


def tier_line(path: Path | str, model_type: str | None, native: bool) -> str:
    """One line for `strata doctor`: which tier runs a checkpoint directory here, and why."""
    import importlib.util

    later = f"; the native path after `strata convert {path} OUT`" if native else ""
    if not model_type:
        return "tier: none (config.json names no model_type)"
    if importlib.util.find_spec("mlx_lm") is None:
        return f"tier: 2 needs mlx-lm ({EXTRA_HINT}){later}"
    if not _mlx_lm_has(model_type):
        return f"tier: no tier 2 (mlx-lm has no {model_type} model file){later}"
    return (f"tier: 2 as it is (`strata generate {path} PROMPT`: mlx-lm's {model_type} model file, experts streamed "
            f"from the checkpoint){later}")
