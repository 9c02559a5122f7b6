"""Floating addresses: how a node takes a vacant node's advertised address and gives it back.

Theory of operation
-------------------
Each node advertises one address (``nodes[].floating_host`` when it floats). On one kernel
(loopback) a survivor stands in for a vacant node by binding its address (``proxy.takeover``);
on real hosts the address itself must move, so
that the vacant host's clients meet a live kernel (RST for old connections, a live node for new
ones). Moving it is the job of an *address mover*, chosen in the config (``[addresses]``):

``none``     today's loopback stand-ins: nothing moves (the default).
``netns``    the test bed's emulated hosts (``kproxy fleet up --hosts netns``): netlink on the
             namespace's ``eth0`` plus a gratuitous ARP; only addresses of the test range
             198.18.0.0/24.
``linux``    the same on a real L2 host: netlink (``ip addr replace/del``) on ``interface``, a gratuitous
             ARP (``arping -U`` from iputils, or a raw ARP frame), for addresses of ``networks``.
``command``  an operator's script (a cloud call that moves a secondary IP, a keepalived hook):
             ``COMMAND take|release ADDRESS/PREFIX NODE``, with the same values in the
             environment (``KPROXY_ACTION``, ``KPROXY_ADDRESS``, ``KPROXY_PREFIX_LEN``,
             ``KPROXY_NODE``, ``KPROXY_INTERFACE``).

Who holds what is decided in ``proxy.takeover`` (pure): a node's own host holds its address
while the committed map has it up; one survivor (``address_holder``) holds a down node's and
listens on all its ports (a node whose host refused a heartbeat, its process gone, counts as
down at once, before the commit that marks it so: the same survivor takes it tens of
milliseconds sooner and keeps it); a draining node keeps its own. A node that stalled or regained quorum
after a degraded spell is fenced (``Fence``): it gives every address back and drops its
connections until it knows the committed epoch.

Layout: ``config`` parses and checks the ``[addresses]`` table (pure); ``plan`` turns a take or a
release into the steps to run (pure: argv lists and ARP frames, testable without root);
``movers`` is the thin shell that runs them (netlink on one kept socket, subprocess, an AF_PACKET
socket); ``floating`` is the data path's shell (takes and releases in the mover's own thread,
ticks the fence); ``tickle``
builds and sends the tickle ACKs that reset a down node's silent clients, and ``peers`` polls
the peers' client lists for them (``GET /clients``). Every mover refuses an address outside its
configured networks, and the ``netns``/``linux`` movers also one that is not on the network of a
link the host holds (``plan.on_link``): a mover never announces an address it does not own.
"""
