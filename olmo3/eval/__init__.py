"""Evaluation: the evaluator, held-out LM loss, downstream tasks, the generalization-gap alarm."""
