"""Address movers (proxy.addresses) without root: config parsing, the steps of each mover, the
gratuitous ARP frame, and the refusal of addresses the host does not own (fake I/O)."""

from __future__ import annotations

import ipaddress
import subprocess

import pytest

from proxy.addresses.config import MoverConfig, MoverConfigError, parse_mover_config
from proxy.addresses.movers import AddressMover, MoverError
from proxy.addresses.plan import (AddressRefused, FloatingAddress, LinkAddress, RunCommand, SendArp, SetAddress,
                                  announce_steps, gratuitous_arp_frame, parse_mac, release_steps, take_steps)

pytestmark = pytest.mark.unit

P1 = FloatingAddress.parse("198.18.0.11/24", "p1")
ETH0 = [LinkAddress(ipaddress.IPv4Address("198.18.0.12"), 24)]  # p2's own address, primary


# ----------------------------------------------------------------- config
def test_no_table_and_none_are_the_loopback_default():
    assert parse_mover_config(None) == MoverConfig()
    assert parse_mover_config({"mover": "none"}).kind == "none"
    with pytest.raises(MoverConfigError, match="moves nothing; remove \\['interface'\\]"):
        parse_mover_config({"mover": "none", "interface": "eth0"})


def test_netns_defaults_to_eth0_the_test_range_and_raw_arp():
    c = parse_mover_config({"mover": "netns"})
    assert (c.kind, c.interface, c.announce) == ("netns", "eth0", "raw")
    assert [str(n) for n in c.networks] == ["198.18.0.0/24"]
    with pytest.raises(MoverConfigError, match="takes only 198.18.0.0/24"):
        parse_mover_config({"mover": "netns", "networks": ["10.0.0.0/24"]})


def test_linux_needs_an_interface_and_networks():
    c = parse_mover_config({"mover": "linux", "interface": "ens5", "networks": ["10.0.1.0/24"], "announce_count": 3})
    assert (c.interface, c.announce, c.announce_count) == ("ens5", "arping", 3)
    with pytest.raises(MoverConfigError, match="needs the networks"):
        parse_mover_config({"mover": "linux", "interface": "ens5"})
    with pytest.raises(MoverConfigError, match="addresses.interface"):
        parse_mover_config({"mover": "linux", "networks": ["10.0.1.0/24"]})
    with pytest.raises(MoverConfigError, match="addresses.interface"):
        parse_mover_config({"mover": "linux", "interface": "a-name-too-long-x", "networks": ["10.0.1.0/24"]})


def test_command_takes_a_list_or_a_shell_like_string():
    c = parse_mover_config({"mover": "command", "command": "/opt/move-ip --zone a", "networks": ["10.0.1.0/24"]})
    assert c.command == ("/opt/move-ip", "--zone", "a")
    with pytest.raises(MoverConfigError, match="addresses.command"):
        parse_mover_config({"mover": "command", "networks": ["10.0.1.0/24"]})


@pytest.mark.parametrize(("table", "message"), [
    ({"mover": "cloud"}, "addresses.mover: 'cloud' is not one of none, netns, linux, command"),
    ({"mover": "netns", "colour": 1}, "unknown keys \\['colour'\\]"),
    ({"mover": "linux", "interface": "e", "networks": ["10.0.1.300/24"]}, "addresses.networks: '10.0.1.300/24'"),
    ({"mover": "linux", "interface": "e", "networks": "10.0.1.0/24"}, "a list of IPv4 networks"),
    ({"mover": "netns", "timeout_s": 0}, "addresses.timeout_s: a positive number"),
    ({"mover": "netns", "announce_count": 0}, "announce_count: an integer from 1 to 10"),
    ({"mover": "netns", "announce": "shout"}, "addresses.announce: 'shout'"),
])
def test_bad_tables_name_the_key(table, message):
    with pytest.raises(MoverConfigError, match=message):
        parse_mover_config(table)


