"""vlmrl.utils.servers: the port a launched engine's child binds later."""

from __future__ import annotations

import random
import socket

from vlmrl.utils.servers import free_port_below_ephemeral


def test_the_port_below_the_ephemeral_range_is_free_and_drawn_apart_from_the_seeded_global_random():
    """Two processes whose global `random` a vLLM engine seeded alike (SGLang draws its nccl_port from it) drew the
    same port, and the later engine died on EADDRINUSE: vlmrl's draw neither reads nor advances that generator."""
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    random.seed(0)
    state = random.getstate()
    ports = {free_port_below_ephemeral() for _ in range(8)}
    assert random.getstate() == state, "the draw used the global random generator"
    assert len(ports) > 1, ports  # 8 draws from thousands of ports: alike only if the draw were not random
    for port in ports:
        assert 20000 <= port < low
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))  # free
