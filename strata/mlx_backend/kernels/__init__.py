"""Custom kernels: one body per kernel shared by Metal, CUDA and the CPU emulator.

preludes.py  the per-dialect names (thread ids, warp reductions, barriers, half types)
source.py    KernelSource and the translation units MLX (or the emulator) compiles
paths.py     KernelPath (GPU / EMULATED / OPS) and the path in force
launch.py    build-once, launch (the kernel plan's graph views, device constants)
phases.py    dependent launches as one (where the kernel plan's chained_launches)
emulate.py   the CPU emulator dialect
q8_gemv.py, moe.py, shared.py, attention.py, router.py, combine.py, dense_gemv.py, embed.py   the bodies
"""
