// Stand-in for CUDA's <cooperative_groups.h> (tests/mlx_backend/test_metal_compile.py's CUDA check).
#pragma once
namespace cooperative_groups {}
