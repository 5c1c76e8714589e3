"""The numpy backend: the reference's arithmetic as an engine and as the streaming runtime's parts.

    arena    NumpyArena: slots in one page-aligned host mapping
    compute  NumpyCompute: the LayerCompute seam on the reference layer pieces
    engine   ReferenceEngine (all experts resident) and streaming_parts
"""
