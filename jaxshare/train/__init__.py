"""Training: optimizer recipes, the jitted train/eval steps, checkpoints, metrics and the loop."""
