"""Parameter-server benchmarks: pull/push bandwidth vs raw loopback TCP and memcpy, and
asynchronous training steps/s with 2 workers and 1 or 2 ps.

Every process is a real process on 127.0.0.1 (JAX on CPU, one device each).

Example:
    $ python -m benchmarks.bench_ps            # full table
    $ python -m benchmarks.bench_ps --quick    # fewer repeats / steps
    $ python -m benchmarks.bench_ps --no-training --repeats 15   # transfers only
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

from jaxdist.testing import pick_free_ports

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "bench-token"
MiB = 1 << 20
MAX_BYTES = 256 * MiB


def _env(cluster: dict, task_type: str, index: int) -> dict[str, str]:
    env = dict(os.environ)
    env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": task_type,
                                                                "index": index},
                                   "token": TOKEN})
    if not os.environ.get("JAXDIST_INSECURE"):  # mutual TLS, as python -m jaxdist.launch
        from jaxdist.testing.tls import task_tls

        env.update(task_tls().env())
    env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=1",
               PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def _start_ps(cluster: dict, index: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "jaxdist.server"],
                            env=_env(cluster, "ps", index), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "listening on" in line:
            return proc
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"ps:{index} did not start")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---------------------------------------------------------------------- raw TCP / TLS
def _reference_tls(side: str):
    """The ssl context of the hand-written reference socket (None: plain TCP): the same
    certificates and settings as the ps direct transport, from ``JAXDIST_TLS_*``."""
    if os.environ.get("JAXDIST_INSECURE"):
        return None
    from jaxdist._src.security.tls import resolve_tls
    from jaxdist._src.transport import direct

    tls = resolve_tls(None, "the reference socket")
    return direct.server_context(tls) if side == "server" else direct.client_context(tls)


def _tcp_server(port: int) -> None:
    """Child process: for each request of 9 bytes (op, n), send n bytes; or receive n bytes."""
    srv = socket.create_server(("127.0.0.1", port))
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ctx = _reference_tls("server")
    if ctx is not None:
        conn = ctx.wrap_socket(conn, server_side=True)
    payload = memoryview(np.ones(MAX_BYTES, np.uint8))
    sink = np.empty(MAX_BYTES, np.uint8)
    head = bytearray(9)
    while True:
        got = 0
        while got < 9:
            k = conn.recv_into(memoryview(head)[got:])
            if not k:
                return
            got += k
        op, n = head[:1], int.from_bytes(head[1:], "little")
        if op == b"g":
            conn.sendall(payload[:n])
        else:
            view, got = memoryview(sink), 0
            while got < n:
                got += conn.recv_into(view[got:n])
            conn.sendall(b"k")


class _TCPPeer:
    """Client end of a raw loopback socket to ``--tcp-server`` (the hand-written reference):
    plain TCP, or TLS with the ps's certificates when the ps speaks TLS."""

    def __init__(self):
        port = pick_free_ports(1)[0]
        env = dict(os.environ, PYTHONPATH=REPO)
        if not os.environ.get("JAXDIST_INSECURE"):
            from jaxdist.testing.tls import task_tls

            env.update(task_tls().env())
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.bench_ps",
                                      "--tcp-server", str(port)], cwd=REPO, env=env)
        for _ in range(200):
            try:
                self.sock = socket.create_connection(("127.0.0.1", port))
                break
            except OSError:
                time.sleep(0.05)
        else:
            self.proc.kill()
            raise RuntimeError("the TCP baseline server did not start")
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ctx = _reference_tls("client")
        if ctx is not None:
            self.sock = ctx.wrap_socket(self.sock, server_hostname="127.0.0.1")
        self.buf = np.empty(MAX_BYTES, np.uint8)
        self.src = memoryview(np.ones(MAX_BYTES, np.uint8))

    def get(self, n: int) -> None:
        """Receives n bytes the server sends (the counterpart of a pull)."""
        self.sock.sendall(b"g" + n.to_bytes(8, "little"))
        view, got = memoryview(self.buf), 0
        while got < n:
            got += self.sock.recv_into(view[got:n])

    def put(self, n: int) -> None:
        """Sends n bytes and waits for the server's acknowledgement (a push)."""
        self.sock.sendall(b"p" + n.to_bytes(8, "little"))
        self.sock.sendall(self.src[:n])
        self.sock.recv(1)

    def close(self) -> None:
        self.sock.close()
        self.proc.wait(10)


