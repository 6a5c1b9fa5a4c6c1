"""The interface that routes to the rendezvous address becomes GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME,
unless the user set them."""
from scaletrain.engine.netif import choose_socket_ifname, interface_of, route_source


def test_loopback_master_picks_lo_and_user_values_are_kept():
    assert route_source("127.0.0.1") == "127.0.0.1" and interface_of("127.0.0.1") == "lo"
    env = {"MASTER_ADDR": "127.0.0.1"}
    assert choose_socket_ifname(env) == "lo"
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo"
    env = {"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "eth9"}
    assert choose_socket_ifname(env) == "lo" and env == {"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "eth9",
                                                          "NCCL_SOCKET_IFNAME": "lo"}
    env = {"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "a", "NCCL_SOCKET_IFNAME": "b"}
    assert choose_socket_ifname(env) is None and env["GLOO_SOCKET_IFNAME"] == "a"
    assert choose_socket_ifname({}) is None  # no rendezvous address: nothing chosen
    assert choose_socket_ifname({"MASTER_ADDR": "no-such-host.invalid"}) is None
