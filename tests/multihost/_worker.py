"""One process of a multi-process run on 127.0.0.1 (2 cpu devices each, gloo).

``python _worker.py PROCESS COUNT PORT SCENARIO``, started by ``_launch.run``.
The default registry, probes on, the cache ``ATTN_BACKENDS_CACHE_DIR`` names.
Prints one line ``RESULT {json}``: the backend each call was served by, the
worst error of this process's shards against the float64 oracle, or the error
it raised (type and message).

Scenarios:
- ``choose``: one plain call, jitted (so every process agrees on it);
- ``serve``: the plain call, a call sharded over every process's devices (batch
  and heads), ring attention over a sequence axis spanning the processes
  (forward and backward), and heads-sharded paged attention (the write, then a
  ragged batch), and a flax layer's jitted train step with the batch over
  every process's devices (against flax's own attention), and
  examples/serving's engine heads-sharded over every process's devices
  (``worst`` counts the requests not decoded token for token as alone);
- ``nocontext``: the sharded call (batch and heads) and ring attention with a
  mesh over every process's devices and no mesh context, jitted and eager, and
  the heads-sharded paged call (whose mesh is given to ``shard_paged_heads``);
- ``die``: the last process exits before its call; the others wait for it;
- ``hang``: the last process sleeps instead of calling; the others wait for it;
- ``quarantined``: process 1's cache holds a failed verdict for the backend
  ``ATTN_TEST_QUARANTINE`` names (written by a prober whose runner reports a
  wrong answer) before its call;
- ``local``: the plain call on every process, then process 0 alone makes
  calls of new signatures on its own devices (dense eager, and jitted inside
  ``attn_backends.local_work()``, forward and gradient; paged got inside it)
  while the others wait at a barrier, each timed (``seconds``) and checked
  against the oracle, and two marked calls that span processes (``refused``);
  then every process makes the jitted call again, agreed.

With ``ATTN_BACKENDS_TEST_ALONE=1`` the registry is built without agreement:
each process chooses alone (the teeth of the skew tests).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")

B, T, H, D = 2, 32, 4, 16


def _data(n: int) -> list[Any]:
    import numpy as np

    rng = np.random.default_rng(0)  # the same data in every process
    return [rng.standard_normal((B, T, H, D)).astype(np.float32) for _ in range(n)]


def _worst(got: Any, want: Any) -> float:
    """The largest difference on this process's shards of a global array."""
    import numpy as np

    return max(float(np.abs(np.asarray(s.data) - want[s.index]).max())
               for s in got.addressable_shards)


def _registry() -> Any:
    import attn_backends as ab

    if os.environ.get("ATTN_BACKENDS_TEST_ALONE") != "1":
        return ab.registry
    return ab.Registry(block=["hosts"])  # the teeth: each process chooses alone


def choose(result: dict[str, Any]) -> None:
    import numpy as np
    from attn_backends_contracts._oracle import attention as oracle

    q, k, v = _data(3)
    attention = _registry().get(fallback="silent")
    # Jitted: an eager call on this process's arrays would be local work.
    out = jax.jit(lambda q, k, v: attention(q, k, v, causal=True))(q, k, v)
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    explanation = attention.explain(*shapes, causal=True)
    result["chosen"]["plain"] = explanation.chosen
    result["explain"] = str(explanation)
    result["worst"]["plain"] = float(np.abs(np.asarray(out) - oracle(q, k, v, causal=True)[0])
                                     .max())


