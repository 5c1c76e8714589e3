"""Test aids kept out of production modules: made models, synthetic traces, synthetic MLX params.

    models      make_model(path, shape, seed): small valid models (`strata make-model`)
    traces      synthetic router traces for the analysis kit
    mlx_params  synthetic MlxParams at the reference engine's shape (benchmarks, kernel tests)
    sharing     calls interleaved on one Model by iterators and threads (the sharing test, the API fuzz)

Benchmarks and tests share these makers, so a made model is built one way everywhere.
"""
