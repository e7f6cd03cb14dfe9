"""Flat against two-level exchanges on emulated nodes, beside the cost model.

Every node is a network namespace with one process of several emulated CPU
devices, and a network card: a veth pair to a bridge (the switch), shaped
with ``tc`` (a token bucket at the rate, default 1 Gbit/s, and optionally
netem's delay) in both directions. Gloo's collectives between two devices
of one process stay inside its namespace, on the unshaped loopback (the
fast link inside a node); between processes they cross the cards (the slow
link between nodes).

For each sparse algorithm and density it times one exchange of a gradient
of ``--size`` elements per device three ways: flat over all N x L devices
as over one data axis (``one axis``); flat as the transform runs it over the
pair (``flat``: then its unsent reduce-scattered inside each node onto the
slice every device keeps); and by :func:`topka2a_jax.collectives.two_level`
(dense inside each node, sparse between nodes). It counts the bytes each node's card sent (its
interface counters). Beside each row: :func:`topka2a_jax.cost.cluster_cost`'s bytes and
seconds, with each link's α and bandwidth fitted from two all-reduces over
its axis alone (a reduce-scatter then an all-gather, the collectives
``two_level`` runs inside a node) and the selection's cost fitted over the
sparse rows (least squares, non-negative).

Needs root (or CAP_NET_ADMIN) for ``ip netns``, veth, bridges and ``tc``.
Where any is missing it says so and exits with status 2; the namespaces are
always removed afterwards.

Run:
  python benchmarks/network_nodes.py [--nodes 2] [--devices-per-node 4]
      [--rate 1gbit] [--delay-ms 0] [--size 25000000] [--densities 0.01 0.05]
      [--repeats 5] [--selection auto] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import link  # benchmarks/link.py: the shaped namespace, its workers, the timer

from topka2a_jax import cost
from topka2a_jax.collectives import ALGORITHMS

ROOT = Path(__file__).resolve().parent.parent
SPARSE = [name for name, algorithm in ALGORITHMS.items() if algorithm.sparse]
CARD = "card"
"""The interface name of every node's network card, inside its namespace."""

CALIBRATION_SMALL = 4096
"""Elements of the small all-reduces that fit the links' latency."""


