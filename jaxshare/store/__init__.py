"""The run store: a run directory's layout, its files written and read in one place (:mod:`~jaxshare.store.runs`),
its orbax checkpoints (:mod:`~jaxshare.store.checkpoint`), their integrity manifests
(:mod:`~jaxshare.store.integrity`) and the distillation teacher a run records (:mod:`~jaxshare.store.teacher`)."""
