"""LISA distillation's teacher (``train.kd_teacher``, LISA Sec. 5.1, Eq. 5-7): the frozen model whose attention
logits the student's LISA layers are pulled towards.

The teacher is the dense model the student's layers were converted from. A run converted by ``convert uptrain``
records it in its config (``train.kd_teacher``: the source when the source is dense, else what the source recorded),
so a student uptrained from a converted run distils from that dense model, not from the conversion, whose logits on
the LISA layers are the student's own at step 0. A teacher the defaults find that is not dense is refused: naming it
in ``train.kd_teacher`` is the only way to distil from it.
"""

from __future__ import annotations

from jax.sharding import Mesh

from jaxshare.config import ConfigError, ModelConfig, TrainConfig
from jaxshare.init.source import same_tokenizer
from jaxshare.plan import ModelPlan
from jaxshare.store import runs

# what the teacher's model must share with the student's: its logits are compared per layer, head and token
_MATCHED = ("num_layers", "num_heads", "vocab_size")


def is_dense(plan: ModelPlan) -> bool:
  """Whether every layer of ``plan`` computes its own scores from its own K/V with every head, untied."""
  heads = plan.model.num_heads
  return plan.schedule.tied_heads == 0 and all(
    p.is_producer and p.has_query_key and not p.score_reuse and p.num_kv_heads == heads for p in plan.schedule.layers)


def recorded_teacher(src: runs.Run) -> str:
  """What a run converted from ``src`` records as its teacher: ``src`` itself when dense (its directory), else what
  ``src`` recorded (``""``: nothing)."""
  return str(src.directory) if is_dense(src.plan) and src.directory is not None else src.cfg.train.kd_teacher


def resolve_teacher(t: TrainConfig, model: ModelConfig, tokenizer: str, source: runs.Run | None, mesh: Mesh
                    ) -> runs.Run | None:
  """The teacher of a run of training settings ``t``, model ``model`` and ``data.tokenizer`` ``tokenizer`` (None
  without distillation), loaded onto ``mesh``: ``train.kd_teacher`` when set; else the teacher the
  ``train.init_from`` run ``source`` records; else ``source``.

  Raises:
    ConfigError: a teacher found by default that is not dense, or a teacher whose layers, heads, vocabulary or
      tokenizer differ from the student's. CheckpointError: an unreadable teacher run.
  """
  if t.kd_beta == 0:
    return None
  recorded = source.cfg.train.kd_teacher if source is not None else ""
  path = t.kd_teacher or recorded or t.init_from
  same = source is not None and str(runs.locate(path)[0]) == str(source.directory)
  teacher = source if same else runs.load_run(path, mesh)
  if not t.kd_teacher and not is_dense(teacher.plan):
    found = "recorded by train.init_from" if recorded else "train.init_from"
    raise ConfigError(f"train.kd_teacher is unset, and the teacher it defaults to ({found}: {path!r}) has "
                      f"schedule.kind={teacher.cfg.schedule.kind!r}, not dense: distilling from it would pull the LISA "
                      "layers towards shared logits. Set train.kd_teacher to the dense run to distil from, or to "
                      f"{path!r} to distil from this one")
  diffs = [f"model.{f}={getattr(model, f)} (the teacher has {getattr(teacher.cfg.model, f)})"
           for f in _MATCHED if getattr(model, f) != getattr(teacher.cfg.model, f)]
  if not same_tokenizer(tokenizer, teacher.cfg.data.tokenizer):
    diffs.append(f"data.tokenizer={tokenizer!r} (the teacher has {teacher.cfg.data.tokenizer!r})")
  if diffs:
    raise ConfigError(f"train.kd_teacher={path!r} cannot teach this model, whose attention logits are compared with "
                      "its per layer, head and token: " + "; ".join(diffs))
  return teacher
