"""The memory sampler against real processes that allocate known amounts."""
import math
import psutil
import subprocess
import sys
import time

from harness.run.sampler import Peaks, Sampler, peaks

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
    top = peaks(samples, "alloc")
    rss, vram = top.rss_mib, top.vram_mib
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


# maps a file and reads every page (file-backed RSS), lets it go, then touches anonymous memory: the two peaks
# fall at different times
MAP_THEN_ALLOC = r"""
import mmap, sys, time
with open(sys.argv[1], "rb") as f:
    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
sum(m[i] for i in range(0, len(m), 4096))
print("mapped", flush=True)
time.sleep(0.6)
m.close()
buf = bytearray(int(sys.argv[2]) << 20)
for i in range(0, len(buf), 4096): buf[i] = 1
print("allocated", flush=True)
time.sleep(0.6)
"""


def test_anonymous_and_file_backed_peaks_are_each_their_own(tmp_path):
    """A mapped file's pages count as file-backed RSS, a touched allocation as anonymous: each peak is its series'
    own (200 MiB file-backed, then 300 MiB anonymous after the mapping is gone), so together they exceed the peak
    RSS, which never held both."""
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\1" * (200 << 20))
    p = subprocess.Popen([sys.executable, "-c", MAP_THEN_ALLOC, str(path), "300"], stdout=subprocess.PIPE, text=True)
    s = Sampler(p.pid, interval_ms=20)
    s.start()
    time.sleep(0.2)
    s.phase = "run"
    assert p.stdout.readline().strip() == "mapped"
    assert p.stdout.readline().strip() == "allocated"
    time.sleep(0.3)
    samples = s.stop()
    p.wait()
    start = [x for x in samples if x["phase"] == "start"]
    top = peaks(samples, "run")
    anon = top.rss_anon_mib - min(x["rss_anon_mib"] for x in start)
    file_ = top.rss_file_mib - min(x["rss_file_mib"] for x in start)
    assert 300 * 0.98 < anon < 300 * 1.06, anon
    assert 200 * 0.98 < file_ < 200 * 1.06, file_
    assert top.rss_mib < top.rss_anon_mib + top.rss_file_mib - 150       # not both at once
    assert peaks(samples, "no such phase") == Peaks()                    # NaN, not zero, where nothing was sampled
