"""Named error budgets (STYLE §7): every tolerance the suite uses, in one place, with why.

Two forms: `Budget` (relative L2 and relative max error of a whole array, for the MLX backend's
differential tests: `mlx_agree.assert_backends_agree`) and numpy's rtol/atol pairs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Budget:
    rel_l2: float  # ||fast - ref|| / ||ref||
    max_rel: float  # max |fast - ref| / max |ref|


# The MLX twin vs the float32 reference. FAST: the same (float16-exact) weights; only the order
# of float32 sums and the GPU's exp/sqrt differ (the compiled CPU kernels too, every type: x stays
# float32; a K-quant's or Q5_1's weight a * level + o built in one fused multiply-add, an ulp at
# most from the reference's; seen 1e-7 to 4e-7 relative). FORWARD: the same for whole-model logits, where
# that rounding compounds through every layer's norms, softmaxes and residual sums (seen: 2.3e-5
# relative on the tiny model's ops path). QUANTIZED: a quantized stand-in vs its float original
# (the Q8_0 read-ahead router vs the F32 router). EXACT: bit for bit. ROUTING: selected experts
# exactly, weights to float32 reordering.
BUDGETS = {
    "EXACT": Budget(0.0, 0.0),
    "FAST": Budget(rel_l2=2e-5, max_rel=1e-4),
    "FORWARD": Budget(rel_l2=1e-4, max_rel=5e-4),
    "ROUTING": Budget(rel_l2=1e-5, max_rel=1e-5),
    "QUANTIZED": Budget(rel_l2=2e-2, max_rel=5e-2),
    # the MLX prompt path (mlx_backend/prompt.py) vs the float32 reference. Its projections and
    # experts take activations as two float16 terms on float16-exact weights (lowp.py: float32
    # level, seen 1.4e-6 with attention in float32); what is left is attention's float16 q, k, v
    # (the fused kernel's inputs; its probabilities are float16 inside too): seen up to 3.8e-3
    # relative L2 and 1.0e-2 max on the tiny made shapes, on prompts whose selections are decided
    # by more than float16 noise (below that, another expert is a legitimate outcome)
    "PROMPT": Budget(rel_l2=5e-3, max_rel=1.5e-2),
    # a float16 KV cache (KVPrecision.F16) on both sides: FAST's float32 reordering may put a key
    # or value on the other side of a binary16 rounding boundary, one half ulp (2^-11 relative)
    # apart on that element, and the attention output carries it
    "KV16": Budget(rel_l2=2e-4, max_rel=1e-3),
    # the MLA decode kernels (absorbed form) vs the reference's: the softmax scale folded into the
    # query, the latent sums split over row groups and flash-decoding splits; float32 reordering
    # as FAST, held to FAST's bound (seen 3e-7 to 6e-7 relative on the emulator)
    "MLA_KERNEL": Budget(rel_l2=2e-5, max_rel=1e-4),
    # the kernels for llama.cpp's types (kernels/ggml_dot.py) vs the reference's dequantize-then-
    # matmul: per 32 or 16 weights scale x Σ q p (minus min x Σ p) where the reference rounds
    # (d·sc)·q − dmin·m per weight; float32 reordering, held to FAST's bound
    "GGML_KERNEL": Budget(rel_l2=2e-5, max_rel=1e-4),
}

# float32 reference vs float32 reference computed another way (reordered sums, chunked prefill,
# a window of T positions against T single decodes)
FLOAT32_REORDER = dict(rtol=1e-4, atol=1e-4)
# the same, per position as max |Δlogit| / max |logit|, where a position is ill-conditioned: the
# made hybrid's third windowed position differs from the batched forward by 1.6e-4 (window) and
# 3.1e-4 (single decodes) at logits of scale 4.0 under OpenBLAS 0.3.31 (numpy 2.4.6), ~4e-5 and
# 8e-5 of the scale, every other position under 1e-5 absolute: float32 reordering amplified
# there, not a different path (the same three elements move on both sides); also the read-ahead
# guess a row at a time against a [T, D] matmul (one element 5.4e-6 off at scale ~55, 1e-7 of it)
FLOAT32_REORDER_OF_SCALE = 1e-4

# float32 softmax over <= 64 logits in [-16, 16] vs float64: the subtraction z - max errs by at
# most 2^-20 (absolute, so relative after exp), exp by a few ulp, the sum by E·2^-24 <= 2^-18,
# the (re)normalization by a few ulp more: under 2^-17; the budget is twice that.
WEIGHT_RTOL = 2.0**-16
# hand-written expected weights are typed to 6 decimals (5e-7), plus float32 rounding
HAND_WEIGHT_ATOL = 1e-6

# converted checkpoints vs transformers (float32) on tiny random models
F16_LOGIT_BUDGET = 1e-3  # max |Δlogit| / max |logit|, f16 experts
Q8_ARGMAX_AGREEMENT = 0.99  # fraction of positions with the same argmax, q8_0 experts
Q2_KLD_SANITY = 1.0  # nats: q2_0 is lossy; this only catches a broken conversion (uniform ~ 5.8)
# the hybrid families (Qwen3-Next, Qwen3.5-MoE) are held to their issue's tighter bound; seen:
# 4.0e-4 and 3.7e-4 with f16 experts, 1.8e-6 with f32 experts (the rest is f16 rounding)
HYBRID_F16_LOGIT_BUDGET = 5e-4
# Qwen4-Exp (tests/convert/test_convert_qwen4.py): f16 experts vs transformers, as the hybrids
QWEN4_F16_LOGIT_BUDGET = 5e-4
# the QSA parity is only meaningful where no tie decides a selection: the last chosen block's
# score must exceed the first left out by this fraction of the best score: 10x the float32
# reordering error the logits show (8e-7 of scale)
QSA_TIE_MARGIN = 1e-5
# the sigmoid-routed families (DeepSeek-V3 with and without YaRN, GLM-4.5, GLM-4.7-Flash,
# MiniMax-M2: tests/convert/test_convert_sigmoid.py, tests/convert/test_convert_deepseek_yarn.py) are held to
# their issue's bound, as the hybrids; f16 experts, the rest float32
SIGMOID_F16_LOGIT_BUDGET = 5e-4

# strata's reference forward vs mlx-lm's on the same MLX-quantized checkpoint, both in float32
# activations (mlx-lm's norms, scales and biases widened: exact): the weights are the same
# values, only the order of float32 sums differs (seen 8.6e-7 on qwen3_moe 4-bit group 64)
MLX_LM_LOGIT_BUDGET = 1e-5  # max |Δlogit| / max |logit|

# tier 2 (mlx-lm's forward, the checkpoint's bfloat16 activations) vs the native path on the same
# checkpoint converted by `strata convert` (float32 activations): the weights are the same values,
# the activations are rounded to bfloat16 between mlx-lm's ops (seen 9.5e-3 to 5.6e-2 of the scale
# on the tiny recipes; docs/models.md gives 5e-2 to 1.2e-1 for mlx-lm's 16-bit forward vs float32).
# With mlx-lm's dense parameters widened to float32 the two meet MLX_LM_LOGIT_BUDGET (seen 2.4e-7).
TIER2_BF16_LOGPROB_BUDGET = 0.15  # max |Δ log-probability| / max |log-probability|

# strata's reference forward on a converted llama.cpp GGUF vs transformers' float32 forward on
# the GGUF's own dequantized weights (experts kept bit for bit): the same values on both sides,
# only float32 summation order differs (seen 4.9e-7 to 8.1e-7 on the four tiny families)
GGUF_DEQUANT_LOGIT_BUDGET = 1e-5  # max |Δlogit| / max |logit|
# the same comparison when the experts were requantized (ggml MXFP4 -> Q8_0): a lossy step whose
# KLD the converter prints; same argmax at this fraction of positions (seen 100%)
REQUANT_ARGMAX_AGREEMENT = 0.95

# pipeline tests (tests/pipeline/test_pipeline.py): the wall-clock bounds on a run of local processes on a
# loaded 2-core machine (a healthy 3-rank run takes ~6 s here), and the deadline each rank's
# watchdog gives a neighbour in the failure tests (a hang would otherwise be the test's timeout)
PIPELINE_RUN_S = 120.0
PIPELINE_FAULT_DEADLINE_S = 8.0

# distribution tests (fixed seeds, so each is deterministic): a chi-square p-value below this
# fails. At 1e-3 a correct sampler fails one seed choice in a thousand; a sampler that drops or
# doubles a token's mass by 10% fails at the draw counts used (thousands) with p < 1e-6.
CHI_SQUARE_P = 1e-3

# the checked-in transformers outputs (tests/fixtures) vs transformers recomputing them where torch
# is installed (tests/test_hf_fixtures.py). RECOMPUTE: the same checkpoint, another torch or CPU:
# float32 summation order only (seen 0 on the machine that wrote them). REBUILD: the checkpoint
# trained again: float32 drift between torch builds flips single bf16 roundings of the saved
# weights (2^-8 relative each); a changed recipe (steps, learning rate, seed, corpus) moves the
# logits by tens of percent of their scale (seen 0 on the machine that wrote them).
FIXTURE_RECOMPUTE_BUDGET = 1e-5  # max |Δlogit| / max |logit|
FIXTURE_REBUILD_BUDGET = 2e-2  # max |Δlogit| / max |logit|

# gpt-oss converted vs transformers (float32) on the tiny checkpoints of tests/hf_gpt_oss.py.
# f16 experts from the bf16 checkpoint: bf16 values are exact in f16, only f16 dense rounding and
# float32 order remain (seen 1.3e-6); the bound is 5e-4 of the logit scale
GPT_OSS_F16_LOGIT_BUDGET = 5e-4
# MXFP4 experts kept bit for bit vs transformers' own dequantization of the same blocks: the same
# values on both sides, float32 summation order only (seen 1.1e-6)
GPT_OSS_MXFP4_LOGIT_BUDGET = 1e-5
# transformers computes RoPE's inverse frequencies in float32 (base ** (i / dim), YaRN's ramp);
# the reference in float64: a few float32 roundings apart
ROPE_F32_RTOL = 1e-6

# PLE read-ahead timing (tests/runtime/test_runtime_ngram_rows.py): a sleep-timed layer loop (100 ms a
# layer) on a loaded 2-core machine. A wait the read-ahead hid is this close to zero (seen under
# 1 ms idle); a wait it could not hide is the delay less the layers before, to within the same
# slack. Thread wake-ups under a load average of 500 added up to 26 ms (seen), hence 40.
PLE_WAIT_SLACK_S = 0.04
# ... a wait it could only partly hide, from above, in the full suite's -n 2 run beside the
# emulator's compiles: the reader threads' wake-ups added 45 ms (seen). Half of the 200 ms layer
# that tests/runtime/test_runtime_ngram_rows.py's read-ahead hides is 100: this still tells "one layer
# hidden" (delay - 200 ms) from "nothing hidden" (the delay).
PLE_WAIT_LOADED_S = 0.08
# peak RSS of writing and streaming a row store, beyond the row cache and one shard: allocator
# arenas, lazily imported modules, numpy's temporaries (as test_convert_streaming's RSS_SLACK)
PLE_RSS_SLACK = 32 << 20

# dense weights as stored (tests/formats/test_formats_dense_weights.py): a made model whose dense part is
# 120 MB in float32, loaded with Q8_0 dense and decoded on the reference in a fresh process, may
# grow its peak resident set by at most this share of the float32 size. Measured 0.48 here (57 MB):
# the stored 32 MB (0.27), the tensors a layer widens at once and the heap numpy keeps after them
# (~14 MB), one prefill's transients (~11 MB). Float32 at load grew it by 1.11 (133 MB).
PEAK_RSS_SHARE_OF_F32 = 0.6

# greedy selection on the device (strata/mlx_backend/greedy.py) vs the host's: the same token
# always (EXACT), its log-probability as a float32 max-subtracted log-sum-exp where the host's
# log_softmax sums in float64 over the same float32 logits: a few float32 roundings of values
# of order 1-10 (seen 7.2e-7 on a 512-token vocabulary, MLX's CPU build)
DEVICE_LOGPROB_ATOL = 1e-5
# an FP8 checkpoint converted (its values in float32) vs the same values rounded to bfloat16 (what
# transformers' dequantize=True loads), f32 experts: bf16's 2^-9 relative rounding of every linear
# weight. A max-|Δlogit| budget does not fit: where two experts' scores nearly tie, the rounding
# picks the other one (seen on Qwen3-MoE's fixture: 129 of 131 positions under 3.2e-3 of scale, one
# at 7.9e-2); mean KLD, seen 5.4e-6 nats there, is held to ~200x that
FP8_BF16_KLD_BUDGET = 1e-3

# the MTP layer's reference (strata/reference/mtp.py) vs transformers' Qwen3-Next decoder layer and
# norms wired as the serving code's MTP forward, both float32: summation order only (seen 5.8e-7)
MTP_REFERENCE_LOGIT_BUDGET = 1e-5  # max |Δlogit| / max |logit|
