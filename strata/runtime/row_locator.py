"""Where a request's rows are and how they come out of the row cache's slots: the id to page
arithmetic of strata.formats.ngram_rows_file (`locate`) and its `decode`, with each table's numbers
and each layer's view of the slots made once, and a prefetch's layers located in one pass.

A token of the reference engine's shape asks 36 layers for 16 rows each; numpy's fixed cost per
call (~10 us for `locate` or `np.unique`, ~20 us for `as_strided`) was most of the row cache's
own time per page (docs/perf.md, "PLE rows from a row store"), so the per-call work is made once
here and the per-token work is one pass over the token's ids.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from strata.formats.ngram_row_types import ROW_TYPES
from strata.formats.ngram_rows_file import NgramRowsFile, TableInfo
from strata.formats.quant_types import FLOAT_DTYPES, QuantType

__all__ = ["RowLocator"]

SMALL_REQUEST = 256  # ids up to which a set and a dict beat np.unique (a token's 16 heads: 3x faster here)


def unique_pages(pages: np.ndarray) -> tuple[list[int], np.ndarray]:
    """The sorted distinct pages (python ints) and each id's index into them. Shapes: [n] -> P, [n]"""
    if len(pages) <= SMALL_REQUEST:
        plist = pages.tolist()
        upages = sorted(set(plist))
        index = {p: i for i, p in enumerate(upages)}
        return upages, np.fromiter((index[p] for p in plist), np.int64, len(plist))
    uniq, which = np.unique(pages, return_inverse=True)
    return uniq.tolist(), which.reshape(-1)


def _row_view(slots: np.ndarray, table: TableInfo, qtype: QuantType) -> tuple[np.ndarray, bool]:
    """The slots as one table's rows, a view: (view, typed). A float row type is viewed in its
    dtype, [capacity, rows_per_page, width] (typed); another as bytes, [capacity, rows_per_page,
    row_bytes]. Shapes: slots uint8 [capacity, page_bytes]"""
    dtype = FLOAT_DTYPES.get(qtype) if qtype in ROW_TYPES else None
    itemsize = 1 if dtype is None else np.dtype(dtype).itemsize
    base = slots if dtype is None else slots.view(dtype)  # [capacity, page_bytes / itemsize]
    inner = table.row_bytes // itemsize
    view = np.lib.stride_tricks.as_strided(base, shape=(slots.shape[0], table.rows_per_page, inner),
                                           strides=(slots.strides[0], table.row_bytes, itemsize), writeable=False)
    return view, dtype is not None


class RowLocator:
    """The pages and rows of a store's requests, and their rows decoded out of `slots` (uint8
    [capacity, page_bytes], the row cache's)."""

    def __init__(self, store: NgramRowsFile, slots: np.ndarray) -> None:
        self.store = store
        # per layer, made once: (rows, rows_per_page, first_page), and the slots seen as
        # [capacity, rows_per_page, row] rows
        self._geometry = {l: (t.rows, t.rows_per_page, t.first_page) for l, t in store.tables.items()}
        self._row_views = {l: _row_view(slots, t, store.qtype) for l, t in store.tables.items()}

    def locate_all(self, ids_by_layer: Mapping[int, np.ndarray]) -> dict[int, tuple]:
        """`pages` for every layer of a prefetch in one pass of numpy over all their ids (a
        token's 36 layers of 16: 576 ids; per layer, numpy's fixed cost was ~10 us a call):
        layer -> (its ids, a copy [n]; sorted distinct global pages; index [n]; row within [n])."""
        layers = sorted(ids_by_layer)
        if not layers:
            return {}
        flats = [np.asarray(ids_by_layer[l], dtype=np.int64).reshape(-1) for l in layers]
        if any(l not in self._geometry for l in layers):
            return {l: (f.copy(),) + self.pages(l, f) for l, f in zip(layers, flats)}  # raises for the unknown one
        sizes = [f.size for f in flats]
        ids = np.concatenate(flats)  # [n], a copy: `rows` compares against it
        geometry = np.array([self._geometry[l] for l in layers], np.int64)  # [L, (rows, rows_per_page, first)]
        per_id = np.repeat(geometry, sizes, axis=0)  # [n, 3]
        if ids.size and (ids.view(np.uint64) >= per_id[:, 0].view(np.uint64)).any():
            for l, f in zip(layers, flats):
                self.pages(l, f)  # raises its error (an id out of range, negative too)
        local, within = np.divmod(ids, per_id[:, 1])
        pages = local + per_id[:, 2]  # global pages: tables are disjoint and ascend with the layer
        uniq, inverse = np.unique(pages, return_inverse=True)
        inverse = inverse.reshape(-1)
        bounds = np.cumsum([0] + sizes)
        starts = np.searchsorted(uniq, geometry[:, 2]).tolist() + [len(uniq)]  # each layer's first unique page
        ulist = uniq.tolist()
        out = {}
        for i, l in enumerate(layers):
            a, b = int(bounds[i]), int(bounds[i + 1])
            out[l] = (ids[a:b], ulist[starts[i]:starts[i + 1]], inverse[a:b] - starts[i], within[a:b])
        return out

    def pages(self, layer: int, ids: np.ndarray) -> tuple[list[int], np.ndarray, np.ndarray]:
        """`store.locate` and `unique_pages` at once, with the table's numbers looked up once: (the
        sorted distinct global pages, each id's index into them, each id's row within its page).
        Shapes: int [*S] -> P, [n], [n]"""
        geometry = self._geometry.get(layer)
        flat = np.asarray(ids, dtype=np.int64).reshape(-1)
        if geometry is None or (flat.size and int(flat.view(np.uint64).max()) >= geometry[0]):
            self.store.locate(layer, flat)  # raises its error: no table, or an id out of range (negative too)
        rows, rows_per_page, first = geometry
        local, within = np.divmod(flat, rows_per_page)
        upages, which = unique_pages(local)
        return [p + first for p in upages], which, within

    def decode(self, layer: int, slots: np.ndarray, within: np.ndarray, out: np.ndarray) -> None:
        """out[i] = row within[i] of the page in slot slots[i], as float32: a float row type is
        viewed in its dtype over the slots and cast (exact, as `decode_rows`), a quantized one
        decoded by the store's `decode_rows`. Shapes: slots [n], within [n] -> out float32 [n, width]"""
        view, typed = self._row_views[layer]
        if typed:
            out[:] = view[slots, within]
        else:
            out[:] = self.store.decode_rows(view[slots, within], out.shape[1])