def sharded(result: dict[str, Any]) -> None:
    from attn_backends_contracts._oracle import attention as oracle
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    q, k, v = _data(3)
    mesh = jax.make_mesh((2, jax.device_count() // 2), ("dp", "tp"))
    spec = NamedSharding(mesh, P("dp", None, "tp", None))
    glob = [jax.make_array_from_callback(x.shape, spec, lambda i, x=x: x[i]) for x in (q, k, v)]
    attention = _registry().get(fallback="silent")
    with jax.sharding.set_mesh(mesh):
        out = jax.jit(lambda q, k, v: attention(q, k, v, causal=True))(*glob)
    result["chosen"]["sharded"] = attention.explain(*glob, causal=True).chosen
    result["worst"]["sharded"] = _worst(out, oracle(q, k, v, causal=True)[0])


def ring(result: dict[str, Any]) -> None:
    import jax.numpy as jnp
    from attn_backends_contracts._oracle import attention as oracle
    from attn_backends_contracts._oracle import attention_vjp as oracle_vjp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    q, k, v, d_out = _data(4)
    mesh = jax.make_mesh((jax.device_count(),), ("sp",))
    spec = NamedSharding(mesh, P(None, "sp", None, None))
    glob = [jax.make_array_from_callback(x.shape, spec, lambda i, x=x: x[i])
            for x in (q, k, v, d_out)]
    attention = _registry().get(fallback="silent", sequence_axis="sp")

    def loss(q: Any, k: Any, v: Any, d_out: Any) -> Any:
        out = attention(q, k, v, causal=True)
        return jnp.sum(out * d_out), out

    with jax.sharding.set_mesh(mesh):
        grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(*glob)
        result["chosen"]["ring"] = attention.explain(*glob[:3], causal=True).chosen
    want = [oracle(q, k, v, causal=True)[0],
            *list(oracle_vjp(q, k, v, d_out, causal=True).values())[:3]]
    result["worst"]["ring"] = max(_worst(g, w) for g, w in zip((out, *grads), want,
                                                                strict=True))


def paged(result: dict[str, Any]) -> None:
    import jax.numpy as jnp
    import numpy as np
    from attn_backends.oracle import paged_case
    from attn_backends.parallel.paged import shard_paged_heads
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = jax.device_count()
    hkv, page = n, 4
    attention = _registry().get_paged(num_q_heads=2 * hkv, num_kv_heads=hkv, head_dim=D,
                                      page_size=page, dtype="float32", fallback="silent")
    result["chosen"]["paged"] = attention.backend.name
    case = paged_case([(5, 5), (3, 9), (1, 13), (0, 6)], page_size=page, hq=2 * hkv,
                      hkv=hkv, d=D, pad_rows=2, seed=0)
    mesh = jax.make_mesh((n,), ("tp",))
    heads = NamedSharding(mesh, P(None, "tp", None))
    served = shard_paged_heads(attention, mesh, "tp")

    def put(x: Any) -> Any:
        return jax.make_array_from_callback(x.shape, heads, lambda i, x=x: x[i])

    write = jax.jit(served.write, donate_argnums=0)
    cache = write(served.init_cache(case.k_pages.shape[0]), put(case.k_rows),
                  put(case.v_rows), jnp.asarray(case.slots))
    out = jax.jit(served.__call__)(put(np.asarray(case.q)), cache, case.batch())
    result["worst"]["paged"] = _worst(out, case.expected())


def no_context(result: dict[str, Any]) -> None:
    """The sharded and ring calls as a user writes them: a mesh over every process's
    devices (jax.make_mesh: Explicit axes), arrays laid out on it, no mesh context;
    jitted and eager. The default backend on cpu runs per device in shard_map."""
    from attn_backends_contracts._oracle import attention as oracle
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    q, k, v = _data(3)
    want = oracle(q, k, v, causal=True)[0]
    n = jax.device_count()
    for kind, mesh, spec, get in (
            ("sharded", jax.make_mesh((2, n // 2), ("dp", "tp")), P("dp", None, "tp", None), {}),
            ("ring", jax.make_mesh((n,), ("sp",)), P(None, "sp", None, None),
             {"sequence_axis": "sp"})):
        sharding = NamedSharding(mesh, spec)
        glob = [jax.make_array_from_callback(x.shape, sharding, lambda i, x=x: x[i])
                for x in (q, k, v)]
        attention = _registry().get(fallback="silent", **get)
        jitted = jax.jit(lambda q, k, v, a=attention: a(q, k, v, causal=True))(*glob)
        eager = attention(*glob, causal=True)
        result["chosen"][kind] = attention.explain(*glob, causal=True).chosen
        result["worst"][f"{kind} jit"] = _worst(jitted, want)
        result["worst"][f"{kind} eager"] = _worst(eager, want)
        if not jitted.sharding.is_equivalent_to(sharding, 4):
            raise AssertionError(f"{kind}: out laid out as {jitted.sharding}, q as {sharding}")


def train_step(result: dict[str, Any]) -> None:
    """A linen attention layer's jitted train step, batch over every process's
    devices: loss and gradients with the adapter against flax's own attention."""
    import flax.linen as nn
    import jax.numpy as jnp
    import numpy as np
    from attn_backends_flax import attention_fn
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = jax.device_count()
    x = np.random.default_rng(1).standard_normal((n, T, 32)).astype(np.float32)
    mesh = jax.make_mesh((n,), ("dp",))
    batch = jax.make_array_from_callback(x.shape, NamedSharding(mesh, P("dp")),
                                         lambda i: x[i])
    fn = attention_fn(_registry().get(fallback="silent"))
    ours = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=32, attention_fn=fn)
    theirs = nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=32)
    params = theirs.init(jax.random.key(0), x[:1], mask=nn.make_causal_mask(x[:1, :, 0]))

    def grads(layer: Any) -> Any:
        def loss(params: Any, x: Any) -> Any:
            out = layer.apply(params, x, mask=nn.make_causal_mask(x[:, :, 0]))
            return jnp.mean(out ** 2)

        with jax.sharding.set_mesh(mesh):
            return jax.jit(jax.value_and_grad(loss))(params, batch)

    (mine, g_mine), (want, g_want) = grads(ours), grads(theirs)
    leaves = zip(jax.tree.leaves(g_mine), jax.tree.leaves(g_want), strict=True)
    worst = max(_worst(a, np.asarray(b.addressable_shards[0].data)) for a, b in leaves)
    result["chosen"]["flax"] = sorted(set(fn.served.values()))[0]
    result["worst"]["flax"] = max(worst, abs(float(mine.addressable_shards[0].data)
                                             - float(want.addressable_shards[0].data)))


def serving(result: dict[str, Any]) -> None:
    """examples/serving's engine with every layer's paged attention and cache split
    by kv heads over every process's devices: token for token what each request
    decodes alone, without a cache, through flax's own attention."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "examples" / "serving" / "serve.py"
    spec = importlib.util.spec_from_file_location("serving_example", path)
    serve = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = serve  # its dataclasses look their module up
    spec.loader.exec_module(serve)
    n = jax.device_count()
    cfg = serve.transformer.Config(d_model=16 * n, heads=n, kv_heads=n, layers=2, seq=32)
    _, vocab = serve.transformer.load_corpus()
    params = serve.transformer.init_state(cfg, vocab)
    requests = serve.demo_requests(lengths=(3, 20, 7), max_new=5)
    engine = serve.Engine(params, vocab, cfg=cfg, num_pages=12, registry=_registry(),
                          mesh=jax.make_mesh((n,), ("tp",)))
    outputs = engine.run(requests)
    alone = {r.id: serve.decode_alone(params, vocab, r.prompt, r.max_new, cfg) for r in requests}
    result["chosen"]["serving"] = engine.paged.paged.backend.name  # HeadsShardedPaged
    result["worst"]["serving"] = float(sum(outputs[i] != alone[i] for i in alone))


def _timed(result: dict[str, Any], name: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` with its result ready, its seconds in ``result["seconds"]``."""
    start = time.monotonic()
    out = jax.block_until_ready(fn(*args))
    result["seconds"][name] = time.monotonic() - start
    return out


def local(result: dict[str, Any]) -> None:
    """Process 0's local work while the others wait at a barrier, then the same
    jitted function on every process (agreed)."""
    import attn_backends as ab
    import jax.numpy as jnp
    import numpy as np
    from attn_backends.oracle import paged_case
    from attn_backends_contracts._oracle import attention as oracle
    from attn_backends_contracts._oracle import attention_vjp as oracle_vjp

    rng = np.random.default_rng(2)
    q, k, v, d_out = (rng.standard_normal((1, 16, 2, 8)).astype(np.float32) for _ in range(4))
    attention = _registry().get(fallback="silent")

    def loss(q: Any, k: Any, v: Any, causal: bool) -> Any:
        out = attention(q, k, v, causal=causal)
        return jnp.sum(out * d_out), out

    grad = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
    train = jax.jit(grad, static_argnums=3)
    case = paged_case([(3, 3), (2, 7)], page_size=4, hq=4, hkv=2, d=8, seed=1)

    def paged(attention: Any) -> Any:
        cache = attention.write(attention.init_cache(case.k_pages.shape[0]), case.k_rows,
                                case.v_rows, jnp.asarray(case.slots))
        return attention(jnp.asarray(case.q), cache, case.batch())

    def worst(got: Any, causal: bool) -> float:
        grads, out = got
        want = [oracle(q, k, v, causal=causal)[0],
                *list(oracle_vjp(q, k, v, d_out, causal=causal).values())[:3]]
        return max(float(np.abs(np.asarray(g) - w).max())
                   for g, w in zip((out, *grads), want, strict=True))

    from attn_backends.authoring import jax_api

    client = jax_api.distributed_client()
    if jax.process_index() == 0:
        alone = result["local"] = {}
        try:
            out = _timed(result, "eager", lambda: attention(q, k, v))
            alone["eager"] = float(np.abs(np.asarray(out) - oracle(q, k, v)[0]).max())
            alone["eager grad"] = worst(_timed(result, "eager grad", grad, q, k, v, False),
                                        False)
            result["local explain"] = str(attention.explain(q, k, v))
            with ab.local_work():
                alone["jit grad"] = worst(_timed(result, "jit grad", train, q, k, v, True), True)
                local_paged = _timed(result, "get_paged", lambda: _registry().get_paged(
                    num_q_heads=4, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32",
                    fallback="silent"))
                alone["paged"] = float(np.abs(np.asarray(_timed(
                    result, "paged", paged, local_paged)) - case.expected()).max())
                result["refused"] = _spanning_calls(attention, q)
        finally:  # the others go on only when this process is done, failed or not
            client.wait_at_barrier("attn-test-local", 120_000)
    else:
        client.wait_at_barrier("attn-test-local", 120_000)
    # Every process again: the jitted function process 0 traced as local work
    # is traced again here (local_work() is in jit's key), and agreed.
    result["worst"]["jit grad"] = worst(train(q, k, v, True), True)
    result["chosen"]["jit grad"] = attention.explain(
        *[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)], causal=True).chosen


def _spanning_calls(attention: Any, q: Any) -> dict[str, list[str] | None]:
    """Two calls marked local that span processes, each's error (type, message):
    eager on arrays over every process's devices, and jitted under the mesh
    (jax.sharding.set_mesh) of every process's devices."""
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((jax.device_count(),), ("dp",))
    wide = np.concatenate([q] * jax.device_count())
    spread = jax.make_array_from_callback(wide.shape, NamedSharding(mesh, P("dp")),
                                          lambda i: wide[i])
    refused: dict[str, list[str] | None] = {}

    def eager() -> Any:
        return attention(spread, spread, spread)

    def traced() -> Any:
        with jax.sharding.set_mesh(mesh):
            return jax.jit(lambda q: attention(q, q, q))(q)

    for name, call in (("eager", eager), ("jit", traced)):
        try:
            call()
            refused[name] = None
        except Exception as exc:  # noqa: BLE001 - the test reads what was raised
            refused[name] = [type(exc).__name__, str(exc)]
    return refused


def main(process: int, count: int, port: int, scenario: str) -> None:
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=count,
                               process_id=process, initialization_timeout=60)
    # Every process's backend starts together (the cpu client's start is itself
    # a meeting of all processes): a process dies or hangs after it, at its call.
    jax.devices()
    result: dict[str, Any] = {"process": process, "chosen": {}, "worst": {}, "seconds": {},
                              "error": None}
    try:
        if scenario == "die" and process == count - 1:
            os._exit(3)
        if scenario == "hang" and process == count - 1:
            time.sleep(3600)
        if scenario == "quarantined" and process == 1:
            _quarantine(os.environ["ATTN_TEST_QUARANTINE"])
        steps = {"serve": [choose, sharded, ring, paged, train_step, serving],
                 "local": [choose, local],
                 "nocontext": [choose, no_context, paged]}.get(scenario, [choose])
        for step in steps:
            step(result)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which judges it
        result["error"] = [type(exc).__name__, str(exc)]
        result["trace"] = traceback.format_exc()[-2000:]
    print("RESULT " + json.dumps(result), flush=True)
    # Process 0 holds the coordination service: every live process waits here
    # until all have read what they need from it. One whose peer died could
    # not pass jax.distributed's shutdown, so each leaves with os._exit.
    from attn_backends.authoring import jax_api

    alive = [p for p in range(count) if not (scenario in ("die", "hang") and p == count - 1)]
    jax_api.distributed_client().wait_at_barrier("attn-test-done", 120_000, alive)
    os._exit(0)


def _quarantine(name: str) -> None:
    """A failed verdict for ``name`` in this process's cache, as a probe that saw a
    wrong answer leaves it."""
    import attn_backends as ab
    from attn_backends.probe.prober import Prober

    q, k, v = _data(3)
    call, _ = ab.bind(q, k, v, causal=True)
    verdict = Prober(runner=lambda *_: ["probe: out differs (planted by the test)"]).verdict(
        ab.registry.backend(name), call, "cpu")
    assert not verdict.passed and verdict.source == "run", verdict


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
