"""The former home of Qwen4-Exp's config part, now strata/families/qwen4_exp.py.

Kept only for the two benchmarks that still import it (benchmarks/qwen4_seed.py, qwen4_decode.py);
delete it when they import strata.families.qwen4_exp.
"""

from strata.families.qwen4_exp import *  # noqa: F401,F403
from strata.families.qwen4_exp import HC_FINAL, Qwen4Names, ngram_heads, ngram_table_sizes, ple_layers  # noqa: F401
