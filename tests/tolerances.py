"""Named error budgets (STYLE §7): one place, no inline tolerance per assert."""

# float32 reference vs float32 reference computed another way (reordered sums, chunked prefill)
FLOAT32_REORDER = dict(rtol=1e-4, atol=1e-4)
