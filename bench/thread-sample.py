#!/usr/bin/env python3
"""CPU use of a process's threads over a window, by thread name, and of the whole machine.

    thread-sample.py --pid PID [--delay S] [--window S] [--also PATTERN]

Waits --delay seconds, reads /proc/PID/task/*/stat and /proc/stat, waits --window seconds, reads them
again, and prints each thread name's share of one core (summed over threads of that name, with their
count), the busiest single threads, the machine's busy cores, and the cores used by processes whose
command line contains --also (the load clients, say). Linux only; no tool beyond /proc.
"""
import argparse
import os
import time

TICK = os.sysconf("SC_CLK_TCK")


def threads(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue  # the thread ended
        out[int(tid)] = (name, int(fields[11]) + int(fields[12]))  # utime + stime, ticks
    return out


def process_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # live and exited threads


def machine():
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v), v[3] + v[4]  # all, idle + iowait


def processes(pattern):
    total = 0
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if pattern.encode() not in f.read():
                    continue
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except OSError:
            continue
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--delay", type=float, default=2)
    ap.add_argument("--window", type=float, default=4)
    ap.add_argument("--also", help="also report processes whose command line contains this")
    a = ap.parse_args()
    time.sleep(a.delay)
    t0, m0, th0, all0 = time.time(), machine(), threads(a.pid), process_ticks(a.pid)
    p0 = processes(a.also) if a.also else 0
    time.sleep(a.window)
    t1, m1, th1, all1 = time.time(), machine(), threads(a.pid), process_ticks(a.pid)
    p1 = processes(a.also) if a.also else 0
    dt = t1 - t0
    use = {tid: ((th1[tid][1] - th0.get(tid, (None, 0))[1]) / TICK / dt, th1[tid][0]) for tid in th1}
    by_name = {}
    for tid, (cores, name) in use.items():
        n = "main (network)" if tid == a.pid else name
        c, k = by_name.get(n, (0.0, 0))
        by_name[n] = (c + cores, k + 1)
    # Threads that started and ended inside the window (parallel loops) show only in the total.
    gone = (all1 - all0) / TICK / dt - sum(c for c, _ in use.values())
    if gone > 0.005:
        by_name["(threads that ended)"] = (gone, 0)
    print(f"thread-sample | {dt:.1f} s window | server: {(all1 - all0) / TICK / dt:.2f} cores; by thread name: cores (threads)")
    for n, (c, k) in sorted(by_name.items(), key=lambda x: -x[1][0]):
        print(f"thread-sample |   {n:<16} {c:6.2f} ({k})")
    top = sorted(use.items(), key=lambda x: -x[1][0])[:6]
    print("thread-sample | busiest threads: " + ", ".join(f"{name}/{tid} {c:.2f}" for tid, (c, name) in top))
    all_, idle = m1[0] - m0[0], m1[1] - m0[1]
    ncpu = os.cpu_count()
    print(f"thread-sample | machine: {ncpu * (all_ - idle) / all_:.1f} of {ncpu} cores busy" +
          (f"; processes matching '{a.also}': {(p1 - p0) / TICK / dt:.2f} cores" if a.also else ""))


if __name__ == "__main__":
    main()
