"""The fused routed-expert kernel for MLX's own record types: the affine 4- and 8-bit types (group
32 or 64, float16 or bfloat16 scales and biases; strata/formats/mlx_affine.py) and MXFP4
(strata/formats/mxfp4.py), read straight out of the arena by slot index, with gpt-oss's expert
biases and clamped SwiGLU (`ExpertAct`) where the records and the model have them.

The work split is the Q2_0 kernel's (kernels/moe.py: read its docstring): block (rank i, chunk c,
token t) computes FC hidden units of one selected expert and its share of the down projection, a
partial [D] output; the combine kernel sums the partials in a fixed order. Its preambles (host
slots, routing on the device) and the shared expert's blocks are moe.py's, unchanged; the Q2_0
body stays its own (its code forms are tuned to 2-bit words, and this file leaves it bit for bit
as it was).

Per code type, one decoder (template ints QK, BITS, DN), each product exact:
- affine, q unsigned: a uint32 word holds CPW = 32 / BITS codes; those below bit 23 (NLO of
  them) are masked in place, the rest in w >> (BITS * NLO). DN = 1 (CUDA, the emulator): the
  masked code with no exponent bits is the subnormal q 2^(s-149), x pre-scaled by 2^(85-s), so
  a product is q x 2^-64 and the word's sum times 2^64 is Σ q x (an AND and an FMA per code).
  DN = 0 (Metal, which may flush subnormals): the code under 1.0f's exponent, minus 1, is
  q 2^(s-23), x pre-scaled by 2^(23-s). Per word: scale * Σ q x + bias * Σ x (a word lies in
  one group: CPW divides the group).
- MXFP4, sign-magnitude e2m1 nibbles: DN = 1: the nibble's magnitude at bits 22-24 and its sign
  at bit 31 is the float e2m1 * 2^-126 (e2m1 is a float with 2 exponent bits, bias 1: subnormal
  below 1), x pre-scaled by 2^64, the word's sum times 2^62 (a shift, two ANDs, an OR and an
  FMA per code); DN = 0: the same bits with the exponent rebased, normal floats only. Per word:
  2^(e-127) * Σ e2m1 x.

Reads: a warp per gate/up row, each lane a uint32 word at lane + 32 i (128 contiguous bytes per
row and step), its group's scale (and bias) beside it; down: a thread per output row, its chunk's
FC * BITS / 8 bytes in 8- or 16-byte loads, at most DWORDS words per thread in flight (an 8-bit
row chunk is 32 bytes: holding all of a thread's rows at once would take 96 registers at D = 2880).

The body is in kernels/moe_native_source.py; this file holds its limits, block shapes, template
ints and the two public entries.

Shapes:
    arena uint8 [S, SLOT], x float32 [T, D] -> partials float32 [T, k*NCH, D]
"""

from __future__ import annotations

import functools

import mlx.core as mx

from strata.errors import ConfigError
from strata.formats.expert_record import RecordLayout
from strata.formats.mlx_affine import AFFINE_SPECS
from strata.formats.mxfp4 import BLOCK as MXFP4_BLOCK
from strata.formats.quant_types import QuantType
from strata.mlx_backend.kernels import moe
from strata.mlx_backend.kernels.launch import as_f32, float_params, index_const
from strata.mlx_backend.kernels.moe_native_source import ROUTE_SOURCE, SLOTS_SOURCE
from strata.model_config import ExpertKind, RoutingOrder
from strata.reference.experts import SWIGLU, ExpertAct

TYPES = frozenset(AFFINE_SPECS) | {QuantType.MXFP4}
DWORDS = 16  # down-step code words a thread holds in flight (64 bytes; 32 took 159 registers, sm_90)
SHARED_BYTES = 40 << 10  # x pre-scaled + its word sums in threadgroup memory: Q2_0's bound (moe.MAX_HIDDEN)


def _bits(qtype: QuantType) -> int:
    return 4 if qtype is QuantType.MXFP4 else AFFINE_SPECS[qtype].bits


def _group(qtype: QuantType) -> int:
    return MXFP4_BLOCK if qtype is QuantType.MXFP4 else AFFINE_SPECS[qtype].group


