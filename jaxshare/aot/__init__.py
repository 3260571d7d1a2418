"""Ahead-of-time compilation on a host without the hardware: TPU topologies and the host compiler
(:mod:`~jaxshare.aot.topology`), kernels and the train step compiled for them (:mod:`~jaxshare.aot.compile`), the
train step's memory and cost report (:mod:`~jaxshare.aot.report`) and the fit check with its largest-batch search
(:mod:`~jaxshare.aot.fit`, ``train.py --compile-only``).

Re-exports nothing: importing the package must not import JAX, because
:func:`~jaxshare.aot.topology.use_host_compiler` has to run before JAX is first imported.
"""
