"""One kernel, three dialects: the source MLX (or the emulator) compiles for a shared body.

`KernelSource` is a body written once against the names of `preludes.py`. `mlx_source(...)`
returns the dialect's (header, body) pair as `mx.fast.metal_kernel` / `mx.fast.cuda_kernel` take
them; `full_source(...)` returns the whole translation unit the way MLX assembles it (MLX
generates the signature from the input/output names and dtypes; see MLX's
`mlx/backend/metal/custom_kernel.cpp::write_signature` and `mlx/backend/cuda/custom_kernel.cpp::
build_kernel`), which is what the compile checks (tests/mlx_backend/test_metal_compile.py) and the emulator
build.

Rules every body keeps (they make the dialects agree):
- every input has at least `MIN_INPUT_SIZE` elements (`launch` pads smaller ones), so Metal passes
  all of them as `const device T*` (MLX puts arrays under 8 elements in `constant` space);
- compile-time sizes are int template arguments; runtime scalars travel in small int32/float32
  arrays;
- the grid is whole blocks (`grid = (blocks * NT, y, z)`, threadgroup `(NT, 1, 1)`), because Metal
  dispatches threads (partial last group) and CUDA dispatches whole blocks;
- no early return before a barrier; branches around barriers are block-uniform.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass

import numpy as np

from strata.mlx_backend.kernels.preludes import BODY, HEADER, Dialect

MIN_INPUT_SIZE = 8  # MLX Metal: arrays smaller than this are bound in the constant address space

# dtype name (numpy spelling) -> the type MLX writes in the generated signature
METAL_TYPES = {"uint8": "uint8_t", "int8": "int8_t", "uint16": "uint16_t", "int16": "int16_t",
               "uint32": "uint32_t", "int32": "int32_t", "uint64": "uint64_t", "int64": "int64_t",
               "float16": "float16_t", "bfloat16": "bfloat16_t", "float32": "float", "bool": "bool"}
CUDA_TYPES = {**METAL_TYPES, "float16": "__half", "bfloat16": "__nv_bfloat16"}
EMU_TYPES = {**METAL_TYPES, "float16": "half_t", "bfloat16": "uint16_t"}

# Metal kernel attributes MLX adds to the signature when their name appears in the body, in
# MLX's order (mlx/backend/metal/custom_kernel.cpp).
METAL_ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"), ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"), ("grid_origin", "uint3"), ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"), ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"), ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"), ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"), ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"), ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"), ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"), ("threads_per_simdgroup", "uint"), ("threads_per_threadgroup", "uint3"),
)

# What MLX puts in front of a Metal kernel's header (`metal::utils()`: metal_stdlib and its type names).
METAL_MLX_PREAMBLE = "#include <metal_stdlib>\nusing namespace metal;\ntypedef bfloat bfloat16_t;\ntypedef half float16_t;\n"
# MLX's CUDA default header (mlx/backend/cuda/custom_kernel.cpp).
CUDA_MLX_PREAMBLE = ('#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
                     "#define inf cuda::std::numeric_limits<float>::infinity()\n\n")


@dataclass(frozen=True)
class KernelSource:
    """A kernel body shared by every dialect.

    `helpers` are device functions (dialect-neutral, through the prelude's macros) placed after
    the prelude in the header; `body` is the kernel's body (MLX writes the signature).
    """

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    body: str
    helpers: str = ""
    metal: bool = True  # False: CUDA and the emulator only (blocks that count and wait on one another)

    def __post_init__(self) -> None:
        if re.search(r"\buint\b", self.body + self.helpers):
            raise ValueError(f"kernel {self.name}: write uint32_t, not uint (CUDA has no uint)")
        for n in self.inputs + self.outputs:
            if not re.fullmatch(r"[a-z_][a-z0-9_]*", n):
                raise ValueError(f"kernel {self.name}: bad argument name {n!r}")


def expand(body: str, **snippets: str) -> str:
    """body with each line that is only a snippet's name replaced by the snippet, indented alike."""
    def one(m: re.Match) -> str:
        return textwrap.indent(textwrap.dedent(snippets[m.group(2)]).strip("\n"), m.group(1)) + "\n"
    return re.sub(r"^( *)(" + "|".join(snippets) + r")\n", one, body, flags=re.MULTILINE)


def compact(text: str) -> str:
    """C source without comments, indentation or blank lines, runs of spaces outside string
    literals made one; line breaks kept (preprocessor lines end there).

    Why: MLX's CUDA build hashes a custom kernel's whole source (`std::hash` in
    CustomKernel::eval_gpu, to name its JIT module) on every evaluation, compiled replays
    included, and rewrites it on every call it builds; a decoded token evaluates ~48 KB of our
    sources per layer (the expert kernel alone ~15 KB)."""
    out = []
    for line in text.splitlines():
        parts = line.split('"')  # even indices: outside string literals (no escaped quotes in ours)
        for i in range(0, len(parts), 2):
            cut = parts[i].find("//")
            if cut >= 0:
                parts = parts[:i] + [parts[i][:cut]]
                break
        # no space next to ( ) { } ; , : none of them joins a neighbour into another token (but a
        # preprocessor line keeps its spaces: `#define NEG_BIG (-3.0e38f)` is not a macro function)
        tight = not line.lstrip().startswith("#")
        parts = [(re.sub(r" ?([(){};,]) ?", r"\1", re.sub(r"\s+", " ", q)) if tight else re.sub(r"\s+", " ", q))
                 if i % 2 == 0 else q for i, q in enumerate(parts)]
        line = '"'.join(parts).strip()
        if line:
            out.append(line)
    return "\n".join(out) + "\n"


def mlx_source(src: KernelSource, dialect: Dialect) -> tuple[str, str]:
    """(header, source) as `mx.fast.metal_kernel` / `mx.fast.cuda_kernel` take them (compacted
    for the GPU dialects: `compact` says why; the emulator's stays as written)."""
    header, body = HEADER[dialect] + src.helpers, BODY[dialect] + src.body
    if dialect is Dialect.EMU:
        return header, body
    header, body = compact(header), compact(body)
    return (used_only(header, body) if dialect is Dialect.CUDA else header), body


_IDENT = re.compile(r"[A-Za-z_]\w*")


def _top_level_items(text: str) -> list[str]:
    """Compacted C split into its top-level items: a preprocessor line, or the lines up to where
    the braces close again at a `}` or `;`."""
    out, cur, depth = [], [], 0
    for line in text.splitlines():
        cur.append(line)
        if line.startswith("#"):
            if depth == 0:
                out.append("\n".join(cur))
                cur = []
            continue
        depth += line.count("{") - line.count("}")
        if depth == 0 and line.endswith(("}", ";")):
            out.append("\n".join(cur))
            cur = []
    if cur:
        out.append("\n".join(cur))
    return out


def _defines(item: str) -> str | None:
    """The name a top-level item defines (a macro, struct, typedef or INLINE function), or None."""
    for pattern in (r"#define (\w+)", r"(?:struct|union) (\w+)", r"typedef [^;]*?(\w+);$", r"INLINE [^(]*?(\w+)\("):
        m = re.match(pattern, item)
        if m:
            return m.group(1)
    return None


def used_only(header: str, body: str) -> str:
    """The compacted header's items the body reaches (by name, through the items it keeps), in
    their order; an item whose name is not recognised is kept.

    Why: MLX's CUDA build hashes a kernel's whole source on every evaluation (`compact`), and
    every kernel carried the whole 6 KB prelude: ~0.8-1.3 KB of it are what a decode kernel
    uses, ~25 KB a layer less to hash (~4 us a layer at the ~0.17 us a KB measured)."""
    items = _top_level_items(header)
    names = [_defines(i) for i in items]
    keep = [n is None for n in names]
    need = set(_IDENT.findall(body))
    grew = True
    while grew:
        grew = False
        for k, (item, name) in enumerate(zip(items, names)):
            if not keep[k] and name in need:
                keep[k] = grew = True
                need |= set(_IDENT.findall(item))
    return "".join(item + "\n" for item, kept in zip(items, keep) if kept)


def dtype_name(dtype) -> str:
    """numpy spelling of an MLX or numpy dtype ('float16', 'uint8', ...)."""
    s = str(dtype)
    return s.split(".")[-1] if "." in s else np.dtype(s).name


def kernel_name(src: KernelSource, dialect: Dialect, template: tuple[tuple[str, int], ...]) -> str:
    suffix = "_".join(str(int(v)) for _, v in template)
    return f"custom_kernel_{src.name}" + (f"_{suffix}" if suffix else "")


def _metal_signature(src, name, in_types, out_types, template) -> str:
    header, body = mlx_source(src, Dialect.METAL)
    out = [METAL_MLX_PREAMBLE, header]
    if template:
        out.append("template <" + ", ".join(f"int {k}" for k, _ in template) + ">\n")
    params = [f"  const device {METAL_TYPES[t]}* {n} [[buffer({i})]]" for i, (n, t) in enumerate(zip(src.inputs, in_types))]
    base = len(src.inputs)
    params += [f"  device {METAL_TYPES[t]}* {n} [[buffer({base + i})]]" for i, (n, t) in enumerate(zip(src.outputs, out_types))]
    params += [f"  {ty} {attr} [[{attr}]]" for attr, ty in METAL_ATTRIBUTES if attr in body]
    out.append(f"[[kernel]] void {name}(\n" + ",\n".join(params) + ") {\n" + body + "\n}\n")
    if template:
        args = "<" + ", ".join(str(int(v)) for _, v in template) + ">"
        out.append(f'\ntemplate [[host_name("{name}")]] [[kernel]] decltype({name}{args}) {name}{args};\n')
    return "".join(out)


def _cuda_source(src, name, in_types, out_types, template) -> str:
    header, body = mlx_source(src, Dialect.CUDA)
    params = [f"    const {CUDA_TYPES[t]}* {n}" for n, t in zip(src.inputs, in_types)]
    params += [f"    {CUDA_TYPES[t]}* {n}" for n, t in zip(src.outputs, out_types)]
    consts = "".join(f"  constexpr int {k} = {int(v)};\n" for k, v in template)
    return (CUDA_MLX_PREAMBLE + header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            f"__global__ void {name}(\n" + ",\n".join(params) + ") {\n" + consts + "\n" + body
            + "\n}\n\n} // namespace mlx::core::cu\n")


def _emu_source(src, name, in_types, out_types, template) -> str:
    header, body = mlx_source(src, Dialect.EMU)
    params = [f"const {EMU_TYPES[t]}* {n}" for n, t in zip(src.inputs, in_types)]
    params += [f"{EMU_TYPES[t]}* {n}" for n, t in zip(src.outputs, out_types)]
    consts = "".join(f"  constexpr int {k} = {int(v)};\n" for k, v in template)
    casts = [f"(const {EMU_TYPES[t]}*)a[{i}]" for i, t in enumerate(in_types)]
    casts += [f"({EMU_TYPES[t]}*)a[{len(in_types) + i}]" for i, t in enumerate(out_types)]
    return (header + f"static void {name}(" + ", ".join(params) + ") {\n" + consts + body + "\n}\n\n"
            'extern "C" int strata_launch(void** a, int gx, int gy, int gz, int nt) {\n'
            f"  return strata_emu::run_grid(gx, gy, gz, nt, [&]() {{ {name}({', '.join(casts)}); }});\n}}\n")


def full_source(src: KernelSource, dialect: Dialect, in_types: tuple[str, ...], out_types: tuple[str, ...],
                template: tuple[tuple[str, int], ...]) -> str:
    """The translation unit MLX compiles for this body, argument dtypes and template.

    in_types / out_types are numpy dtype names ('uint8', 'float16', 'float32', ...).
    For EMU the unit ends in `extern "C" strata_launch(args, gx, gy, gz, nt)` (see emulate.py).
    """
    if len(in_types) != len(src.inputs) or len(out_types) != len(src.outputs):
        raise ValueError(f"kernel {src.name}: {len(src.inputs)} inputs / {len(src.outputs)} outputs expected")
    name = kernel_name(src, dialect, template)
    build = {Dialect.METAL: _metal_signature, Dialect.CUDA: _cuda_source, Dialect.EMU: _emu_source}[dialect]
    return build(src, name, tuple(in_types), tuple(out_types), tuple(template))