class ShapedNodes:
  """``nodes`` namespaces joined through a bridge by cards shaped to ``rate``."""

  def __init__(self, nodes: int, rate: str, delay_ms: float):
    self.prefix = f"tk-{os.getpid()}"
    self.nodes, self.rate, self.delay_ms = nodes, rate, delay_ms
    self.made: list[str] = []

  def node(self, i: int) -> str:
    """The namespace of node ``i``."""
    return f"{self.prefix}-n{i}"

  def address(self, i: int) -> str:
    """Node ``i``'s card address."""
    return f"10.231.0.{i + 1}"

  def _shape(self, namespace: str, device: str) -> None:
    tc = ["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device]
    # A token bucket at the rate; its burst must hold a 64 KiB frame.
    link.checked(*tc, "root", "handle", "1:", "tbf", "rate", self.rate,
                 "burst", "256kb", "latency", "200ms")
    if self.delay_ms:  # needs the sch_netem kernel module
      link.checked(*tc, "parent", "1:1", "handle", "10:", "netem", "delay",
                   f"{self.delay_ms}ms")

  def __enter__(self) -> ShapedNodes:  # noqa: PYI034
    switch = f"{self.prefix}-sw"
    try:
      for name in [switch, *map(self.node, range(self.nodes))]:
        link.checked("ip", "netns", "add", name)
        self.made.append(name)
        link.checked("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
      in_switch = ["ip", "netns", "exec", switch]
      link.checked(*in_switch, "ip", "link", "add", "br0", "type", "bridge")
      link.checked(*in_switch, "ip", "link", "set", "br0", "up")
      for i in range(self.nodes):
        node, port = self.node(i), f"port{i}"
        link.checked("ip", "link", "add", f"{self.prefix}c{i}", "type", "veth",
                     "peer", "name", f"{self.prefix}p{i}")
        link.checked("ip", "link", "set", f"{self.prefix}c{i}", "netns", node,
                     "name", CARD)
        link.checked("ip", "link", "set", f"{self.prefix}p{i}", "netns", switch,
                     "name", port)
        in_node = ["ip", "netns", "exec", node]
        link.checked(*in_node, "ip", "addr", "add", f"{self.address(i)}/24", "dev",
                     CARD)
        link.checked(*in_node, "ip", "link", "set", CARD, "up")
        link.checked(*in_switch, "ip", "link", "set", port, "master", "br0")
        link.checked(*in_switch, "ip", "link", "set", port, "up")
        self._shape(node, CARD)  # what the node sends
        self._shape(switch, port)  # what it receives
    except BaseException:
      self.__exit__()
      raise
    return self

  def __exit__(self, *exc_info) -> None:
    for name in reversed(self.made):  # the veth pairs go with their namespaces
      subprocess.run(["ip", "netns", "del", name], check=False)
    self.made = []


def card_bytes_sent() -> int:
  """Bytes this namespace's card has sent so far."""
  for line in Path("/proc/net/dev").read_text().splitlines():
    name, _, fields = line.partition(":")
    if name.strip() == CARD:
      return int(fields.split()[8])
  raise RuntimeError(f"no interface {CARD!r} in this namespace")


def use_gloo_on_card(coordinator: str) -> None:
  """Makes gloo listen on this node's card rather than the hostname's address.

  JAX builds its CPU client's gloo collectives with no address, so gloo
  takes the hostname's, which is loopback here and not reachable from the
  other namespaces. The card's address is the one this namespace uses to
  reach the coordinator. This replaces JAX's CPU backend factory (a private
  hook) before the first device is made.
  """
  import jaxlib._jax as jax_internal
  from jax._src import distributed, xla_bridge

  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
    probe.connect((coordinator.rsplit(":", 1)[0], 9))
    address = probe.getsockname()[0]

  def cpu_client():
    collectives = jax_internal.make_gloo_tcp_collectives(
        distributed_client=distributed.global_state.client, hostname=address)
    return xla_bridge.make_cpu_client(collectives=collectives)

  xla_bridge.register_backend_factory("cpu", cpu_client, priority=0,
                                      fail_quietly=False)


def worker(size: int, densities: list[float], repeats: int, selection: str,
           out: str) -> None:
  """Inside every node: time the exchanges and count what the card sends."""
  import topka2a_jax.distributed
  from topka2a_jax.distributed import COORDINATOR

  topka2a_jax.distributed.initialize()
  use_gloo_on_card(os.environ[COORDINATOR])
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  from jax.experimental import multihost_utils
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P

  from topka2a_jax import collectives

  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  mesh = Mesh(np.array(devices).reshape(jax.process_count(), -1), ("node", "local"))
  both = ("node", "local")
  per_node = mesh.shape["local"]

  def buffer_of(length: int) -> jax.Array:
    return jax.make_array_from_callback(
        (mesh.size * length,), NamedSharding(mesh, P(both)),
        lambda index: np.random.default_rng(index[0].start or 0).normal(
            size=length).astype(np.float32))

  def timed(name: str, exchange, length: int, **row) -> None:
    run = jax.jit(jax.shard_map(exchange, mesh=mesh, in_specs=P(both),
                                out_specs=P(both)))
    data = buffer_of(length)
    run(data).block_until_ready()  # compile and warm up
    seconds, sent = [], 0
    for _ in range(repeats):
      multihost_utils.sync_global_devices(name)
      before, start = card_bytes_sent(), time.perf_counter()
      run(data).block_until_ready()
      seconds.append(time.perf_counter() - start)
      sent += card_bytes_sent() - before
    rows.append({**row, "length": length, "seconds": float(np.median(seconds)),
                 "card_bytes": sent / repeats})
    if jax.process_index() == 0:
      print(f"{name:42s} {rows[-1]['seconds']:8.4f} s", flush=True)

  rows: list[dict] = []
  def all_reduce(buffer: jax.Array, axis: str) -> jax.Array:
    """A ring all-reduce as two_level runs it: reduce-scatter, then all-gather."""
    count = mesh.shape[axis]
    rows = jnp.pad(buffer, (0, -buffer.size % count)).reshape(count, -1)
    return lax.all_gather(lax.psum_scatter(rows, axis, tiled=True), axis, tiled=True)

  for axis, length in itertools.product(("local", "node"), (CALIBRATION_SMALL, size)):
    timed(f"calibration: all-reduce over {axis}, {length:,}",
          lambda b, axis=axis: all_reduce(b, axis)[0, :1], length,
          kind="calibration", axis=axis)
  timed("dense over both axes", lambda b: lax.pmean(b, both)[:1], size,
        kind="exchange", algorithm="dense", route=cost.FLAT, slices=False,
        density=1.0)
  def kept(result, residual) -> jax.Array:
    """The mean's first entry and the residual's sum: every route computes
    all it would keep for the next step, as in training."""
    return jnp.stack([result.mean[0], jnp.sum(residual)])

  for algorithm, density in itertools.product(SPARSE, densities):
    one = collectives.COLLECTIVES[algorithm]

    def one_axis(b, one=one, density=density):
      result = one(b, both, density, selection=selection)
      return kept(result, result.unsent)

    def flat(b, one=one, density=density):
      """The flat exchange, its unsent summed onto slices inside the node."""
      result = one(b, both, density, selection=selection)
      pieces = jnp.pad(result.unsent, (0, -b.size % per_node)).reshape(per_node, -1)
      return kept(result, lax.psum_scatter(pieces, "local", tiled=True)[0])

    def two_level(b, one=one, density=density):
      result = collectives.two_level(b, both, density, selection=selection, outer=one)
      return kept(result, result.unsent)

    routes = {"one axis": one_axis, cost.FLAT: flat, cost.TWO_LEVEL: two_level}
    for route, exchange in routes.items():
      timed(f"{algorithm} {density:g} {route}", exchange, size, kind="exchange",
            algorithm=algorithm, route=cost.FLAT if route == "one axis" else route,
            slices=route != "one axis", density=density)
  Path(f"{out}.{jax.process_index()}").write_text(json.dumps(rows))


def fit_link(small: dict, large: dict, messages: int, bytes_of) -> cost.Network:
  """α and bandwidth through two dense all-reduces of different sizes."""
  per_byte = ((large["seconds"] - small["seconds"])
              / (bytes_of(large["length"]) - bytes_of(small["length"])))
  latency = max(0.0, (small["seconds"] - per_byte * bytes_of(small["length"]))
                / messages)
  return cost.Network(latency, 1.0 / max(per_byte, 1e-15), "fitted", "dense all-reduce")


def fit_cluster(rows: list[dict], nodes: int, per_node: int) -> cost.Cluster:
  """The links from the calibration rows (process 0's times)."""
  def pair(axis):
    found = sorted((r for r in rows if r.get("axis") == axis), key=lambda r: r["length"])
    return found[0], found[-1]

  # An all-reduce over "node" runs L rings at once through each card.
  outer = fit_link(*pair("node"), 2 * (nodes - 1),
                   lambda n: per_node * 2 * (nodes - 1) / nodes * 4 * n)
  inner = fit_link(*pair("local"), 2 * (per_node - 1),
                   lambda n: 2 * (per_node - 1) / per_node * 4 * n)
  return cost.Cluster(nodes, per_node, outer=outer, inner=inner)


def selection_terms(row: dict, cluster: cost.Cluster) -> list[float]:
  """Elements read and entries selected by one device in the exchange."""
  exchange = ALGORITHMS[row["algorithm"]]
  if row["route"] == cost.FLAT:
    length, devices = row["length"], cluster.devices
  else:
    length, devices = -(-row["length"] // cluster.per_node), cluster.nodes
  return [exchange.elements_read(length, devices),
          exchange.selected_entries(length, devices, row["density"])]


def fit_selection(rows: list[dict], cluster: cost.Cluster) -> tuple[float, float]:
  """Seconds per element read and per entry selected: the sparse rows' time
  beyond the links' model, least squares in relative error, non-negative."""
  import numpy as np

  sparse = [r for r in rows if r["algorithm"] != "dense"]
  left = np.array([r["seconds"] - model_of(r, cluster).seconds for r in sparse])
  times = np.array([r["seconds"] for r in sparse])
  design = np.array([selection_terms(r, cluster) for r in sparse]) / times[:, None]
  best, best_error = np.zeros(2), np.inf
  for used in ([0, 1], [0], [1]):
    coefficients = np.zeros(2)
    coefficients[used] = np.linalg.lstsq(design[:, used], left / times, rcond=None)[0]
    error = np.sum((design @ coefficients - left / times) ** 2)
    if (coefficients >= 0).all() and error < best_error:
      best, best_error = coefficients, error
  return float(best[0]), float(best[1])


def model_of(row: dict, cluster: cost.Cluster) -> cost.ClusterCost:
  """The cost model's bytes and link seconds of one row."""
  return cost.cluster_cost(row["algorithm"], row["length"], cluster, row["density"],
                           row["route"], residual_slices=row.get("slices", True))


def route_label(row: dict) -> str:
  """``one axis`` (the flat exchange alone), ``flat`` (on a pair: its unsent
  reduce-scattered onto slices inside the node) or ``two_level``."""
  one_axis = row["route"] == cost.FLAT and not row.get("slices", True)
  return "one axis" if one_axis else row["route"]


def report(by_node: list[list[dict]], nodes: int, per_node: int, rate: str) -> list[dict]:
  """Prints the table; returns the exchange rows with the model beside them."""
  first = by_node[0]
  cluster = fit_cluster(first, nodes, per_node)
  rows = [dict(r, card_bytes=max(node[i]["card_bytes"] for node in by_node))
          for i, r in enumerate(first) if r["kind"] == "exchange"]
  per_element, per_entry = fit_selection(rows, cluster)
  print(f"\n{nodes} nodes x {per_node} devices, cards at {rate}; fitted: between "
        f"nodes α = {cluster.outer.latency * 1e6:.0f} µs, "
        f"{cluster.outer.bandwidth / 1e6:.1f} MB/s per card; inside a node "
        f"α = {cluster.inner.latency * 1e6:.0f} µs, "
        f"{cluster.inner.bandwidth / 1e6:.1f} MB/s per device; selection "
        f"{per_element * 1e9:.2f} ns per element read + {per_entry * 1e9:.0f} ns "
        "per entry selected")
  print(f"{'algorithm':15s} {'density':>7s} {'route':>9s} {'seconds':>8s} "
        f"{'model':>7s} {'off by':>7s} {'card MB':>8s} {'model':>7s} "
        f"{'s vs one axis':>13s} {'MB vs one axis':>14s}")
  for r in rows:
    model = model_of(r, cluster)
    selection = (0.0 if r["algorithm"] == "dense" else
                 sum(c * t for c, t in zip((per_element, per_entry),
                                           selection_terms(r, cluster))))
    r.update(model_seconds=model.seconds + selection, model_card_bytes=model.outer_bytes)
    one_axis = next(f for f in rows if f["algorithm"] == r["algorithm"]
                    and f["density"] == r["density"] and route_label(f) == "one axis")
    r.update(route_label=route_label(r),
             seconds_vs_one_axis=r["seconds"] / one_axis["seconds"],
             bytes_vs_one_axis=r["card_bytes"] / one_axis["card_bytes"])
    print(f"{r['algorithm']:15s} {r['density']:7g} {r['route_label']:>9s} "
          f"{r['seconds']:8.4f} {r['model_seconds']:7.4f} "
          f"{r['seconds'] / r['model_seconds'] - 1:+7.0%} "
          f"{r['card_bytes'] / 1e6:8.2f} {model.outer_bytes / 1e6:7.2f} "
          f"{r['seconds_vs_one_axis']:12.3f}x {r['bytes_vs_one_axis']:13.3f}x")
  return rows


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--nodes", type=int, default=2)
  parser.add_argument("--devices-per-node", type=int, default=4)
  parser.add_argument("--rate", default="1gbit", help="tc rate, e.g. 1gbit, 500mbit")
  parser.add_argument("--delay-ms", type=float, default=0.0)
  parser.add_argument("--size", type=int, default=25_000_000,
                      help="elements of the gradient on every device")
  parser.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.05])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--selection", default="auto",
                      choices=["auto", "exact", "threshold", "approx"])
  parser.add_argument("--json", help="also write the rows here")
  parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    worker(args.size, args.densities, args.repeats, args.selection, args.worker)
    return 0
  if args.nodes < 2 or args.devices_per_node < 1:
    parser.error("--nodes must be at least 2 and --devices-per-node at least 1")

  from topka2a_jax.distributed import launch

  out = Path(tempfile.mkdtemp()) / "rows.json"
  try:
    with ShapedNodes(args.nodes, args.rate, args.delay_ms) as nodes:
      status = launch(
          [sys.executable, __file__, "--worker", str(out), "--size", str(args.size),
           "--densities", *map(str, args.densities), "--repeats", str(args.repeats),
           "--selection", args.selection],
          args.nodes, args.devices_per_node,
          prefixes=[["ip", "netns", "exec", nodes.node(i)] for i in range(args.nodes)],
          host=nodes.address(0))
  except link.NetworkUnavailable as error:
    print(f"cannot make the shaped nodes here: {error}. It needs root (or "
          "CAP_NET_ADMIN), veth and bridge links and the kernel's tbf qdisc "
          "(netem too for --delay-ms); nothing was left behind.", file=sys.stderr)
    return 2
  if status:
    print(f"the exchange processes failed (status {status})", file=sys.stderr)
    return status
  by_node = [json.loads(Path(f"{out}.{i}").read_text()) for i in range(args.nodes)]
  rows = report(by_node, args.nodes, args.devices_per_node, args.rate)
  if args.json:
    Path(args.json).write_text(json.dumps(
        {"nodes": args.nodes, "devices_per_node": args.devices_per_node,
         "rate": args.rate, "delay_ms": args.delay_ms, "size": args.size,
         "selection": args.selection, "rows": rows}, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
