"""Device mesh and logical axis rules (MaxText vocabulary).

Every parameter carries ``logical_axes`` metadata (``("embed", "mlp")``, ...); activations are constrained with
logical names too. :data:`DEFAULT_RULES` maps each logical name to the mesh axes it may be sharded over; a mesh
axis of size 1, a dimension that does not divide, or a mesh axis already used by another dimension of the same
array is skipped, so every rule set is valid on every mesh.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence, TypeVar

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxshare.config import ConfigError, MeshConfig

T = TypeVar("T")

# Outermost first, as MaxText orders them: data parallelism is the axis that tolerates the slowest links, tensor
# parallelism needs the fastest; the context axis sits between (its per-layer K/V gathers are larger than fsdp's
# weight gathers at long context, smaller than tensor parallelism's activation traffic).
MESH_AXES = ("data", "fsdp", "context", "tensor")

DEFAULT_RULES: dict[str, tuple[str, ...]] = {
  # weights: FSDP-sharded over the context axis too (MaxText's rule), which would otherwise hold whole copies
  "embed": ("fsdp", "context"),
  "vocab": ("tensor",),
  "heads": ("tensor",),
  "kv_heads": ("tensor",),
  "head_dim": (),
  "mlp": ("tensor",),
  "norm": (),
  "layers": (),
  # activations
  "activation_batch": ("data", "fsdp"),
  # context parallelism's gathered keys: a copy per device of the context axis, stacked on the batch dimension
  # (jaxshare.context.gather_keys)
  "activation_gathered_batch": ("context", "data", "fsdp"),
  "activation_length": ("context",),
  "activation_embed": (),
  "activation_heads": ("tensor",),
  "activation_kv_heads": ("tensor",),
  "activation_mlp": ("tensor",),
  "activation_vocab": ("tensor",),
}


def _fill(sizes: list[int], count: int, what: str) -> list[int]:
  """``sizes`` with a -1 replaced so that they multiply to ``count``."""
  sizes = list(sizes)
  if -1 in sizes:
    known = math.prod(s for s in sizes if s != -1)
    if count % known:
      raise ConfigError(f"mesh={sizes} cannot fill {count} {what}: the fixed axes ({known}) must divide it")
    sizes[sizes.index(-1)] = count // known
  return sizes


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ``(data, fsdp, context, tensor)`` mesh over ``devices`` (default: all global devices).

  One slice (``cfg.num_slices == 1``): the ICI sizes (one may be -1) may use fewer than all devices; on TPU the
  devices are laid out by ``mesh_utils.create_device_mesh`` so that mesh neighbours are torus neighbours. Several
  slices: each axis is ``ici size x dcn size`` (``mesh_utils.create_hybrid_device_mesh``), the ICI sizes filling
  each slice; a slice is a TPU slice (``device.slice_index``) or, where devices carry no distinct slice indices
  (GPU/CPU clusters), a process.

  Raises:
    ConfigError: the sizes do not fit the device count, or the devices do not form ``num_slices`` slices.
  """
  devices = list(devices if devices is not None else jax.devices())
  slices = cfg.num_slices
  if len(devices) % slices:
    raise ConfigError(f"mesh.dcn_*: {slices} slices do not divide the {len(devices)} devices")
  per_slice = len(devices) // slices
  ici = _fill([cfg.data, cfg.fsdp, cfg.context, cfg.tensor], per_slice,
              "devices per slice" if slices > 1 else "devices")
  sizes = " ".join(f"{a}={n}" for a, n in zip(MESH_AXES, ici))
  n = math.prod(ici)
  if slices == 1:
    if n > len(devices):
      raise ConfigError(f"mesh {sizes} needs {n} devices, {len(devices)} available")
    if devices[0].platform == "tpu" and n == len(devices):
      arr = mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=True)
    else:
      arr = np.asarray(devices[:n], dtype=object).reshape(ici)
  else:
    if n != per_slice:
      raise ConfigError(f"mesh {sizes} uses {n} devices of each slice; with mesh.dcn_* sizes it must fill all "
                        f"{per_slice}")
    by_slice = len({getattr(d, "slice_index", 0) for d in devices}) == slices
    if not by_slice and len({d.process_index for d in devices}) != slices:
      raise ConfigError(f"mesh.dcn_*: {slices} slices requested, but the devices come from "
                        f"{len({getattr(d, 'slice_index', 0) for d in devices})} slice(s) and "
                        f"{len({d.process_index for d in devices})} process(es)")
    arr = mesh_utils.create_hybrid_device_mesh(ici, [cfg.dcn_data, cfg.dcn_fsdp, cfg.dcn_context, cfg.dcn_tensor],
                                               devices, process_is_granule=not by_slice,
                                               allow_split_physical_axes=True)
  return Mesh(arr, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: Mapping[str, tuple[str, ...]] = DEFAULT_RULES) -> P:
  """PartitionSpec for an array of ``shape`` whose dimensions have the given logical names."""
  used: set[str] = set()
  spec: list[Any] = []
  for name, dim in zip(logical_axes, shape):
    axes = []
    for ax in rules.get(name, ()) if name else ():
      size = mesh.shape[ax]
      if size > 1 and ax not in used and dim % (size * math.prod(mesh.shape[a] for a in axes)) == 0:
        axes.append(ax)
    used.update(axes)
    spec.append(tuple(axes) if len(axes) > 1 else (axes[0] if axes else None))
  return P(*spec)


