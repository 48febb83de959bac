"""Training: target replicas and what they ship, ranks and transport, the drafter step, stop
control, checkpoints, compilation, metrics, and the loops."""
