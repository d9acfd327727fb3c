"""The streaming pieces conversion is built from: block-fed quantization, the O_DIRECT output
file (and its buffered fallbacks), the shard writer's partial writes and copies, the
background source hasher."""

import errno
import hashlib
import math
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mpsconvert.format import fp8
from mpsconvert.infra import safetensors_io, safetensors_writer
from mpsconvert.infra.safetensors_io import BufferPool, ShardReader, read_header
from mpsconvert.infra.safetensors_writer import OutputFile, ShardWriter
from mpsconvert.manifests.hashing import BackgroundHasher

pytestmark = pytest.mark.core  # CI's floor lane runs these on the lowest torch and transformers


def _whole_reference(w, gran, scale=None):
    """The quantization spelled out on the whole tensor at once, as compressed-tensors does it."""
    if scale is None:
        amax = w.float().abs().amax(dim=1, keepdim=True) if gran == "row" else w.float().abs().amax().reshape(1)
        scale = (amax / 448).clamp(min=fp8.SCALE_FLOOR)
    codes = (w.float() / scale.reshape(-1, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes, scale


@pytest.mark.parametrize("gran", ["row", "tensor"])
@pytest.mark.parametrize("rows_per_block", [1, 7, 64, 300])
def test_block_fed_quantization_equals_the_whole_tensor_reference(gran, rows_per_block):
    torch.manual_seed(0)
    w = (torch.randn(300, 96) * torch.linspace(0.01, 4, 300)[:, None]).bfloat16()
    w[5] = 0  # an all-zero row
    qz = fp8.StreamQuantizer(300, 96, gran, "w")
    if qz.needs_observe:
        for i in range(0, 300, rows_per_block):
            qz.observe(w[i : i + rows_per_block])
    codes = torch.cat([qz.quantize(w[i : i + rows_per_block]) for i in range(0, 300, rows_per_block)])
    scale, stats = qz.finish()
    ref_codes, ref_scale = _whole_reference(w, gran)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))
    assert torch.equal(scale, ref_scale)
    assert stats.zero_rows == 1 and stats.sqnr_rows == 300  # 300*96 < 2**20: every row measured
    deq = fp8.dequantize(ref_codes, ref_scale, torch.float32)
    want = 10 * math.log10(float((w.float() ** 2).sum() / ((deq - w.float()) ** 2).sum()))
    assert stats.sqnr_db == pytest.approx(want, rel=1e-5)


def test_sqnr_of_a_large_tensor_is_measured_on_evenly_spaced_rows():
    torch.manual_seed(1)
    n, k = 2048, 1024  # 2**21 elements: every other row
    w = torch.randn(n, k) * torch.rand(n, 1)
    qz = fp8.StreamQuantizer(n, k, "row", "w")
    codes = torch.cat([qz.quantize(w[i : i + 333]) for i in range(0, n, 333)])  # blocks not aligned to the stride
    scale, stats = qz.finish()
    assert stats.sqnr_rows == n // 2
    rows = slice(0, None, 2)
    deq = fp8.dequantize(codes[rows], scale[rows], torch.float32)
    want = 10 * math.log10(float((w[rows] ** 2).sum() / ((deq - w[rows]) ** 2).sum()))
    assert stats.sqnr_db == pytest.approx(want, rel=1e-5)


def test_given_scale_clamps_and_stream_order_is_enforced():
    w = torch.tensor([[1000.0, -2000.0, 1.0, 0.5], [0.25, 0.0, -3.0, 2.0]])
    qz = fp8.StreamQuantizer(2, 4, "tensor", "w", scale=torch.tensor([1.0]))
    assert not qz.needs_observe
    codes = torch.cat([qz.quantize(w[:1]), qz.quantize(w[1:])])
    assert fp8.fp8_to_float(codes).tolist() == [[448.0, -448.0, 1.0, 0.5], [0.25, 0.0, -3.0, 2.0]]
    qz = fp8.StreamQuantizer(2, 4, "tensor", "w")
    with pytest.raises(RuntimeError, match="observe"):
        qz.quantize(w)  # a per-tensor scale needs the first pass
    qz = fp8.StreamQuantizer(2, 4, "row", "w")
    qz.quantize(w[:1])
    with pytest.raises(RuntimeError, match="rows never quantized"):
        qz.finish()
    with pytest.raises(RuntimeError, match="does not continue"):
        qz.quantize(w)  # 2 more rows after 1 of 2