def param_logical_axes(abstract_params: nnx.State) -> dict:
  """Pure dict (same structure as ``nnx.to_pure_dict(params)``) of each parameter's logical axes.

  Stacked (scanned) parameters get a leading ``layers`` axis.
  """
  out: dict = {}
  for path, var in nnx.to_flat_state(abstract_params):
    axes = tuple(var.get_metadata().get("logical_axes", ()))
    ndim = len(var.get_value().shape)
    axes = ("layers",) * (ndim - len(axes)) + axes
    node = out
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = axes
  return out


def param_shardings(abstract_params: nnx.State, mesh: Mesh,
                    rules: Mapping[str, tuple[str, ...]] = DEFAULT_RULES) -> dict:
  """NamedShardings (pure dict) for the parameters."""
  axes = param_logical_axes(abstract_params)
  shapes = jax.tree.map(lambda v: v.shape, nnx.to_pure_dict(abstract_params))
  return jax.tree.map(lambda a, s: NamedSharding(mesh, logical_to_spec(a, s, mesh, rules)), axes, shapes,
                      is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(e, (str, type(None))) for e in x))


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """``with_sharding_constraint`` by logical names under the ambient mesh (``jax.set_mesh``); no-op without."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or math.prod(mesh.axis_sizes) == 1:
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, x.shape, mesh))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """A ``[B, T]`` batch's sharding: rows over the mesh's batch axes (``data``, ``fsdp``) that are larger than 1."""
  axes = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1) or None
  return NamedSharding(mesh, P(axes, None))


def local_batch_rows(sharding: NamedSharding, batch_size: int) -> slice:
  """The rows of a ``[batch_size, ...]`` global batch that this process's devices hold under ``sharding``: what
  this process must feed (:class:`~jaxshare.data.Datasets` reads only those).

  Raises:
    ConfigError: the rows are not one contiguous block of ``batch_size / process_count`` (a mesh whose batch axes do
      not follow the processes' devices).
  """
  spans = {idx[0].indices(batch_size)[:2] for idx in sharding.addressable_devices_indices_map((batch_size,)).values()}
  start, stop = min(a for a, _ in spans), max(b for _, b in spans)
  covered = set().union(*(range(a, b) for a, b in spans))
  if covered != set(range(start, stop)) or (stop - start) * jax.process_count() != batch_size:
    raise ConfigError(f"this process's devices hold batch rows {sorted(spans)} of {batch_size}: the mesh's batch axes "
                      f"(data, fsdp) must give each of the {jax.process_count()} processes one contiguous block; put "
                      "the process split on mesh.dcn_data or on the data/fsdp sizes")
  return slice(start, stop)


def shard_batch(sharding: NamedSharding, batch: T) -> T:
  """Assemble this process's numpy batch (a pytree of ``[rows, ...]`` arrays, e.g. a
  :class:`~jaxshare.data.batch.Batch`) into global arrays placed by ``sharding`` (:func:`batch_sharding`)."""
  if jax.process_count() == 1:  # one transfer call for the whole batch: ~10x less host time than assembling per array
    return jax.device_put(jax.tree.map(np.asarray, batch), sharding)
  return jax.tree.map(lambda v: jax.make_array_from_process_local_data(sharding, np.asarray(v)), batch)
