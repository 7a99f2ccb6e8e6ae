"""Parallelism applied to a model from outside: the layout (`dims`), processes (`launch`), collectives,
tensor, data and pipeline parallelism, recompute, and `parallelize`, which applies them in one order."""
