"""One of two processes (4 cpu devices each) running ring attention over all 8.

Run by test_multidevice_two_process.py: ``python _two_process_worker.py PROCESS_ID PORT``.
Prints ``RING-OK <process> <worst error>`` when its shards of out and of the
gradients match the float64 oracle.
"""

from __future__ import annotations

import sys

import jax

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main(process_id: int, port: int) -> None:
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
        initialization_timeout=40,
    )
    import attn_backends as ab
    import jax.numpy as jnp
    import numpy as np
    from attn_backends_contracts._oracle import attention as oracle
    from attn_backends_contracts._oracle import attention_vjp as oracle_vjp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    assert jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = jax.make_mesh((8,), ("sp",))
    sharding = NamedSharding(mesh, P(None, "sp", None, None))
    rng = np.random.default_rng(0)  # same data in both processes
    b, t, h, d = 1, 64, 2, 16
    q, k, v, d_out = (rng.standard_normal((b, t, h, d)).astype(np.float32) for _ in range(4))
    glob = [jax.make_array_from_callback(x.shape, sharding, lambda i, x=x: x[i])
            for x in (q, k, v, d_out)]
    att = ab.Registry(probe=None).get(backend="xla_native", sequence_axis="sp")

    def loss(q, k, v, d_out):
        out = att(q, k, v, causal=True)
        return jnp.sum(out * d_out), out

    with jax.sharding.set_mesh(mesh):
        grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(*glob)
    want = oracle_vjp(q, k, v, d_out, causal=True)
    worst = 0.0
    # want also holds "bias" (None here): zip stops after the three gradients.
    for got, ref in zip(
        (out, *grads), (oracle(q, k, v, causal=True)[0], *want.values()), strict=False
    ):
        for shard in got.addressable_shards:
            err = float(np.abs(np.asarray(shard.data) - ref[shard.index]).max())
            worst = max(worst, err)
    assert worst < 1e-4, worst
    print(f"RING-OK {process_id} {worst:.2e}", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
