"""Test-only receiver process: one engine rank driven by commands the test posts in the store.

``python receiver_worker.py --port P --label r1 --out DIR``; command ``i`` is the JSON
under ``ctl/<i>``; the outcome goes to ``done/<i>/<label>`` ("ok" or the error text),
received versions to ``DIR/<label>-<tag>.pt``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

from tauflow.weightsync import BucketRequest, GroupSpec, WeightReceiver


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ctl = dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=datetime.timedelta(seconds=120))
    ctl.set(f"ready/{args.label}", "1")
    received = []
    rx = WeightReceiver(received.append, label=args.label)
    i = 0
    while True:
        cmd = json.loads(ctl.get(f"ctl/{i}"))
        outcome = "ok"
        try:
            if args.label in cmd.get("idle", []):
                outcome = "idle"
            elif cmd["op"] == "exit":
                ctl.set(f"done/{i}/{args.label}", "ok")
                return 0
            elif cmd["op"] == "init":
                if args.label in cmd["ranks"]:
                    rx.init_group(GroupSpec(**cmd["group"], rank=cmd["ranks"][args.label]))
            elif cmd["op"] == "recv":
                if args.label in cmd["labels"]:
                    for req in cmd["buckets"]:
                        rx.receive_bucket(BucketRequest(**req))
                    v = received[-1]
                    torch.save(
                        {"tensors": {k: t.clone() for k, t in v.tensors.items()}, "loaded_checksum": v.loaded_checksum},
                        os.path.join(args.out, f"{args.label}-{cmd['tag']}.pt"),
                    )
            elif cmd["op"] == "destroy":
                rx.destroy_group(cmd["group_name"])
        except Exception as e:  # noqa: BLE001 - reported to the test
            outcome = f"{type(e).__name__}: {e}"
        ctl.set(f"done/{i}/{args.label}", outcome)
        i += 1


if __name__ == "__main__":
    sys.exit(main())
