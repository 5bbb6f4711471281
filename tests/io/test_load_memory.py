"""What a load adds to a rank's memory: a safetensors read copies a few rows at a time into the shard and leaves
no page of the file mapped (benchmarks/load_weights.py measures the whole path)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from autotp.io import sources
from autotp.io.sources import CopyRange, SafetensorsSource


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(37, 29, generator=g), "b": torch.randn(3, 5, 7, generator=g).to(torch.bfloat16),
             "s": torch.tensor(2.5), "i": torch.arange(11, dtype=torch.int64), "z": torch.empty(0, 4)}
    path = tmp_path_factory.mktemp("st") / "m.safetensors"
    save_file(state, str(path))
    return path, state


@pytest.mark.parametrize("chunk", [1 << 20, 64])  # the tensor in one read, and a few rows at a time
def test_every_range_reads_the_stored_values(checkpoint, monkeypatch, chunk) -> None:
    path, state = checkpoint
    monkeypatch.setattr(sources, "CHUNK_BYTES", chunk)
    src = SafetensorsSource(path)
    w, b = state["w"], state["b"]
    cases = [  # (name, dim, [(start, length)], out shape, out dtype)
        ("w", 0, [(5, 13)], (13, 29), torch.float32),  # rows, straight into the destination
        ("w", 0, [(0, 4), (30, 7)], (11, 29), torch.float32),  # two segments of a fused projection
        ("w", 1, [(3, 10)], (37, 10), torch.float32),  # a row shard's columns
        ("w", 1, [(0, 2), (20, 9)], (37, 11), torch.float64),  # columns, converted
        ("w", 0, [(0, 37)], (37, 29), torch.float16),  # whole, converted
        ("b", 2, [(1, 4)], (3, 5, 4), torch.bfloat16),
        ("b", 0, [(1, 2)], (2, 5, 7), torch.bfloat16),
        ("i", 0, [(2, 6)], (6,), torch.int64),
        ("z", 0, [(0, 0)], (0, 4), torch.float32),
    ]
    for name, dim, ranges, shape, dtype in cases:
        out = torch.full(shape, -7, dtype=dtype)
        pieces, at = [], 0
        for start, length in ranges:
            pieces.append(CopyRange(start, length, out.narrow(dim, at, length)))
            at += length
        src.read(name, dim, pieces)
        want = torch.cat([state[name].narrow(dim, s, n) for s, n in ranges], dim).to(dtype)
        assert torch.equal(out, want), (name, dim, ranges, dtype)
    out = torch.zeros(())
    src.read("s", 0, [CopyRange(0, 0, out)])  # a scalar (its piece has no length)
    assert out.item() == 2.5
    t = torch.empty(29, 37).t()  # a destination that is not one run of bytes
    src.read("w", 0, [CopyRange(0, 37, t)])
    assert torch.equal(t, w)
    assert src.bytes_read > 0 and torch.equal(b, state["b"])


def test_a_read_adds_only_a_chunk_to_the_peak(tmp_path) -> None:
    """64 MiB of rows and 16 MiB of a row shard's columns read into prefaulted destinations: the peak RSS
    rises by a few MiB (one chunk's rows, copied, and their pages while mapped), where a copy of the slice
    or the file's pages kept mapped would add the slice's size."""
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current RSS (Linux >= 4.0)
        pass
    w = torch.randn(4096, 4096)
    save_file({"w": w}, str(tmp_path / "big.safetensors"))
    del w
    src = SafetensorsSource(tmp_path / "big.safetensors")
    rows, cols = torch.ones(4096, 4096), torch.ones(4096, 1024)  # written: their pages are resident
    for out, dim in ((rows, 0), (cols, 1)):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pytest.skip("this kernel cannot reset the peak RSS")
        before = _status("VmRSS")
        src.read("w", dim, [CopyRange(1024 if dim else 0, out.shape[dim], out)])
        assert _status("VmHWM") - before < 6 << 20, (dim, (_status("VmHWM") - before) / 2**20)  # 16 MiB chunks: +18 MiB
    assert rows[0, 0] != 1 and cols[0, 0] != 1


def test_a_mapped_shard_faults_in_only_its_own_pages(tmp_path) -> None:
    """load_weights(mmap=True) confines each view to a mapping of its own pages (madvise MADV_RANDOM splits
    it off): a fault cannot map the rows around it (other ranks' rows, other tensors) into this rank's RSS."""
    import torch.nn as nn

    import autotp

    torch.manual_seed(0)
    src = nn.Linear(1024, 1024)
    # the bias stored in another dtype is copied: the weight is the one view, between the header and the bias
    save_file({"weight": src.weight.detach().contiguous(), "bias": src.bias.detach().double()},
              str(tmp_path / "m.safetensors"))
    with autotp.empty_weights():
        model = nn.Linear(1024, 1024)
    loaded = autotp.load_weights(model, tmp_path / "m.safetensors", mmap=True)
    assert loaded.mapped == 1 and torch.equal(model.weight, src.weight)
    w = model.weight
    page = 4096
    lo, hi = w.data_ptr() // page * page, -(-(w.data_ptr() + w.nbytes) // page) * page
    with open("/proc/self/maps") as f:
        spans = [[int(x, 16) for x in line.split()[0].split("-")] for line in f if "m.safetensors" in line]
    assert [lo, hi] in spans, (hex(lo), hex(hi), [[hex(a), hex(b)] for a, b in spans])


def test_source_lines_read_in_the_block_are_not_kept(tmp_path) -> None:
    """linecache keeps no file the block read (capture's stack traces read every frame's file whole), and
    keeps what it held before, lines registered by their owner (no file holds them) and lazy entries."""
    import linecache

    from autotp.capture.source_lines import source_lines_released

    before, during = tmp_path / "before.py", tmp_path / "during.py"
    before.write_text("a = 1\n")
    during.write_text("b = 2\n")
    assert linecache.getline(str(before), 1) == "a = 1\n"
    with source_lines_released():
        assert linecache.getline(str(during), 1) == "b = 2\n"
        linecache.cache["<generated>"] = (6, None, ["c = 3\n"], "<generated>")  # as fx registers its code
        linecache.lazycache(str(tmp_path / "lazy.py"), {"__name__": "lazy", "__loader__": None})
    try:
        assert str(during) not in linecache.cache
        assert str(before) in linecache.cache and "<generated>" in linecache.cache
        assert linecache.getline(str(during), 1) == "b = 2\n"  # read again when asked
    finally:
        for name in (str(before), str(during), "<generated>", str(tmp_path / "lazy.py")):
            linecache.cache.pop(name, None)


@pytest.fixture
def fake_tp2():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def test_parallelize_keeps_neither_source_files_nor_a_second_graph(fake_tp2) -> None:
    """After parallelize the process holds no source file its capture read (the model's own file among them),
    and an eager model one graph per signature: the copy a compiler traces (gathered-on-use outputs returned
    local) is made on the first call under torch.compile, and then computes what the graph computes."""
    import linecache

    import autotp
    import nanogpt
    from autotp.parallel.parallelize import _for_compiler

    model_file = nanogpt.__file__
    linecache.cache.pop(model_file, None)
    model = nanogpt.GPT(nanogpt.GPTConfig(n_layer=1))
    idx, targets = nanogpt.example_batch()
    autotp.parallelize(model, example_inputs=(idx, targets))
    assert model_file not in linecache.cache
    st = autotp.tp_state(model)
    (key, c), = st.graphs.items()
    assert not c.local and c.call is None and c.wrap == ()
    want = model(idx, targets)
    local = _for_compiler(st, c)
    assert st.graphs[key] is local and local.local and local.wrap  # the logits are gathered on use
    assert local.call is not c.module
    got = model(idx, targets)  # now through the copy, its logits wrapped after the call
    assert torch.equal(got[0].full_tensor(), want[0].full_tensor()) and torch.equal(got[1], want[1])
