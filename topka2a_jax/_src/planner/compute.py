"""How long the backward pass takes: its floating-point work against a device's rate.

Bucket exchanges overlap the backward pass, so the planner needs its
duration. It comes from the work (XLA's cost analysis of the compiled
gradient, or a known model's FLOPs) divided by the device's sustained rate:
a preset per device kind, at the utilisation large training runs reach.
Where the backend runs a collective in line with the compute around it
(XLA's CPU backend), no exchange hides behind the backward pass, and the
training steps plan as if it took no time (:attr:`Device.overlaps`).

Example:
  >>> DEVICES["h100"].seconds(2 * 8.2e9 * 32)  # ResNet-50's backward, 32 images
  0.001326593
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

UTILISATION = 0.4
"""Share of the datasheet's dense rate a training step sustains."""


@dataclasses.dataclass(frozen=True)
class Device:
  """A device's sustained floating-point rate.

  Attributes:
    name: a label.
    flops_per_second: sustained rate.
    source: where the figure comes from.
    overlaps: whether the backend runs a collective beside independent
      compute, so that bucket exchanges can hide behind the backward pass.
      XLA's GPU and TPU backends do (asynchronous collectives); its CPU
      backend runs them in line (``docs/layout.md`` says where each runs).
  """

  name: str
  flops_per_second: float
  source: str
  overlaps: bool = True

  def seconds(self, flops: float) -> float:
    """Time for ``flops`` floating-point operations."""
    return round(flops / self.flops_per_second, 9)


DEVICES: dict[str, Device] = {
    "h100": Device("h100", UTILISATION * 989e12,
                   "H100 SXM, 989 TFLOP/s dense bf16 (NVIDIA datasheet), at 40%"),
    "a100": Device("a100", UTILISATION * 312e12,
                   "A100, 312 TFLOP/s dense bf16 (NVIDIA datasheet), at 40%"),
    "tpu-v5e": Device("tpu-v5e", UTILISATION * 197e12,
                      "TPU v5e, 197 TFLOP/s bf16 (Google Cloud), at 40%"),
    "cpu": Device("cpu", 50e9, "a CPU host: order of tens of GFLOP/s",
                  overlaps=False),
}
"""Presets by name; pass a :class:`Device` for hardware measured otherwise."""

_KINDS = (("H100", "h100"), ("H200", "h100"), ("A100", "a100"), ("v5", "tpu-v5e"))


def device_of(device: Any) -> Device:
  """The preset for a ``jax.Device``: by its kind, else by its platform.

  Example:
    >>> device_of(jax.devices()[0]).name
    'cpu'
  """
  kind = getattr(device, "device_kind", "")
  for part, name in _KINDS:
    if part in kind:
      return DEVICES[name]
  return DEVICES["cpu" if device.platform == "cpu" else "a100"]


def backward_seconds(value_and_grad: Callable[..., Any], *args: Any,
                     device: Device) -> tuple[float, str]:
  """The backward pass's duration from XLA's cost analysis of ``value_and_grad``.

  The gradient costs about twice the forward pass, so two thirds of the
  analysed work (forward and backward) is the backward's.

  Args:
    value_and_grad: one device's loss-and-gradient function.
    *args: its arguments, or ``jax.ShapeDtypeStruct`` stand-ins.
    device: the device's rate.

  Returns:
    ``(seconds, where the figure came from)``; 0 seconds when XLA reports no
    cost.

  Example:
    >>> f = jax.value_and_grad(lambda w, x: jnp.sum((x @ w) ** 2))
    >>> w, x = jnp.ones((256, 256)), jnp.ones((64, 256))
    >>> seconds, source = backward_seconds(f, w, x, device=DEVICES["cpu"])
    >>> seconds > 0, source.startswith("XLA cost analysis")
    (True, True)
  """
  import jax  # here alone, so that the presets above load without JAX

  analysis = jax.jit(value_and_grad).lower(*args).cost_analysis() or {}
  flops = float(analysis.get("flops", 0.0))
  source = (f"XLA cost analysis: {flops:.3g} FLOP forward and backward, two "
            f"thirds of it at {device.flops_per_second:.3g} FLOP/s ({device.source})")
  return device.seconds(2 / 3 * flops), source