# ------------------------------------------------------------------ steps
def test_linux_take_adds_the_address_and_announces_it_with_arping_release_deletes_it():
    c = parse_mover_config({"mover": "linux", "interface": "ens5", "networks": ["198.18.0.0/24"]})
    ip = ipaddress.IPv4Address("198.18.0.11")
    assert take_steps(c, P1) == [
        SetAddress("ens5", ip, 24, present=True),
        RunCommand(("arping", "-U", "-c", "2", "-I", "ens5", "198.18.0.11"))]
    assert release_steps(c, P1) == [SetAddress("ens5", ip, 24, present=False)]


def test_netns_take_sends_raw_gratuitous_arp():
    steps = take_steps(parse_mover_config({"mover": "netns", "announce_count": 3}), P1)
    assert steps[1] == SendArp("eth0", ipaddress.IPv4Address("198.18.0.11"), 3)


def test_command_mover_runs_the_script_with_arguments_and_environment():
    c = parse_mover_config({"mover": "command", "command": ["/opt/move-ip"], "networks": ["10.0.1.0/24"]})
    a = FloatingAddress.parse("10.0.1.7/24", "p3")
    (step,) = take_steps(c, a)
    assert step.argv == ("/opt/move-ip", "take", "10.0.1.7/24", "p3")
    assert dict(step.env) == {"KPROXY_ACTION": "take", "KPROXY_ADDRESS": "10.0.1.7", "KPROXY_PREFIX_LEN": "24",
                              "KPROXY_NODE": "p3", "KPROXY_INTERFACE": ""}
    assert release_steps(c, a)[0].argv == ("/opt/move-ip", "release", "10.0.1.7/24", "p3")


def test_announcing_again_is_the_take_without_the_address_change():
    linux = parse_mover_config({"mover": "linux", "interface": "ens5", "networks": ["198.18.0.0/24"]})
    assert announce_steps(linux, P1) == [RunCommand(("arping", "-U", "-c", "2", "-I", "ens5", "198.18.0.11"))]
    assert announce_steps(parse_mover_config({"mover": "netns"}), P1) == [
        SendArp("eth0", ipaddress.IPv4Address("198.18.0.11"), 2)]
    command = parse_mover_config({"mover": "command", "command": ["/opt/move-ip"], "networks": ["10.0.1.0/24"]})
    assert announce_steps(command, FloatingAddress.parse("10.0.1.7/24", "p3")) == []
    assert announce_steps(MoverConfig(), P1) == []


def test_none_mover_has_no_steps():
    assert take_steps(MoverConfig(), P1) == [] and release_steps(MoverConfig(), P1) == []


def test_gratuitous_arp_frame_is_a_broadcast_request_from_and_for_the_address():
    mac = parse_mac("02:fc:00:00:00:01")
    frame = gratuitous_arp_frame(mac, ipaddress.IPv4Address("198.18.0.11"))
    assert len(frame) == 60
    assert frame[:6] == b"\xff" * 6 and frame[6:12] == mac and frame[12:14] == b"\x08\x06"
    # htype 1, ptype IPv4, hlen 6, plen 4, op 1 (request)
    assert frame[14:22] == bytes([0, 1, 8, 0, 6, 4, 0, 1])
    assert frame[22:28] == mac and frame[28:32] == bytes([198, 18, 0, 11])  # sender
    assert frame[32:38] == b"\x00" * 6 and frame[38:42] == bytes([198, 18, 0, 11])  # target = sender
    assert frame[42:] == b"\x00" * 18
    with pytest.raises(ValueError):
        parse_mac("02:fc:00")


