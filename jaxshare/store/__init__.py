"""The run store: a run directory's layout, its files written and read in one place (:mod:`~jaxshare.store.runs`),
its orbax checkpoints (:mod:`~jaxshare.store.checkpoint`) and their integrity manifests
(:mod:`~jaxshare.store.integrity`)."""
