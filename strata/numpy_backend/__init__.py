"""The numpy backend: the reference's arithmetic as an engine and as the streaming runtime's parts.

    arena         NumpyArena: slots in one page-aligned host mapping
    compute       NumpyCompute: the LayerCompute seam on the reference layer pieces
    engine        ReferenceEngine (all experts resident) and streaming_parts
    grouped       routed experts grouped by expert (the prompt path and the streaming compute)
    prompt        prompt_forward: the all-resident prompt path
    quant_kernels the compiled twins of the quantized products, and CpuOps (which products an engine uses)
    native_build  builds native/quant_gemv.c at first use (docs/cpu.md)
"""