# ---------------------------------------------------------------- refusal
class FakeIo:
    def __init__(self, held: list[LinkAddress], codes: dict[str, int] | None = None) -> None:
        self.held = held
        self.codes = codes or {}
        self.ran: list[tuple[str, ...]] = []
        self.frames: list[tuple[str, bytes]] = []

    def mover(self, table: dict) -> AddressMover:
        return AddressMover(parse_mover_config(table), run=self.run, set_address=self.set_address,
                            link_addresses=lambda iface: self.held,
                            mac_of=lambda iface: b"\x02\x00\x00\x00\x00\x0c",
                            send=lambda iface, frame: self.frames.append((iface, frame)))

    def set_address(self, step: SetAddress) -> None:
        verb = "add" if step.present else "del"
        self.ran.append((verb, f"{step.ip}/{step.prefix_len}", step.interface))
        if self.codes.get(verb):
            raise OSError(self.codes[verb], "Operation not permitted")

    def run(self, step: RunCommand, timeout_s: float) -> subprocess.CompletedProcess[str]:
        self.ran.append(step.argv)
        code = self.codes.get(step.argv[0] + " " + step.argv[2] if len(step.argv) > 2 else step.argv[0], 0)
        return subprocess.CompletedProcess(list(step.argv), code, "", "RTNETLINK answers: File exists" if code else "")


def test_netns_mover_takes_an_address_on_its_link_and_announces_it():
    io = FakeIo(ETH0)
    io.mover({"mover": "netns"}).take(P1)
    assert io.ran == [("add", "198.18.0.11/24", "eth0")]
    assert len(io.frames) == 2 and io.frames[0][0] == "eth0" and io.frames[0][1][28:32] == bytes([198, 18, 0, 11])


@pytest.mark.parametrize(("address", "held", "message"), [
    ("198.18.1.11/24", ETH0, "outside the networks"),  # not in the test range
    ("198.18.0.11/24", [LinkAddress(ipaddress.IPv4Address("198.18.0.130"), 25)], "not on a link this host holds"),
    ("198.18.0.11/24", [], "no address"),  # the link holds nothing: nothing is ours
    ("198.18.0.12/24", ETH0, "primary address of eth0"),  # the host's own address is not floating
    ("198.18.0.11/25", ETH0, "prefix differs"),
])
def test_mover_refuses_addresses_it_does_not_own_and_runs_nothing(address, held, message):
    io = FakeIo(held)
    mover = io.mover({"mover": "netns"})
    with pytest.raises(AddressRefused, match=message):
        mover.take(FloatingAddress.parse(address, "p1"))
    with pytest.raises(AddressRefused, match=message):
        mover.release(FloatingAddress.parse(address, "p1"))
    assert io.ran == [] and io.frames == []


def test_command_mover_refuses_outside_its_networks():
    io = FakeIo([])
    mover = io.mover({"mover": "command", "command": ["/opt/move-ip"], "networks": ["10.0.1.0/24"]})
    with pytest.raises(AddressRefused, match="outside the networks"):
        mover.take(FloatingAddress.parse("10.0.2.7/24", "p3"))
    mover.take(FloatingAddress.parse("10.0.1.7/24", "p3"))
    assert io.ran == [("/opt/move-ip", "take", "10.0.1.7/24", "p3")]


def test_the_floating_addresses_a_host_holds_are_its_secondary_ones_in_the_networks():
    held = [*ETH0, LinkAddress(ipaddress.IPv4Address("198.18.0.11"), 24, secondary=True),
            LinkAddress(ipaddress.IPv4Address("198.18.0.13"), 24, secondary=True),
            LinkAddress(ipaddress.IPv4Address("10.9.0.5"), 24, secondary=True)]  # outside the networks
    io = FakeIo(held)
    assert io.mover({"mover": "netns"}).held_floating() == [ipaddress.IPv4Address("198.18.0.11"),
                                                           ipaddress.IPv4Address("198.18.0.13")]
    assert io.mover({"mover": "none"}).held_floating() == []
    assert io.mover({"mover": "command", "command": "/opt/move-ip", "networks": ["198.18.0.0/24"]}).held_floating() == []


