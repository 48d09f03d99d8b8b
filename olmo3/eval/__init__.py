"""Held-out LM loss, downstream tasks, the generalization-gap alarm."""
