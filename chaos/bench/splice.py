"""Go/no-go for proxy.splice: CPU per GB of a loopback TCP forwarder, recv_into + send vs splice(2) via a pipe.

sender process --TCP--> forwarder (this process, measured) --TCP--> receiver process
Modes alternate A/B/A/B. Forwarder CPU = getrusage(RUSAGE_SELF) user+sys around the run.

    python -m chaos.bench.splice --gb 1 --rounds 4     # BENCHMARKS.md, "Proxy overhead"
"""
from __future__ import annotations

import argparse
import fcntl
import json
import multiprocessing as mp
import os
import resource
import socket
import time

HOST = "127.0.0.31"  # the bench's address (kproxy bench proxy uses it too: not at the same time)
CHUNK = 1 << 20
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


def sender(port, total):
    s = socket.create_connection((HOST, port))
    buf = os.urandom(CHUNK)
    sent = 0
    while sent < total:
        s.sendall(buf)
        sent += CHUNK
    s.close()


def receiver(lsock, q):
    c, _ = lsock.accept()
    buf = bytearray(CHUNK)
    n = 0
    while True:
        r = c.recv_into(buf)
        if not r:
            break
        n += r
    q.put(n)


def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_utime, r.ru_stime


def fwd_copy(src, dst):
    buf = memoryview(bytearray(CHUNK))
    n = 0
    calls = 0
    while True:
        r = src.recv_into(buf)
        if not r:
            return n, calls
        dst.sendall(buf[:r])
        n += r
        calls += 1


def fwd_splice(src, dst, pipe_sz):
    rp, wp = os.pipe()
    try:
        fcntl.fcntl(wp, F_SETPIPE_SZ, pipe_sz)
        sfd, dfd = src.fileno(), dst.fileno()
        n = 0
        calls = 0
        while True:
            r = os.splice(sfd, wp, pipe_sz, flags=os.SPLICE_F_MOVE)
            if not r:
                return n, calls
            left = r
            while left:
                left -= os.splice(rp, dfd, left, flags=os.SPLICE_F_MOVE)
            n += r
            calls += 1
    finally:
        os.close(rp)
        os.close(wp)


def _listener():
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((HOST, 0))
    s.listen(1)
    return s


def run(mode, total, pipe_sz):
    ctx = mp.get_context("fork")
    rl = _listener()
    q = ctx.Queue()
    rp = ctx.Process(target=receiver, args=(rl, q)); rp.start()
    sl = _listener()
    sp = ctx.Process(target=sender, args=(sl.getsockname()[1], total)); sp.start()
    src, _ = sl.accept()
    dst = socket.create_connection((HOST, rl.getsockname()[1]))
    c0, u0, s0 = cpu()
    t0 = time.perf_counter()
    if mode == "copy":
        n, calls = fwd_copy(src, dst)
    else:
        n, calls = fwd_splice(src, dst, pipe_sz)
    dst.shutdown(socket.SHUT_WR)
    c1, u1, s1 = cpu()
    t1 = time.perf_counter()
    got = q.get(timeout=60)
    sp.join(60); rp.join(60)
    for s in (src, dst, sl, rl):
        s.close()
    assert n == total == got, (n, total, got)
    gb = n / 1e9
    return {"mode": mode, "gb": round(gb, 3), "wall_s": round(t1 - t0, 2), "MB_s": round(n / 1e6 / (t1 - t0)),
            "cpu_s_per_gb": round((c1 - c0) / gb, 3), "user": round((u1 - u0) / gb, 3),
            "sys": round((s1 - s0) / gb, 3), "calls": calls}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    total = int(a.gb * 1e9) // CHUNK * CHUNK
    with open("/proc/sys/fs/pipe-max-size") as f:
        pipe_sz = min(CHUNK, int(f.read()))
    print("pipe size", pipe_sz, "load", os.getloadavg())
    res = []
    for i in range(a.rounds):
        for mode in ("copy", "splice"):
            r = run(mode, total, pipe_sz)
            res.append(r)
            print(json.dumps(r), flush=True)
    for mode in ("copy", "splice"):
        v = sorted(r["cpu_s_per_gb"] for r in res if r["mode"] == mode)
        print(mode, "median cpu_s_per_gb", v[len(v) // 2], v)
    print("load", os.getloadavg())