#: Transfers timed in alternation, round after round: the reference and the ps calls share
#: every round (the same load on a busy machine); the gRPC-only calls get their own rounds
#: afterwards (gRPC's threads keep working in the ps process for a while after each call
#: (stream teardown, completion queue), which slowed the next direct call by up to ~50%).
OPS = (("ref_get", "ps_pull", "ref_put", "ps_push"), ("grpc_pull", "grpc_push"))


#: A timed sample of a size repeats its transfer this many bytes' worth (at least once): one
#: 1 MiB transfer takes ~0.3 ms, where one preemption on a busy machine moves the sample 2x.
SAMPLE_BYTES = 4 * (1 << 20)


def _transfer_times(sizes: list[int], repeats: int
                    ) -> tuple[dict[int, dict[str, float]], dict[int, dict[str, list[float]]]]:
    """Median seconds of one reference get/put, ps pull/push (direct transport, the default)
    and ps pull/push over gRPC only, per size; and every round's seconds (for same-round
    ratios).

    The reference and ps transfers of a size alternate within every round (after one
    warm-up each), so both see the same load on a busy machine; then the gRPC-only
    transfers alternate in rounds of their own (``OPS``). Each sample times
    ``SAMPLE_BYTES // size`` transfers back to back (at least one).
    """
    from jaxdist.ps import PSClient

    cluster = {"ps": [f"127.0.0.1:{pick_free_ports(1)[0]}"]}
    proc = _start_ps(cluster, 0)
    tcp = _TCPPeer()
    out: dict[int, dict[str, float]] = {}
    rounds: dict[int, dict[str, list[float]]] = {}
    try:
        client = PSClient(cluster["ps"], TOKEN, timeout=120)
        grpc_client = PSClient(cluster["ps"], TOKEN, timeout=120, direct_transport=False)
        for n in sizes:
            x = np.ones(n // 4, np.float32)
            key = f"x{n}"
            client.call(0, "Create", {"specs": {key: {}}}, {key: x})
            ops = {
                "ref_get": lambda n=n: tcp.get(n),
                "ps_pull": lambda key=key: client.call(0, "Pull", {"keys": [key]}),
                "grpc_pull": lambda key=key: grpc_client.call(0, "Pull", {"keys": [key]}),
                "ref_put": lambda n=n: tcp.put(n),
                "ps_push": lambda key=key, x=x: client.call(0, "Push", {"versions": {key: 0}},
                                                            {key: x}),
                "grpc_push": lambda key=key, x=x: grpc_client.call(
                    0, "Push", {"versions": {key: 0}}, {key: x}),
            }
            times: dict[str, list[float]] = {name: [] for name in ops}
            k = max(1, SAMPLE_BYTES // n)
            for group in OPS:
                for name in group:
                    ops[name]()  # warm-up
                for _ in range(repeats):
                    for name in group:
                        t0 = time.perf_counter()
                        for _ in range(k):
                            ops[name]()
                        times[name].append((time.perf_counter() - t0) / k)
            out[n] = {name: statistics.median(t) for name, t in times.items()}
            rounds[n] = times
        if client.direct_calls == 0:
            raise RuntimeError("the ps client never used the direct transport")
        client.close()
        grpc_client.close()
    finally:
        tcp.close()
        _stop(proc)
    return out, rounds


def _memcpy_time(n: int, repeats: int) -> float:
    a, b = np.ones(n, np.uint8), np.empty(n, np.uint8)
    return _median_time(lambda: np.copyto(b, a), repeats)


# ---------------------------------------------------------------------- ps-side updates
def _update_times(n: int, repeats: int) -> list[tuple[str, float, float]]:
    """Per optimizer: ms of one ps update of an ``n``-byte float32 variable, and ms of the same
    optax update hand-written in JAX (jit with donation on device-resident arrays)."""
    import jax
    import jax.numpy as jnp
    import optax

    from jaxdist._src.transport.memory import aligned_copy
    from jaxdist.ps import ParameterService
    from jaxdist.ps import optimizers as O

    rows = []
    size = n // 4
    grad = aligned_copy(np.full(size, 1e-3, np.float32))   # as decoded from the wire
    for name, spec in (("assign_add", None), ("sgd", O.sgd(0.1)), ("adam", O.adam(1e-3))):
        svc = ParameterService("bench")
        svc.create({"w": np.ones(size, np.float32)},
                   {"w": {"optimizer": spec.to_json() if spec else None}})
        step = [0]

        def ps_update(svc=svc, step=step):
            svc.push({"w": grad}, {"w": step[0]})
            step[0] += 1

        tx = spec.build() if spec else None

        def update(p, s, g, tx=tx):
            if tx is None:
                return p + g, s
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        jitted = jax.jit(update, donate_argnums=(0, 1))
        state = {"p": jnp.ones(size, jnp.float32), "g": jnp.asarray(grad)}
        state["s"] = tx.init(state["p"]) if tx else jnp.zeros(())

        def hand(state=state, jitted=jitted):
            state["p"], state["s"] = jitted(state["p"], state["s"], state["g"])
            jax.block_until_ready(state["p"])

        rows.append((name, _median_time(ps_update, repeats) * 1e3,
                     _median_time(hand, repeats) * 1e3))
    return rows


# ---------------------------------------------------------------------- async training
def _worker(steps: int, hidden: int, local: bool) -> None:
    """Child process: a worker of an asynchronous MLP training run (``local``: the same step
    hand-written in JAX on local parameters, no ps); prints steps and time."""
    import jax
    import jax.numpy as jnp
    import optax

    import jaxdist
    from jaxdist.ps import optimizers as O

    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    rng = np.random.default_rng(index)
    x = rng.normal(size=(64, 784)).astype(np.float32)
    y = rng.integers(0, 10, size=(64,))

    def init():
        k1, k2 = jax.random.split(jax.random.key(0))
        return {"w1": jax.random.normal(k1, (784, hidden)) * 0.05, "b1": jnp.zeros(hidden),
                "w2": jax.random.normal(k2, (hidden, 10)) * 0.05, "b2": jnp.zeros(10)}

    def loss(p, xb, yb):
        h = jax.nn.relu(xb @ p["w1"] + p["b1"])
        logits = h @ p["w2"] + p["b2"]
        per = -jnp.take_along_axis(jax.nn.log_softmax(logits), yb[:, None], 1)[:, 0]
        return jaxdist.compute_average_loss(per, global_batch_size=64)

    if local:  # hand-written: jit(grad + adam) with donated parameters, no ps
        tx = optax.adam(1e-3)

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def train_step(p, s, xb, yb):
            g = jax.grad(loss)(p, xb, yb)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        state = [init(), None]
        state[1] = tx.init(state[0])
        xb, yb = jnp.asarray(x), jnp.asarray(y)

        def step():
            state[0], state[1] = train_step(state[0], state[1], xb, yb)
            jax.block_until_ready(state[0])
    else:
        num_ps = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["ps"])
        strategy = jaxdist.ParameterServerStrategy(
            variable_partitioner=jaxdist.FixedShardsPartitioner(num_ps) if num_ps > 1 else None,
            timeout=60)
        params = strategy.create_variables(init, O.adam(1e-3), name="mlp")
        grad_fn = jax.grad(loss)

        def step():
            grads = strategy.run(grad_fn, args=(params, x, y))
            params.apply_gradients(grads)

    step()  # compile
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    print(json.dumps({"steps": steps, "elapsed": time.perf_counter() - t0}))


def _async_steps_per_s(num_ps: int, steps: int, hidden: int, local: bool = False,
                       workers: int = 2) -> tuple[float, float]:
    """(total steps/s, slowest worker's steps/s) of ``workers`` asynchronous workers."""
    ports = pick_free_ports(num_ps + workers)
    cluster = {"ps": [f"127.0.0.1:{p}" for p in ports[:num_ps]],
               "worker": [f"127.0.0.1:{p}" for p in ports[num_ps:]]}
    ps = [] if local else [_start_ps(cluster, i) for i in range(num_ps)]
    try:
        cmd = [sys.executable, "-m", "benchmarks.bench_ps", "--worker", str(steps),
               "--hidden", str(hidden)] + (["--local"] if local else [])
        procs = [subprocess.Popen(cmd, env=_env(cluster, "worker", i), cwd=REPO,
                                  stdout=subprocess.PIPE, text=True) for i in range(workers)]
        outs = []
        for w in procs:
            text = w.communicate(timeout=600)[0]
            if w.returncode:
                raise RuntimeError(f"a benchmark worker failed (exit {w.returncode})")
            outs.append(json.loads(text.strip().splitlines()[-1]))
    finally:
        for p in ps:
            _stop(p)
    total = sum(o["steps"] for o in outs)
    wall = max(o["elapsed"] for o in outs)
    return total / wall, min(o["steps"] / o["elapsed"] for o in outs)


def _print_transfers(sizes: list[int], repeats: int, transport: str) -> None:
    times, rounds = _transfer_times(sizes, repeats)
    ref = "TCP" if transport == "plaintext" else "TLS"
    tls_note = " with the same mutual-TLS certificates" if ref == "TLS" else ""
    print(f"\n{'size':>7} {'memcpy':>7} {ref + ' get':>8} {ref + ' put':>8} {'ps pull':>8} "
          f"{'ps push':>8} {'grpc pull':>9} {'grpc push':>9} {'pull/ref':>8} {'push/ref':>8} "
          f"{'same-round':>10}")
    for n in sizes:
        mem = n / _memcpy_time(n, repeats) / 1e9
        rg, rp, pp, pu, gp, gu = (n / times[n][op] / 1e9 for op in
                                  ("ref_get", "ref_put", "ps_pull", "ps_push", "grpc_pull",
                                   "grpc_push"))
        r = rounds[n]
        same = [statistics.median(a / b for a, b in zip(r[ref_op], r[op]))
                for ref_op, op in (("ref_get", "ps_pull"), ("ref_put", "ps_push"))]
        print(f"{n // MiB:>4}MiB {mem:>7.2f} {rg:>8.2f} {rp:>8.2f} {pp:>8.2f} {pu:>8.2f} "
              f"{gp:>9.2f} {gu:>9.2f} {pp / rg:>8.2f} {pu / rp:>8.2f} "
              f"{same[0]:>4.2f}/{same[1]:.2f}")
    print(f"(GB/s, median of {repeats} interleaved rounds, each sample {SAMPLE_BYTES // MiB} MiB "
          f"of transfers back to back; same-round: the median over rounds of the pull/ref and "
          f"push/ref ratios within a round; ps = the default direct transport, "
          f"grpc = the same calls over gRPC only, in rounds of their own; the reference "
          f"({ref}, in the ps's rounds) is a hand-written "
          f"socket transfer of the same bytes between two processes{tls_note}; push = "
          f"transfer + assign_add on the ps; targets: pull/ref and push/ref >= 0.5 at 1 MiB, "
          f">= 0.6 at 64 and 256 MiB)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_ps")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, help="rounds per transfer (default 7, 3 quick)")
    parser.add_argument("--no-training", action="store_true",
                        help="only the pull/push table, no asynchronous training")
    parser.add_argument("--no-transfers", action="store_true",
                        help="only the asynchronous training tables")
    parser.add_argument("--insecure", action="store_true",
                        help="plaintext on loopback instead of mutual TLS (the default)")
    parser.add_argument("--both", action="store_true",
                        help="the pull/push table with plaintext and with mutual TLS")
    parser.add_argument("--sizes", help="comma-separated MiB (default 1,16,64,256; quick 1,16)")
    parser.add_argument("--tcp-server", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=int, default=256, help=argparse.SUPPRESS)
    parser.add_argument("--local", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tcp_server:
        return _tcp_server(args.tcp_server)
    if args.worker:
        return _worker(args.worker, args.hidden, args.local)
    repeats = args.repeats or (3 if args.quick else 7)
    steps = 30 if args.quick else 200
    if args.sizes:
        sizes = [int(float(v) * MiB) for v in args.sizes.split(",")]
    else:
        sizes = [MiB, 16 * MiB] if args.quick else [MiB, 16 * MiB, 64 * MiB, 256 * MiB]
    modes = ["plaintext", "mutual TLS"] if args.both else (
        ["plaintext"] if args.insecure else ["mutual TLS"])
    print(f"jaxdist parameter-server benchmark ({os.cpu_count()} CPUs, loopback)")
    from benchmarks.common import print_machine

    print_machine()
    for transport in modes:
        _set_transport(transport)
        if not args.no_transfers:
            print(f"\npull / push ({transport})")
            _print_transfers(sizes, repeats, transport)
    if not args.no_transfers:
        print(f"\nps-side update of one {64}MiB float32 variable (in-process service, gradient "
              f"as decoded from the wire) vs the same optax update hand-written in JAX (jit, "
              f"donated device arrays)")
        print(f"{'optimizer':>10} {'ps ms':>8} {'jax ms':>8} {'ps/jax':>7}")
        for name, ps_ms, jax_ms in _update_times(64 * MiB, repeats):
            print(f"{name:>10} {ps_ms:>8.1f} {jax_ms:>8.1f} {ps_ms / jax_ms:>7.2f}")
    if args.no_training:
        return None
    widths = [256] if args.quick else [256, 1024, 2048]
    print(f"\nasync training ({modes[-1]}), 2 workers, MLP 784-H-10, batch 64, adam on the "
          f"ps, {steps} steps/worker; variables split over the ps tasks "
          f"(FixedShardsPartitioner(ps tasks)); hand-written = the same step as jit(grad + "
          f"adam) on local parameters in each worker process (no ps)")
    print(f"{'hidden':>6} {'ps tasks':>8} {'steps/s (all)':>14} {'slowest worker':>15} "
          f"{'hand-written':>13} {'ratio':>6}")
    for hidden in widths:
        local, _ = _async_steps_per_s(1, steps, hidden, local=True)
        for num_ps in ([1] if hidden != widths[-1] or args.quick else [1, 2, 4]):
            total, slowest = _async_steps_per_s(num_ps, steps, hidden)
            print(f"{hidden:>6} {num_ps:>8} {total:>14.1f} {slowest:>15.1f} {local:>13.1f} "
                  f"{total / local:>6.2f}", flush=True)


def _set_transport(transport: str) -> None:
    if transport == "plaintext":
        os.environ["JAXDIST_INSECURE"] = "1"
        for key in ("JAXDIST_TLS_CA", "JAXDIST_TLS_CERT", "JAXDIST_TLS_KEY"):
            os.environ.pop(key, None)
    else:
        from jaxdist.testing.tls import install_process_tls

        install_process_tls()


if __name__ == "__main__":
    main()
