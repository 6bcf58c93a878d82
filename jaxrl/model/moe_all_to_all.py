"""The collective half of the ragged all-to-all MoE dispatcher (`jaxrl.model.moe.experts_all_to_all`).

Inside `shard_map` over the `expert` mesh axis, ep devices each hold L = E / ep experts (device j the experts
j * L ... (j + 1) * L - 1) and their own M tokens. A device sorts its M * X token-expert assignments by
expert, so the rows bound for each (device, local expert) are one contiguous slice, and `send` moves every
slice to its expert's device in one `jax.lax.ragged_all_to_all`, at the place that groups the receiver's
buffer by local expert (then by source device): the grouped matmuls read it as it arrives, with no local
sort. `give_back` returns every row's output to the device and place it came from. The offsets and sizes of
each slice come from every device's per-expert counts (`plan`). The dispatcher of MaxText's
`RoutedMoE.sparse_matmul` with expert parallelism, written anew here (MaxText sends one slice per device and
sorts what arrives by local expert; here each slice lands in place).

Letters: S devices on the expert axis (sources and destinations, ep of them), E experts, L local experts,
K = S * L slices (one per destination device and local expert), A a device's assignments (M * X), R rows of
the receive buffer.

XLA's CPU backend has no ragged all-to-all, so on a CPU mesh `ragged_all_to_all` runs the same exchange as a
dense `jax.lax.all_to_all` of padded slices (`jaxrl.model.kernels.ragged_all_to_all` decides); every other
step is the same code on every platform.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array,
                      output_offsets: jax.Array, recv_sizes: jax.Array, *, axis_name: str,
                      emulate: bool) -> jax.Array:
    """`jax.lax.ragged_all_to_all` (same arguments and result): the offset and size arrays are int32 [K], K a
    multiple of the S devices of `axis_name`; slice k of `operand` (rows `input_offsets[k]` + [0,
    `send_sizes[k]`)) goes to device k // (K / S) and lands in its output at rows `output_offsets[k]` + [0, ...);
    `recv_sizes[k]` rows arrive in the k-th slice, from device k // (K / S). Returns `output` [O, ...] with the
    received rows written.

    `emulate` (a CPU mesh): the same exchange as a dense all-to-all of the K slices, each padded to the
    operand's N rows, then a scatter into `output` (K times the rows moved: for tests on tiny shapes)."""
    if not emulate:
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                         axis_name=axis_name)
    n = operand.shape[0]
    r_N = jnp.arange(n, dtype=jnp.int32)
    take_KN = jnp.clip(input_offsets[:, None] + r_N[None], 0, n - 1)
    zero = jnp.zeros((), operand.dtype)
    slices_KN = jnp.where((r_N[None] < send_sizes[:, None]).reshape(*take_KN.shape, *(1,) * (operand.ndim - 1)),
                          operand[take_KN], zero)
    got_KN = jax.lax.all_to_all(slices_KN, axis_name, 0, 0, tiled=True)
    # where each received slice lands here: the offset it was sent with
    at_K = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    rows_KN = jnp.where(r_N[None] < recv_sizes[:, None], at_K[:, None] + r_N[None], output.shape[0])
    return output.at[rows_KN.reshape(-1)].set(got_KN.reshape(-1, *operand.shape[1:]), mode="drop")


def _exclusive_cumsum(x: jax.Array, axis: int) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


@dataclasses.dataclass(frozen=True)
class Plan:
    """One device's slices for the exchange, k = destination-major (device, local expert) (every array int32):
    `send_sizes` / `send_offsets` [K] its sorted assignment rows bound for each and where they start;
    `remote_offsets` [K] where each lands on its device; `recv_sizes` / `recv_offsets` [K] (k = source-major
    (device, local expert)) the rows each device sends it for each local expert and where they sit in its
    receive buffer; `home_offsets` [K] where each received slice started on its source (to give the outputs
    back); `local_sizes` [L] the received rows per local expert, grouped in that order in the buffer."""

    send_sizes: jax.Array
    send_offsets: jax.Array
    remote_offsets: jax.Array
    recv_sizes: jax.Array
    recv_offsets: jax.Array
    home_offsets: jax.Array
    local_sizes: jax.Array


def plan(sizes_E: jax.Array, e_local: int, axis_name: str) -> Plan:
    """The exchange's slices from this device's assignments per expert, `sizes_E` int32 [E] (E = S * L,
    expert e held by device e // L): every device's counts are all-gathered, [S source, S destination, L]. A
    receiver's buffer holds its local expert 0's rows from every source in source order, then expert 1's,
    and so on."""
    sizes_SE = jax.lax.all_gather(sizes_E, axis_name)
    s = sizes_SE.shape[0]
    me = jax.lax.axis_index(axis_name)
    sizes_SSL = sizes_SE.reshape(s, s, e_local)
    at_source_SSL = _exclusive_cumsum(sizes_SE, 1).reshape(s, s, e_local)  # a slice's start among its sender's rows
    expert_start_SL = _exclusive_cumsum(jnp.sum(sizes_SSL, axis=0), 1)  # [destination, L] in its buffer
    at_dest_SSL = expert_start_SL[None] + _exclusive_cumsum(sizes_SSL, 0)  # a slice's start in its receiver's buffer
    return Plan(send_sizes=sizes_SSL[me].reshape(-1), send_offsets=at_source_SSL[me].reshape(-1),
                remote_offsets=at_dest_SSL[me].reshape(-1), recv_sizes=sizes_SSL[:, me].reshape(-1),
                recv_offsets=at_dest_SSL[:, me].reshape(-1), home_offsets=at_source_SSL[:, me].reshape(-1),
                local_sizes=jnp.sum(sizes_SSL[:, me], axis=0))


def send(rows_AD: jax.Array, p: Plan, buffer_rows: int, axis_name: str, emulate: bool) -> jax.Array:
    """This device's assignment rows [A, D], sorted by expert, each to the device of its expert. Returns the
    receive buffer [`buffer_rows`, D], grouped by local expert (`plan`); zeros after the last received row."""
    buffer_RD = jnp.zeros((buffer_rows, *rows_AD.shape[1:]), rows_AD.dtype)
    return ragged_all_to_all(rows_AD, buffer_RD, p.send_offsets, p.send_sizes, p.remote_offsets, p.recv_sizes,
                             axis_name=axis_name, emulate=emulate)


def give_back(out_RD: jax.Array, p: Plan, assignments: int, axis_name: str, emulate: bool) -> jax.Array:
    """The inverse of `send`: each received row's output [R, D] (in buffer order) back to its source, at its
    place among that device's sorted assignments. Returns [`assignments`, D]."""
    home_AD = jnp.zeros((assignments, *out_RD.shape[1:]), out_RD.dtype)
    return ragged_all_to_all(out_RD, home_AD, p.recv_offsets, p.recv_sizes, p.home_offsets, p.send_sizes,
                             axis_name=axis_name, emulate=emulate)
