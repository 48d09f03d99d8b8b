"""Training: the train step, train-state layout and resume, a run's checkpoints, the loop."""
