"""Pipeline stages over `mx.distributed`: each rank computes a contiguous range of layers,
holds only those layers' dense weights and streams only those layers' experts into its own
arena with its own expert cache (docs/pipeline.md).

    plan        which layers each stage owns (split by bytes, or as given)
    experts     a stage's view of the `.experts` file (its MoE layers as local indices)
    stage       a stage's engine: the runtime's StreamingEngine over a layer range
    transport   framed messages between neighbouring ranks, with a deadline on every wait
    engine      PipelineEngine (rank 0: the session the generation loop drives) and serve_stage
    report      per-stage stream reports merged into one
    launch      `mlx.launch` command lines and the per-rank entry point
"""

from strata.pipeline.plan import PipelineOptions, StagePlan, plan_stages

__all__ = ["PipelineOptions", "StagePlan", "plan_stages"]
