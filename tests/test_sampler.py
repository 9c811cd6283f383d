"""The memory sampler against real processes that allocate known amounts."""
import math
import psutil
import subprocess
import sys
import time

from harness.run.sampler import Sampler, peaks

# a child that starts a grandchild; each touches a known number of MiB, reports, and holds it
CHILD = r"""
import subprocess, sys, time
mib = int(sys.argv[1])
kids = [subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[3]])] if len(sys.argv) > 2 else []
time.sleep(0.5)
buf = bytearray(mib << 20)
for i in range(0, len(buf), 4096): buf[i] = 1
print("ready", flush=True)
time.sleep(1.5)
"""
HOLD = r"""
import sys, time
buf = bytearray(int(sys.argv[1]) << 20)
for i in range(0, len(buf), 4096): buf[i] = 1
time.sleep(2.0)
"""


def test_sampler_sees_a_known_allocation_across_the_process_tree():
    p = subprocess.Popen([sys.executable, "-c", CHILD, "300", HOLD, "200"], stdout=subprocess.PIPE, text=True)
    s = Sampler(p.pid, interval_ms=20)
    s.start()
    time.sleep(0.3)
    s.phase = "alloc"
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    samples = s.stop()
    p.wait()
    base = min(x["rss_mib"] for x in samples if x["phase"] == "start")
    rss, vram = peaks(samples, "alloc")
    grown = rss - base
    # 300 MiB in the child + 200 MiB in the grandchild (+ the grandchild interpreter's own ~10 MiB)
    assert 500 * 0.98 < grown < 500 * 1.06, grown
    last = samples[-1]
    assert abs(last["rss_mib"] - (last["rss_anon_mib"] + last["rss_file_mib"])) < 2   # split adds up
    assert any(not math.isnan(x["pss_mib"]) for x in samples)
    if not s.nvml.ok:
        assert math.isnan(vram)          # no NVIDIA GPU: VRAM is unknown, not zero
    assert all(b["t_ms"] > a["t_ms"] for a, b in zip(samples, samples[1:]))


def test_sampler_survives_the_process_exiting():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.4)"])
    s = Sampler(p.pid, interval_ms=10)
    s.start()
    p.wait()
    time.sleep(0.1)
    assert s.sample() is None                      # gone: no row, no exception
    samples = s.stop()
    assert len(samples) >= 5 and all(x["rss_mib"] > 1 for x in samples)


def test_sampler_skips_a_zombie():
    """An exited child not yet reaped keeps /proc/<pid>/status but has no VmRSS: no 0-MiB row."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    while psutil.Process(p.pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.01)
    try:
        assert Sampler(p.pid).sample() is None
    finally:
        p.wait()
