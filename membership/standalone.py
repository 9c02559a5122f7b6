"""Run one fleet member on its own, driven by JSON lines (used by the Raft tests).

    python -m membership.standalone --config fleet.json --node p1 [--brokers brokers.json]

stdout, one JSON object per line:
  {"type": "started", "node", "pid", "t"}
  {"type": "effective", "node", "epoch", "version", "degraded", "owners", "changed_at", "t"}
      after every change of the effective table
  {"type": "status", "id", "status": {...Member.status()...}, "t"}
  {"type": "result", "id", "op", "ok", "epoch" | "error", "t"}
stdin, one JSON object per line:
  {"op": "status", "id": 1}
  {"op": "drain" | "undrain", "node": "p2", "id": 2}
  {"op": "brokers", "brokers": [{"id": 1, "host": "h", "port": 9092, "rack": null}], "id": 3}
  {"op": "stop"}
EOF on stdin or SIGTERM stops the member cleanly. ``t`` fields are
``time.monotonic()``, comparable across processes on one Linux machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from membership.config import ConfigError, MemberConfig
from membership.serving import ServingMap
from membership.member import Member
from topology import Broker

_print_lock = threading.Lock()


def emit(obj: dict[str, Any]) -> None:
    obj.setdefault("t", time.monotonic())
    line = json.dumps(obj, sort_keys=True, default=str)
    with _print_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def parse_brokers(items: list[dict[str, Any]]) -> list[Broker]:
    return [Broker(int(b["id"]), str(b["host"]), int(b["port"]), b.get("rack")) for b in items]


class _Stop(Exception):
    pass


def _on_sigterm(_signum: int, _frame: Any) -> None:
    raise _Stop


def run_op(member: Member, msg: dict[str, Any]) -> None:
    op, rid = msg.get("op"), msg.get("id")
    try:
        if op == "drain":
            emit({"type": "result", "id": rid, "op": op, "ok": True, "epoch": member.drain(msg["node"])})
        elif op == "undrain":
            emit({"type": "result", "id": rid, "op": op, "ok": True, "epoch": member.undrain(msg["node"])})
        else:
            emit({"type": "result", "id": rid, "op": op, "ok": False, "error": "unknown op"})
    except Exception as exc:  # reported to the driver
        emit({"type": "result", "id": rid, "op": op, "ok": False, "error": f"{type(exc).__name__}: {exc}"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m membership.standalone", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="fleet JSON (MemberConfig.to_dict format)")
    parser.add_argument("--node", help="this member's id (overrides node_id in the file)")
    parser.add_argument("--brokers", help="JSON file: list of {id, host, port, rack} to report at start")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    try:
        config = MemberConfig.from_json_file(args.config, node_id=args.node)
    except (ConfigError, OSError, ValueError, KeyError) as exc:
        print(f"bad configuration: {exc}", file=sys.stderr)
        return 2
    member = Member(config)
    if args.brokers:
        with open(args.brokers) as f:
            member.set_brokers(parse_brokers(json.load(f)))
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        member.start()
    except Exception as exc:
        print(f"start failed: {exc}", file=sys.stderr)
        return 1

    def on_change(eff: ServingMap) -> None:
        emit(
            {
                "type": "effective",
                "node": config.node_id,
                "epoch": eff.epoch,
                "version": eff.version,
                "degraded": eff.degraded,
                "owners": {str(b): p for b, p in eff.owners},
                "changed_at": eff.changed_at,
            }
        )

    member.subscribe(on_change)
    emit({"type": "started", "node": config.node_id, "pid": os.getpid()})
    workers: list[threading.Thread] = []
    try:
        for line in sys.stdin:
            line = line.strip()
            if not line:
                continue
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                emit({"type": "result", "ok": False, "error": "bad json"})
                continue
            op = msg.get("op")
            if op == "stop":
                break
            if op == "status":
                emit({"type": "status", "id": msg.get("id"), "status": member.status().to_json()})
            elif op == "brokers":
                member.set_brokers(parse_brokers(msg.get("brokers", [])))
                emit({"type": "result", "id": msg.get("id"), "op": op, "ok": True})
            else:
                t = threading.Thread(target=run_op, args=(member, msg), daemon=True)
                t.start()
                workers.append(t)
    except _Stop:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        member.stop()
        for t in workers:
            t.join(timeout=config.commit_timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
