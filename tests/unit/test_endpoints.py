"""Bind and advertised addresses (``infra/endpoints.py``) and the holder announcing the advertised one."""

from __future__ import annotations

import pytest

from dora_rl.infra.endpoints import Endpoints, interface_of
from dora_rl.infra.weights.channel import make_weight_server


def test_defaults_keep_the_single_host_behaviour() -> None:
    ep = Endpoints.from_env({})
    assert (ep.bind_host, ep.advertised, ep.address(5), ep.net_devices()) == ("127.0.0.1", "127.0.0.1",
                                                                             "127.0.0.1:5", "lo")


def test_a_wildcard_is_never_announced() -> None:
    with pytest.raises(ValueError, match="DORA_ADVERTISED_HOST"):
        Endpoints.from_env({"DORA_BIND_HOST": "0.0.0.0"})
    with pytest.raises(ValueError, match="wildcard"):
        Endpoints(advertised_host="0.0.0.0")
    ep = Endpoints.from_env({"DORA_BIND_HOST": "0.0.0.0", "DORA_ADVERTISED_HOST": "10.1.2.3"})
    assert ep.address(80) == "10.1.2.3:80" and Endpoints(advertised_host="::1").address(80) == "[::1]:80"


def test_ucx_devices_follow_the_advertised_address() -> None:
    assert interface_of("127.0.0.1") == "lo" and interface_of("192.0.2.77") is None
    assert Endpoints(advertised_host="192.0.2.77").net_devices() == "all", "no local interface holds it (NAT)"
    assert Endpoints(ucx_net_devices="eth1").net_devices() == "eth1"
    assert Endpoints().weight_transport_options("tcp") == {}


def test_a_holder_bound_everywhere_announces_the_advertised_host() -> None:
    server = make_weight_server("tcp", "t" * 32, "0.0.0.0", advertised_host="127.0.0.1")
    try:
        host, port = server.address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
    finally:
        server.close()
