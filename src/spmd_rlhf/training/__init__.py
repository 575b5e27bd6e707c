"""The training engine every trained role composes: the sharded model (built, parallelized, loaded, run in
micro-batches, exported), the packed and padded micro-batch layouts, micro-batch grouping, the DP reducer, the update
loop (``Trainer``) and the bound on skipped non-finite steps."""