def _x_bytes(hidden: int, cpw: int, stride: int) -> int:
    return 4 * (hidden // cpw) * (stride + 1)  # x pre-scaled per code, and each word's sum


def x_stride(qtype: QuantType, hidden: int) -> int:
    """XW, floats per x word in threadgroup memory: CPW values, padded by 4 where a word is 8 or
    more codes (16-byte reads of 8 lanes then meet 8 different bank quads) and the padding fits
    (4-bit at hidden 7168 does not: dense rows, 2-way bank conflicts); 4 codes are 16 bytes, dense."""
    cpw = 32 // _bits(qtype)
    padded = cpw + 4 if cpw >= 8 else cpw
    return padded if _x_bytes(hidden, cpw, padded) <= SHARED_BYTES else cpw


def x_shared_bytes(qtype: QuantType, hidden: int) -> int:
    """Threadgroup bytes of x pre-scaled per code and its per-word sums."""
    return _x_bytes(hidden, 32 // _bits(qtype), x_stride(qtype, hidden))


def supports(rec: RecordLayout) -> str | None:
    """Why the kernel cannot run these records (None: it can)."""
    if rec.qtype not in TYPES:
        return f"{rec.qtype.name} is not an MLX type"
    if rec.expert_ffn % 32:
        return f"expert_ffn {rec.expert_ffn} is not a multiple of 32 (FC)"
    if (n := x_shared_bytes(rec.qtype, rec.hidden)) > SHARED_BYTES:
        return f"hidden {rec.hidden} needs {n} bytes of threadgroup memory (at most {SHARED_BYTES})"
    return None


# Block shapes. Decode: moe.py's (FC = 32, 256 threads, h in registers). Many tokens: FC = 64 as
# moe.py (half the down planes' L2 sectors per byte) but 256 threads, not 512: MLX's custom
# kernels cannot bound registers (__launch_bounds__), and 512 threads allow 128 a thread, which
# the 8-bit body passes (ptxas, sm_90).
MANY_TOKENS_SHAPE = moe.BlockShape(64, 256, True)


def block_shape(rec: RecordLayout, tokens: int) -> moe.BlockShape:
    """MXFP4 keeps FC = 32 for many tokens too: measured 43% of copy against FC = 64's 22% (H200,
    gpt-oss's experts, 64 tokens; FC = 64 then had its lane steps unrolled, now a loop: unmeasured)."""
    if (tokens >= moe.MANY_TOKENS and rec.expert_ffn % MANY_TOKENS_SHAPE.fc == 0
            and rec.qtype is not QuantType.MXFP4):
        return MANY_TOKENS_SHAPE
    return moe.DECODE_SHAPE


def _shape(rec: RecordLayout, tokens: int, fc: int | None, threads: int | None, hx: bool | None) -> moe.BlockShape:
    """`block_shape` with what the caller chose put in (an FC of its own gets 256 threads, h in registers)."""
    shape = block_shape(rec, tokens)
    if fc is not None and fc != shape.fc:
        shape = moe.BlockShape(fc, moe.THREADS, False)
    return moe.BlockShape(shape.fc, threads or shape.threads, shape.hx_shared if hx is None else hx)


# The gate/up lane steps (ULS) stay a loop: unrolled lost for every type measured (ncu, H200, D = F
# = 2880, 64 tokens x k = 4: 4-bit affine FC = 64 loop 2.51 ms, unrolled 3.64; MXFP4 FC = 32 loop
# 1.98 ms, unrolled 2.29); `unroll` keeps the form for the tests' bit-equality check.
@functools.cache
def _template(rec: RecordLayout, k: int, fc: int, threads: int, denormals: bool, hx_shared: bool,
              vector_loads: bool, act_kind: int, unroll: bool) -> tuple[tuple[str, int], ...]:
    if (why := supports(rec)) is not None or rec.expert_ffn % fc:
        raise ValueError(f"fused native experts: {why or f'F={rec.expert_ffn} is not a multiple of FC={fc}'}")
    q = rec.qtype
    off = {n: rec.codes(n).offset for n in ("gate", "up", "down")}
    sc = {n: rec.scales(n) for n in ("gate", "up", "down")}
    zp = {n: s.offset + s.nbytes // 2 for n, s in sc.items()}  # affine: the biases follow the scales
    assert all(v % 4 == 0 for v in zp.values())  # nq_s16 reads bfloat16 from aligned uint32 words (rows even)
    bias = {n: rec.bias(n).offset if rec.biases else 0 for n in ("gate", "up", "down")}
    return (("D", rec.hidden), ("F", rec.expert_ffn), ("FC", fc), ("NCH", rec.expert_ffn // fc), ("K", k),
            ("SLOT", rec.padded_bytes), ("XW", x_stride(q, rec.hidden)), ("QK", int(q is QuantType.MXFP4)), ("BITS", _bits(q)), ("G", _group(q)),
            ("SBF", int(q in AFFINE_SPECS and AFFINE_SPECS[q].bfloat16)),
            ("GC", off["gate"]), ("GS", sc["gate"].offset), ("GZ", zp["gate"]),
            ("UC", off["up"]), ("US", sc["up"].offset), ("UZ", zp["up"]),
            ("DC", off["down"]), ("DS", sc["down"].offset), ("DZ", zp["down"]),
            ("EB", int(rec.biases)), ("GB", bias["gate"]), ("UB", bias["up"]), ("DB_OFF", bias["down"]),
            ("ACT", act_kind), ("NT", threads), ("DN", int(denormals)), ("HX", int(hx_shared)),
            ("VL", int(vector_loads)), ("DWORDS", DWORDS), ("ULS", int(unroll)))


ACT_KINDS = {ExpertKind.SWIGLU: 0, ExpertKind.CLAMPED_SWIGLU: 1}  # ACT: the activations the body computes


def _act(act: ExpertAct) -> tuple[int, mx.array]:
    """(ACT, the act input: alpha and limit as a device constant)."""
    if act.kind not in ACT_KINDS:
        raise ConfigError(f"fused native experts: expert_kind {act.kind.value} has no kernel form")
    if act.kind is ExpertKind.SWIGLU:
        return 0, float_params(0.0, 0.0)
    return 1, float_params(float(act.alpha), float(act.limit))


def moe_slots(arena: mx.array, rec: RecordLayout, x: mx.array, slots, weights, *, act: ExpertAct = SWIGLU,
              fc: int | None = None, shared=None, threads: int | None = None, denormals: bool | None = None,
              hx_shared: bool | None = None, vector_loads: bool = True, unroll: bool = False):
    """Kernel path, host-chosen slots (moe.moe_slots for MLX's types). x [T, D], slots int [T, k]
    (-1 skip), weights [T, k] -> partials float32 [T, k * F/FC, D]; with shared (gate, up, down
    float16), (routed partials, shared partials [T, Fs/FCS, D]) from one launch. unroll: the gate/up
    lane steps unrolled (the loop by default)."""
    t, k = slots.shape
    slots, weights = moe.slot_inputs(slots, weights)
    fc, threads, hx_shared = _shape(rec, t, fc, threads, hx_shared)
    kind, act_in = _act(act)
    dn = moe.subnormal_codes() if denormals is None else denormals
    template = _template(rec, k, fc, threads, dn, hx_shared, vector_loads, kind, unroll)
    out, sout = moe._launch(SLOTS_SOURCE, rec, [arena, as_f32(x), slots, weights, act_in], t, k, fc, template,
                            shared, threads)
    return out if shared is None else (out, sout)


def moe_route(arena: mx.array, rec: RecordLayout, x: mx.array, z: mx.array, slot_base: int, k: int,
              order: RoutingOrder, norm_topk_prob: bool, *, act: ExpertAct = SWIGLU, fc: int | None = None,
              shared=None):
    """Kernel path, routing on the GPU (moe.moe_route for MLX's types; every expert resident at
    slot_base + e). x [T, D], z [T, E] -> partials float32 [T, k * F/FC, D] (with shared: a pair)."""
    if order not in (RoutingOrder.SOFTMAX_TOPK, RoutingOrder.TOPK_SOFTMAX):
        raise ConfigError(f"moe_route: the routing kernel has no rule {order.value} (route with routing.select_device)")
    t, e = z.shape
    fc, threads, hx = _shape(rec, t, fc, None, None)
    kind, act_in = _act(act)
    routing = (("E", e), ("ORDER", 0 if order is RoutingOrder.SOFTMAX_TOPK else 1), ("NORM", int(norm_topk_prob)))
    template = _template(rec, k, fc, threads, moe.subnormal_codes(), hx, True, kind,
                         False) + routing
    out, sout = moe._launch(ROUTE_SOURCE, rec, [arena, as_f32(x), as_f32(z), index_const(slot_base), act_in], t, k,
                            fc, template, shared, threads)
    return out if shared is None else (out, sout)
