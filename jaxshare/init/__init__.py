"""Initialisation from another model: every rule that maps a source model's weights to a sharing schedule's, each
written once, and the report of which rule built each tensor.

- :mod:`~jaxshare.init.source`: the entry points: fresh parameters, and a source's converted by the rules below;
- :mod:`~jaxshare.init.shared`: tensors both models have, copied;
- :mod:`~jaxshare.init.kv`: K/V heads and layers pooled into a K/V-sharing schedule's producers;
- :mod:`~jaxshare.init.mlp`: MLPs widened or narrowed for parameter matching;
- :mod:`~jaxshare.init.compensation`: UniAttn's W_c fitted on calibration batches (Theorem 3.1);
- :mod:`~jaxshare.init.lisa`: LISA's low-rank factors (the ``ds``, ``fit`` and ``calibrated`` starts);
- :mod:`~jaxshare.init.headwise`: DirectShare's head ties and PostShare's pairs (chosen once per run);
- :mod:`~jaxshare.init.report`: one line per rule applied.

Hugging Face names stay in :mod:`jaxshare.convert`; this package maps jaxshare parameters to jaxshare parameters.
"""
