"""Cross-layer similarity analysis of attention maps and weights (``python -m jaxshare.analysis``).

:mod:`~jaxshare.analysis.similarity` holds the numpy metrics, :mod:`~jaxshare.analysis.plots` the figures and
``__main__`` the command line that runs a trained model on sampled text.
"""

from __future__ import annotations

from jaxshare.analysis.similarity import (ScheduleSuggestion, adjacent_cosine, best_earlier_match, causal_softmax,
                                          cosine_matrix, head_js_matrix, head_matching, js_divergence,
                                          js_divergence_matrix, suggest_schedule, weight_head_similarity)

__all__ = ["ScheduleSuggestion", "adjacent_cosine", "best_earlier_match", "causal_softmax", "cosine_matrix",
           "head_js_matrix", "head_matching", "js_divergence", "js_divergence_matrix", "suggest_schedule",
           "weight_head_similarity"]
