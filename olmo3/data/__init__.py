"""Data: sources (the entrance), token files, global order, repetition filter, the Grain
pipeline (the exit), held-out sets, prepare and audit."""