def test_nan_in_a_later_block_names_the_tensor():
    w = torch.randn(64, 16)
    w[50, 3] = float("nan")
    qz = fp8.StreamQuantizer(64, 16, "row", "model.layers.3.mlp.down_proj.weight")
    qz.quantize(w[:32])
    with pytest.raises(Exception, match="model.layers.3.mlp.down_proj.weight"):
        qz.quantize(w[32:])


def _chunks(data: bytes, sizes):
    pos = 0
    for n in sizes:
        yield data[pos : pos + n]
        pos += n
    yield data[pos:]


@pytest.mark.parametrize("forced", [None, "open", "pwrite"])
def test_output_file_writes_exact_bytes_on_every_path(tmp_path, monkeypatch, forced):
    data = os.urandom(3 * OutputFile.STAGE + 12345)
    sizes = [1, 4095, 4097, OutputFile.STAGE, 17, OutputFile.STAGE * 2 - 30000]
    direct = getattr(os, "O_DIRECT", 0)
    if forced == "open":  # a filesystem that refuses O_DIRECT at open (tmpfs on older kernels)
        real_open = os.open

        def no_direct(path, flags, *a):
            if flags & direct:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_open(path, flags, *a)

        monkeypatch.setattr(safetensors_writer.os, "open", no_direct)
    if forced == "pwrite":  # accepts the flag, refuses the direct writes (some FUSE filesystems)
        real_pwrite = os.pwrite
        import fcntl

        def refuse(fd, buf, off):
            if fcntl.fcntl(fd, fcntl.F_GETFL) & direct:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real_pwrite(fd, buf, off)

        monkeypatch.setattr(safetensors_writer.os, "pwrite", refuse)
    f = OutputFile(tmp_path / "x.bin")
    for part in _chunks(data, sizes):
        f.write(part)
    f.finish()
    f.sync()
    f.close()
    assert (tmp_path / "x.bin").read_bytes() == data
    if not direct:
        assert f.mode == "buffered (no O_DIRECT on this OS)"
    elif forced == "open":
        assert f.mode == "buffered (O_DIRECT refused by the filesystem)"
    elif forced == "pwrite":
        assert f.mode == "buffered (O_DIRECT writes refused by the filesystem)"
    else:
        assert f.mode in ("direct", "buffered (O_DIRECT refused by the filesystem)")


