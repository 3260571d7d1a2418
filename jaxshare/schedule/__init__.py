"""Sharing schedules: presets -> per-layer plans -> superblocks -> runs and stacks.

The package: the compiled types (``plan``), the preset registry (``presets``) and the presets of each family
(``kv``, ``scores``), the execution grouping (``grouping``) and :func:`compile_schedule` (``compile``).

A *schedule* says, for every layer, where its K/V come from. A **producer** layer projects its own K/V
(``num_kv_heads`` heads, GQA/MQA inside the layer); a **consumer** layer has no K/V parameters and attends with
the post-RoPE K/V of an earlier producer (CLA, MLKV, LCKV-style patterns). Score sharing lets a layer reuse an
earlier layer's softmax probabilities (SA, UniAttn) or pre-softmax logits (LISA family).

Execution groups layers into **superblocks**: the smallest contiguous layer ranges that no K/V or score reference
crosses. Only the residual stream flows between superblocks, so each superblock is a self-contained scan body.
Inside a superblock every layer gets a :class:`LayerRole` (what it does, with references as positions in the
superblock), and consecutive layers with equal roles form a **run**, scanned over stacked parameters: the K/V
consumers of one producer (MLKV, CLA with factor > 2), the probability reusers of one source (SA, UniAttn) and LISA
chains (each layer reads the previous one's logits through a fixed-shape carry). Consecutive superblocks with the
same runs form a **stack**, run as one ``nnx.scan``. Compile time therefore grows with the number of distinct
runs and stacks, not with depth.
"""

from jaxshare.schedule.compile import compile_schedule, tied_head_count
from jaxshare.schedule.grouping import RoleSettings, group, layer_roles, layer_runs
from jaxshare.schedule.kv import mlkv_owners, parse_sources
from jaxshare.schedule.layout import (LayerPlan, LayerRole, RunPlan, Schedule, ScheduleError, StackPlan,
                                    SuperblockPlan)
from jaxshare.schedule.presets import PRESETS, parse_kind
from jaxshare.schedule.scores import default_lisa_layers, lisa_groups
