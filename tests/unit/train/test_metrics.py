"""MFU's peak: a configured figure, a known accelerator's, or the host's measured matmul roofline, always labelled."""

import pytest

from jaxshare.train.metrics import host_matmul_flops, resolve_peak


def test_configured_peak_wins_and_scales_with_devices():
  peak = resolve_peak(2.5, 4, "float32")
  assert peak.flops_per_sec == 2.5e12 * 4
  assert "train.peak_tflops=2.5" in peak.label and peak.tag == "configured peak"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_peak_is_the_measured_host_roofline(dtype):
  peak = resolve_peak(0.0, 8, dtype)
  assert peak.tag == "host roofline" and "measured" in peak.label and dtype in peak.label
  # the 8 fake CPU devices share the host's cores: the roofline is not multiplied by the device count
  assert peak.flops_per_sec == host_matmul_flops(dtype)
  assert 1e9 < peak.flops_per_sec < 1e14  # a CPU, not the 0.1 TFLOP/s constant of old nor an accelerator
