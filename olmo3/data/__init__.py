"""Token files, global order, repetition filter, Grain pipeline, held-out sets, prepare and audit."""
