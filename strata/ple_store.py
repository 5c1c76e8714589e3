"""A PLE model's row store beside its model file: `<name>.ngrams` (docs/formats.md §7).

A Qwen4-Exp model converted by strata keeps its n-gram tables out of the `.gguf`
(`ModelConfig.ple_row_store`): they are tens of GB, read per token into a small row cache
(strata.runtime.ngram_rows), never loaded whole. The model file records the identity of the store
it was written with (`strata.ngrams_identity`), as it does its expert set's; `open_ngram_store`
refuses, in one line each, a store that is missing, foreign (another identity) or shaped for
another config (its tables must be the config's PLE layers' tables, by PLE index).
"""

from __future__ import annotations

from pathlib import Path

from strata.errors import FormatError
from strata.formats.ngram_rows_file import NgramRowsFile
from strata.model_config import ModelConfig
from strata.families.qwen4_exp import ngram_heads, ngram_table_sizes, ple_layers

__all__ = ["NGRAMS_SUFFIX", "ngrams_path_for", "table_shapes", "open_ngram_store"]

NGRAMS_SUFFIX = ".ngrams"


def ngrams_path_for(model_path: Path) -> Path:
    """`<name>.gguf` -> `<name>.ngrams`."""
    return Path(model_path).with_suffix(NGRAMS_SUFFIX)


def table_shapes(cfg: ModelConfig) -> dict[int, tuple[int, int]]:
    """PLE index -> (rows, width) of its table: what the store must hold for this config."""
    width = cfg.qwen4.ple_embed_dim // ngram_heads(cfg) if cfg.qwen4.ple_embed_dim else 0
    return {i: (ngram_table_sizes(cfg, i)[2], width) for i in range(len(ple_layers(cfg)))}


def open_ngram_store(cfg: ModelConfig, model_path: Path, identity: str | None, *,
                     path: str | Path | None = None) -> NgramRowsFile | None:
    """The row store of a model whose config says `ple_row_store` (None for any other model).
    identity: what the model file records (None: not recorded, no check). path: the store
    (default `<name>.ngrams` beside the model)."""
    if not cfg.qwen4.ple_row_store:
        return None
    path = Path(path) if path is not None else ngrams_path_for(model_path)
    if not path.exists():
        raise FormatError(f"{path}: no such PLE row store (ple_row_store: {Path(model_path).name}'s n-gram "
                          "tables are in this file; convert the checkpoint again to write it)")
    store = NgramRowsFile.open(path)
    try:
        if identity is not None and store.identity != identity:
            raise FormatError(f"{path}: not the row store {Path(model_path).name} was written with (identity "
                              f"{store.identity}, the model records {identity})")
        want = table_shapes(cfg)
        found = {layer: (t.rows, t.width) for layer, t in store.tables.items()}
        if found != want:
            raise FormatError(f"{path}: holds tables (PLE index: rows, width) {found}, but {Path(model_path).name} "
                              f"wants {want}")
    except BaseException:
        store.close()
        raise
    return store
