"""Long-lived buffers outside the C heap (zerodp.memory.hostmem)."""
import gc

import torch

from zerodp.memory import hostmem

MIB = 2**20


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def test_cpu_buffer_is_zero_and_returns_its_pages_when_the_last_view_dies():
    n = 64 * MIB // 4
    buf = hostmem.empty(n, torch.float32, "cpu")
    assert buf.shape == (n,) and buf.dtype == torch.float32 and not buf.any()
    before = rss_bytes()
    buf.fill_(1.0)
    touched = rss_bytes()
    assert touched - before >= 60 * MIB
    view = buf[10:20]
    del buf
    gc.collect()
    assert rss_bytes() >= touched - 4 * MIB  # a view keeps the mapping
    assert float(view.sum()) == 10.0
    del view
    gc.collect()
    # Its own mapping: unmapped at once, whatever the C heap holds around it.
    assert rss_bytes() <= touched - 60 * MIB


def test_zeros_and_copy_of():
    z = hostmem.zeros(1000, torch.bfloat16, "cpu")
    assert z.dtype == torch.bfloat16 and not z.any()
    src = torch.randn(3, 5)
    c = hostmem.copy_of(src)
    assert c.shape == (15,) and torch.equal(c, src.reshape(-1))
    assert c.data_ptr() != src.data_ptr()
    h = hostmem.copy_of(src, torch.bfloat16)
    assert h.dtype == torch.bfloat16 and torch.equal(h, src.reshape(-1).to(torch.bfloat16))
    assert hostmem.empty(0, torch.float32, "cpu").numel() == 0


def test_other_devices_use_torch_allocator():
    t = hostmem.zeros(8, torch.float32, "meta")
    assert t.device.type == "meta" and t.shape == (8,)


def test_release_free_heap_keeps_live_tensors():
    keep = [torch.randn(256, 1024) for _ in range(8)]
    garbage = [torch.randn(256, 1024) for _ in range(8)]
    expect = [t.clone() for t in keep]
    del garbage
    hostmem.release_free_heap()
    assert all(torch.equal(a, b) for a, b in zip(keep, expect))


def test_a_per_step_release_skips_a_heap_with_little_free_memory(monkeypatch):
    """Released pages are faulted in again by the next step: a per-step release trims only
    a heap holding at least `min_free` free bytes; a release without it always trims."""
    calls, free = [], {"bytes": 0}

    def fake_info():
        return hostmem._MallInfo2(fordblks=free["bytes"])
    monkeypatch.setattr(hostmem, "_libc", lambda: (calls.append, fake_info))
    free["bytes"] = hostmem.STEP_RELEASE_MIN_FREE - 1
    hostmem.release_free_heap(min_free=hostmem.STEP_RELEASE_MIN_FREE)
    assert calls == []
    hostmem.release_free_heap()
    assert calls == [0]
    free["bytes"] = hostmem.STEP_RELEASE_MIN_FREE
    hostmem.release_free_heap(min_free=hostmem.STEP_RELEASE_MIN_FREE)
    assert calls == [0, 0]
    # The real C library: glibc reports its free heap bytes.
    monkeypatch.undo()
    assert hostmem.free_heap_bytes() is None or hostmem.free_heap_bytes() >= 0
