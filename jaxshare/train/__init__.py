"""Training: the optimizer and recipes, the train step, the train state and its shardings, metrics and the loop
(run directories: :mod:`jaxshare.store.runs`; checkpoints: :mod:`jaxshare.store.checkpoint`)."""