@pytest.mark.parametrize("beside", [True, False])
def test_shard_writer_takes_blocks_and_copies_and_finishes_in_the_background(tmp_path, monkeypatch, beside):
    # the sha256 on a thread of its own, or in the writer's
    monkeypatch.setattr(safetensors_writer, "HASH_BESIDE_COPY", beside)
    torch.manual_seed(0)
    src = {"emb": torch.randn(1000, 33).bfloat16(), "norm": torch.ones(33), "w": torch.randn(64, 40)}
    save_file(src, tmp_path / "src.safetensors")
    header = read_header(tmp_path / "src.safetensors")
    entries = [
        ("w", "F8_E4M3", (64, 40)),
        ("w_scale", "F32", (64, 1)),
        ("emb", "BF16", (1000, 33)),
        ("norm", "F32", (33,)),
    ]
    pool = BufferPool(count=2, nbytes=4096)
    with ShardReader(header, pool) as reader, ShardWriter(tmp_path / "out.safetensors", entries) as writer:
        info = header.tensors["w"]
        qz = fp8.StreamQuantizer(64, 40, "row", "w")
        for buf, release in reader.blocks(info.start, info.nbytes, align=40 * 4):
            assert buf.numel() % (40 * 4) == 0 and buf.numel() <= 4096
            writer.write("w", qz.quantize(buf.view(torch.float32).view(-1, 40)))
            release()
        scale, _ = qz.finish()
        writer.write("w_scale", scale)
        for name in ("emb", "norm"):
            writer.copy(name, header.path, header.tensors[name].start, header.tensors[name].nbytes)
        with pytest.raises(RuntimeError, match="out of order"):
            writer.write("w", b"")
    assert (writer._hasher is not None) == beside
    digest = writer.digest
    writer.sync()
    raw = (tmp_path / "out.safetensors").read_bytes()
    assert digest == hashlib.sha256(raw).hexdigest() and len(raw) == writer.size
    with safe_open(tmp_path / "out.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor("emb"), src["emb"]) and torch.equal(f.get_tensor("norm"), src["norm"])
        ref_codes, ref_scale = _whole_reference(src["w"], "row")
        assert torch.equal(f.get_tensor("w").view(torch.uint8), ref_codes.view(torch.uint8))
        assert torch.equal(f.get_tensor("w_scale"), ref_scale)


def test_shard_writer_refuses_more_bytes_than_declared_and_a_missing_tensor(tmp_path):
    w = ShardWriter(tmp_path / "a.safetensors", [("a", "U8", (4,)), ("b", "U8", (2,))])
    w.write("a", b"\x00\x01")
    with pytest.raises(RuntimeError, match="got 5 bytes, declared 4"):
        w.write("a", b"\x00\x01\x02")
    w.write("a", b"\x02\x03")
    with pytest.raises(RuntimeError, match="1 tensors never written"):
        w.close()
    w.abort()


@pytest.mark.parametrize("threads", [1, 3])
def test_background_hasher_hashes_every_file_and_reports_errors_where_asked(tmp_path, threads):
    files = []
    for i, n in enumerate([0, 1, (32 << 20) + 5, 7 << 20]):
        p = tmp_path / f"f{i}"
        p.write_bytes(os.urandom(n))
        files.append(p)
    missing = tmp_path / "missing"
    h = BackgroundHasher(files + [missing], threads=threads)
    assert len(h._threads) == threads
    for p in files:
        assert h.sha256(p) == hashlib.sha256(p.read_bytes()).hexdigest()
    with pytest.raises(FileNotFoundError):
        h.sha256(missing)


def test_cancelled_hasher_stops(tmp_path):
    big = tmp_path / "big"
    big.write_bytes(os.urandom(96 << 20))
    h = BackgroundHasher([big, big.with_name("other"), big.with_name("third")], threads=2)
    h.cancel()
    for t in h._threads:
        t.join(timeout=30)
        assert not t.is_alive()


@pytest.mark.parametrize("preadv", [True, False])
def test_reader_blocks_cover_a_tensor_exactly_with_or_without_preadv(tmp_path, monkeypatch, preadv):
    if not preadv and hasattr(os, "preadv"):
        monkeypatch.delattr(safetensors_io.os, "preadv")  # as on a platform without it
    t = torch.arange(37 * 11, dtype=torch.float32).reshape(37, 11)
    save_file({"a": torch.ones(3), "t": t}, tmp_path / "x.safetensors")
    h = read_header(tmp_path / "x.safetensors")
    info = h.tensors["t"]
    with ShardReader(h, BufferPool(count=1, nbytes=5 * 44)) as r:
        got = []
        for buf, release in r.blocks(info.start, info.nbytes, align=44):
            assert buf.numel() % 44 == 0
            got.append(buf.clone())
            release()
        assert torch.equal(torch.cat(got).view(torch.float32).view(37, 11), t)
        assert torch.equal(safetensors_io.as_tensor(r.read(info), info), t)