def test_a_failed_step_is_a_mover_error_and_nothing_is_announced():
    held = [*ETH0, LinkAddress(ipaddress.IPv4Address("198.18.0.11"), 24, secondary=True)]
    io = FakeIo(held, codes={"add": 1})
    with pytest.raises(MoverError, match="add 198.18.0.11/24 on eth0: .*Operation not permitted"):
        io.mover({"mover": "netns"}).take(P1)
    assert io.frames == []  # not announced when the address could not be added
    failed = FakeIo(held, codes={"del": 1})
    with pytest.raises(MoverError, match="delete 198.18.0.11/24 on eth0"):
        failed.mover({"mover": "netns"}).release(P1)
    assert failed.ran == [("del", "198.18.0.11/24", "eth0")]
    failing_command = FakeIo([], codes={"/opt/move-ip 10.0.1.7/24": 3})
    with pytest.raises(MoverError, match="/opt/move-ip take 10.0.1.7/24 p3 exited 3"):
        failing_command.mover({"mover": "command", "command": ["/opt/move-ip"], "networks": ["10.0.1.0/24"]}).take(
            FloatingAddress.parse("10.0.1.7/24", "p3"))


@pytest.mark.parametrize("all_value, if_value, warned", [(0, 0, True), (1, 0, True), (0, 2, False), (2, 0, False)])
def test_a_host_whose_arp_requests_may_name_a_floating_address_is_warned_about(all_value, if_value, warned):
    mover = AddressMover(parse_mover_config({"mover": "linux", "interface": "ens5", "networks": ["10.0.1.0/24"]}),
                         arp_announce=lambda interface: (all_value, if_value))
    warning = mover.host_warning()
    assert (warning is not None) is warned
    if warned:
        assert "net.ipv4.conf.ens5.arp_announce" in warning and f"is {max(all_value, if_value)}" in warning


def test_movers_without_a_link_of_their_own_have_no_arp_setting_to_check():
    def unreadable(interface: str) -> tuple[int, int]:
        raise OSError(f"no /proc/sys/net/ipv4/conf/{interface}")

    for table in ({}, {"mover": "command", "command": ["/bin/true"], "networks": ["10.0.1.0/24"]}):
        assert AddressMover(parse_mover_config(table), arp_announce=unreadable).host_warning() is None
    netns = AddressMover(parse_mover_config({"mover": "netns"}), arp_announce=unreadable)
    assert "cannot read the arp_announce of eth0" in (netns.host_warning() or "")


def test_netlink_reads_addresses_in_a_process_that_runs_pysyncobj():
    """pysyncobj's import replaces socket.inet_ntop with a Windows-only shim; membership.raft puts
    it back, or the mover (pyroute2) cannot decode a single address in a node's process. A fresh
    interpreter, so that the import order is a node's: pysyncobj first, the mover later."""
    import sys

    script = ("import pysyncobj, socket, _socket\n"
              "broken = socket.inet_ntop is not _socket.inet_ntop\n"
              "import membership.raft\n"
              "from proxy.addresses.movers import read_link_addresses\n"
              "print(broken, '127.0.0.1' in [str(a.ip) for a in read_link_addresses('lo')])\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "True"]


def test_gratuitous_arp_frames_share_one_packet_socket_per_interface_until_a_send_fails(monkeypatch):
    from proxy.addresses import movers

    opened: list["FakeSocket"] = []

    class FakeSocket:
        def __init__(self, family: int, kind: int) -> None:
            self.sent: list[bytes] = []
            self.closed = False
            self.fail = False
            opened.append(self)

        def bind(self, address: tuple[str, int]) -> None:
            self.interface = address[0]

        def send(self, frame: bytes) -> int:
            if self.fail:
                raise OSError(100, "Network is down")
            self.sent.append(frame)
            return len(frame)

        def close(self) -> None:
            self.closed = True

    monkeypatch.setattr(movers.socket, "socket", FakeSocket)
    monkeypatch.setattr(movers, "_packet_sockets", {})
    for frame in (b"a", b"b", b"c"):
        movers.send_frame("eth0", frame)
    movers.send_frame("eth1", b"d")
    assert [(s.interface, s.sent) for s in opened] == [("eth0", [b"a", b"b", b"c"]), ("eth1", [b"d"])]
    opened[0].fail = True
    with pytest.raises(OSError):
        movers.send_frame("eth0", b"e")
    assert opened[0].closed and sorted(movers._packet_sockets) == ["eth1"]
    movers.send_frame("eth0", b"f")  # opened anew
    assert len(opened) == 3 and opened[2].sent == [b"f"]
