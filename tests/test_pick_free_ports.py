"""``jaxdist.testing.pick_free_ports``: ports that stay free until the server binds them."""

import socket

from jaxdist.testing import pick_free_ports


def _ephemeral_low() -> int | None:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError):
        return None


def test_ports_are_distinct_bindable_and_never_repeated_by_one_process():
    first = pick_free_ports(20)
    second = pick_free_ports(20)
    assert len(set(first + second)) == 40
    for port in first:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_ports_lie_below_the_kernels_ephemeral_range_where_it_is_known():
    """An outgoing connection gets an ephemeral port: one of ours there can be taken between the
    pick and the server's bind (the 'Address already in use' a cluster task then dies of)."""
    low = _ephemeral_low()
    ports = pick_free_ports(10)
    if low is not None and low > 11000:
        assert all(p < low for p in ports), (low, ports)


def test_a_port_another_socket_listens_on_is_never_picked():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        assert taken not in pick_free_ports(50)


def test_zero_ports():
    assert pick_free_ports(0) == []
