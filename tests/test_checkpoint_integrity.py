"""A checkpoint on disk loads as the model that was saved or not at all:
saves are atomic (a save killed at any point, or stopped by a full disk,
leaves the previous checkpoint; file modes follow the umask; nothing is left
behind), and a load checks every stored tensor's dtype and shape and every
blob's header against the manifest before it changes the model."""
import json
import os
import resource
import select
import signal
import struct
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

import ulbtorch
from ulbtorch import ops
from ulbtorch._atomic import PREFIX
from ulbtorch.nn import LowBitLinear

from _layers import isa_preferring


def _mlp():
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))


def _quantized(seed, bits=2):
    torch.manual_seed(seed)
    return ulbtorch.quantize_(_mlp(), bits=bits, hugepages=False)


def _loads_as(directory, models):
    """The index in models of the model `directory` loads as, exactly."""
    loaded = ulbtorch.load_quantized(_mlp(), str(directory), hugepages=False).state_dict()
    for i, m in enumerate(models):
        want = m.state_dict()
        if loaded.keys() == want.keys() and all(torch.equal(loaded[k], want[k]) for k in want):
            return i
    raise AssertionError(f"{directory} loads as none of the saved models")


def _entries(directory):
    return sorted(os.listdir(directory))


# ---- atomic saves -----------------------------------------------------------------------------------

def test_a_save_killed_anywhere_leaves_the_old_or_the_new_checkpoint(tmp_path):
    """A child saves two models in turn without end; it is killed (SIGKILL)
    at a dozen points spread over one save. Each time the directory loads as
    the last checkpoint saved or the one being saved, exactly; a later save
    removes what the killed ones left."""
    models = [_quantized(0), _quantized(1)]
    t0 = time.perf_counter()
    ulbtorch.save_quantized(models[0], str(tmp_path))
    save_s = time.perf_counter() - t0
    points, left_staging = 12, 0
    for point in range(points):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: saves 1, 0, 1, ... and writes a byte after each
            try:
                os.close(r)
                for i in range(100_000):
                    ulbtorch.save_quantized(models[(i + 1) % 2], str(tmp_path))
                    os.write(w, b".")
            finally:
                os._exit(0)
        os.close(w)
        assert select.select([r], [], [], 60)[0], "the saving child did not finish its first save"
        os.read(r, 1)
        time.sleep(save_s * point / points)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        with os.fdopen(r, "rb") as pipe:
            done = 1 + len(pipe.read())
        # the last save completed wrote models[done % 2]; the one under way the other
        assert _loads_as(tmp_path, models) in (done % 2, (done + 1) % 2)
        entries = _entries(tmp_path)
        left_staging += any(e.startswith(PREFIX) for e in entries)
        assert set(entries) - {"model.safetensors", "ulbtorch.json"} <= {e for e in entries if e.startswith(PREFIX)}
    assert left_staging >= 2, "no kill landed inside a save: the kill points do not cover the write"
    ulbtorch.save_quantized(models[1], str(tmp_path))
    assert _entries(tmp_path) == ["model.safetensors", "ulbtorch.json"]
    assert _loads_as(tmp_path, models) == 1


def test_a_full_disk_mid_write_leaves_the_old_checkpoint_and_no_temp_file(tmp_path):
    """A file size limit (RLIMIT_FSIZE, SIGXFSZ ignored) makes the weights
    write fail halfway as a full disk does: the save raises an OSError that
    names the directory, and the directory holds the old checkpoint only."""
    models = [_quantized(0), _quantized(1)]
    ulbtorch.save_quantized(models[0], str(tmp_path))
    limit = os.path.getsize(tmp_path / "model.safetensors") // 2
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
            try:
                ulbtorch.save_quantized(models[1], str(tmp_path))
                os.write(w, b"saved")
            except OSError as e:
                os.write(w, str(e).encode()[:4000])
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r, "rb") as pipe:
        message = pipe.read().decode()
    assert f"writing the checkpoint into {tmp_path} failed" in message and "as they were" in message, message
    assert _entries(tmp_path) == ["model.safetensors", "ulbtorch.json"]
    assert _loads_as(tmp_path, models) == 0


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_saved_files_have_the_umasks_mode(tmp_path, umask):
    old = os.umask(umask)
    try:
        ulbtorch.save_quantized(_quantized(0), str(tmp_path / "out"))
    finally:
        os.umask(old)
    for name in ("model.safetensors", "ulbtorch.json"):
        assert os.stat(tmp_path / "out" / name).st_mode & 0o777 == 0o666 & ~umask, name


def test_a_manifest_file_an_earlier_save_left_is_not_read(tmp_path):
    """A save stopped between its two renames leaves the new weights beside
    the old ulbtorch.json: the manifest the weights carry is read."""
    models = [_quantized(0, bits=2), _quantized(1, bits=4)]
    ulbtorch.save_quantized(models[0], str(tmp_path))
    stale = (tmp_path / "ulbtorch.json").read_text()
    ulbtorch.save_quantized(models[1], str(tmp_path))
    (tmp_path / "ulbtorch.json").write_text(stale)
    assert _loads_as(tmp_path, models) == 1
    (tmp_path / "ulbtorch.json").write_text(stale[:40])  # nor is a damaged one
    assert _loads_as(tmp_path, models) == 1


def test_a_version_1_checkpoint_still_loads(tmp_path):
    """What ulbtorch wrote before the manifest moved into the weights'
    metadata: ulbtorch.json (version 1, no tile orders) beside weights
    whose metadata holds no manifest."""
    model = _quantized(0)
    ulbtorch.save_quantized(model, str(tmp_path))
    manifest = json.loads((tmp_path / "ulbtorch.json").read_text())
    for spec in manifest["layers"].values():
        del spec["tiles"]
    (tmp_path / "ulbtorch.json").write_text(json.dumps(dict(version=1, layers=manifest["layers"], bf16_gemv=[])))
    save_file(load_file(tmp_path / "model.safetensors"), tmp_path / "model.safetensors",
              metadata={"format": "pt", "ulbtorch": "1"})
    assert _loads_as(tmp_path, [model]) == 0


# ---- every stored tensor checked ------------------------------------------------------------------

def _rewrite(path, edit):
    """Rewrite the safetensors file `path` with edit(tensors) applied, keeping its metadata."""
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata=metadata)


def _relabel(path, key, dtype):
    """Change the dtype `key` has in the file's JSON header, not its bytes."""
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header[key]["dtype"] = dtype
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))
    assert len(text) == n
    with open(path, "wb") as f:
        f.write(raw[:8] + text + raw[8 + n:])


def _refused_and_unchanged(directory, match):
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        ulbtorch.load_quantized(model, str(directory), hugepages=False)
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("damage,match", [
    ("bias_int64", r"2.bias is stored as I64 of shape \[8\], but the model's 2.bias is float32"),
    ("bias_relabelled_i32", r"0.bias is stored as I32 of shape \[64\], but the model's 0.bias is float32"),
    ("packed_as_int8", r"2.packed: packed weight must be the 1-D uint8 tensor .*, got torch.int8"),
    ("extra_tensor", r"1 unexpected \['3.weight'\]"),
    ("missing_bias", r"has no 0.bias"),
])
def test_a_stored_tensor_of_another_dtype_or_name_is_refused_before_any_change(tmp_path, damage, match):
    """A bias stored as int64, or F32 bytes labelled I32, used to load and be cast."""
    ulbtorch.save_quantized(_quantized(0), str(tmp_path))
    path = str(tmp_path / "model.safetensors")
    if damage == "bias_int64":
        _rewrite(path, lambda t: t.update({"2.bias": torch.arange(8)}))
    elif damage == "bias_relabelled_i32":
        _relabel(path, "0.bias", "I32")
    elif damage == "packed_as_int8":
        _relabel(path, "2.packed", "I8")
    elif damage == "extra_tensor":
        _rewrite(path, lambda t: t.update({"3.weight": torch.zeros(2)}))
    else:
        _rewrite(path, lambda t: t.pop("0.bias"))
    _refused_and_unchanged(tmp_path, match)


def test_a_float_tensor_of_another_float_dtype_loads_cast(tmp_path):
    """The model's dtype is the caller's: a bf16 bias loads into a float32 layer."""
    model = _quantized(0)
    ulbtorch.save_quantized(model, str(tmp_path))
    _rewrite(str(tmp_path / "model.safetensors"), lambda t: t.update({"0.bias": t["0.bias"].bfloat16()}))
    loaded = ulbtorch.load_quantized(_mlp(), str(tmp_path), hugepages=False)
    assert torch.equal(loaded[0].bias, model[0].bias.bfloat16().float())


@pytest.mark.parametrize("resealed", [False, True])
def test_a_flipped_tile_order_byte_is_refused(tmp_path, resealed):
    """Flipping one bit of byte 7 (the tile order) of a 1-bit blob gives
    another valid header, which loaded and computed with permuted weights:
    the checksum refuses it, and the manifest's tile order refuses it even
    with a checksum made for the flipped bytes."""
    isa = isa_preferring("vnni") or isa_preferring("lanes")
    with ulbtorch.runtime.use_isa(isa):
        model = _quantized(0, bits=1)
    ulbtorch.save_quantized(model, str(tmp_path))
    tiles = ops.packed_info(model[2].packed)["tiles"]
    other = "lanes" if tiles == "vnni" else "vnni"

    def flip(t):
        blob = t["2.packed"].clone()
        blob[7] ^= 1
        assert ops.packed_info(blob)["tiles"] == other  # still a valid header
        t["2.packed"] = _reseal(blob) if resealed else blob
    _rewrite(str(tmp_path / "model.safetensors"), flip)
    _refused_and_unchanged(tmp_path, rf"layer '2': .*2.packed is in the {other} tile order, but the manifest says "
                                     rf"{tiles}" if resealed else r"layer '2': .*2.packed: .*packed weight damaged")
    if not resealed:  # the layer, which takes either order on the CPU, goes by the checksum
        with pytest.raises(RuntimeError, match="packed weight damaged"):
            model[2].load_state_dict({"packed": load_file(tmp_path / "model.safetensors")["2.packed"],
                                      "bias": model[2].bias})
        assert ops.packed_info(model[2].packed)["tiles"] == tiles


def test_save_of_a_layer_never_packed_names_it(tmp_path):
    model = _mlp()
    model[0] = ulbtorch.nn.Linear2Bit(64, 64)
    assert isinstance(model[0], LowBitLinear)
    with pytest.raises(ValueError, match=r"save_quantized: layer '0' holds no valid packed weight"):
        ulbtorch.save_quantized(model, str(tmp_path))
    assert _entries(tmp_path) == []


# ---- blob checksums and code ranges ---------------------------------------------------------------

CHECKSUM = slice(20, 24)  # the header's checksum field (ulb_header.checksum)


def _reseal(blob):
    """blob with the checksum its header should hold for its bytes: XXH64 of
    the blob with the field zeroed, low 32 bits (kernels/src/checksum.c)."""
    from ulbtorch._lib import lib
    b = blob.clone()
    b[CHECKSUM] = 0
    b[CHECKSUM] = torch.tensor(list(struct.pack("<I", lib.ulb_xxh64(b.data_ptr(), b.numel(), 0) & 0xFFFFFFFF)),
                               dtype=torch.uint8)
    return b


def _as_version_2(blob):
    b = blob.clone()
    b[4:6] = torch.tensor([2, 0], dtype=torch.uint8)
    b[CHECKSUM] = 0  # K's high half in version 2
    return b


def test_xxh64_matches_its_published_vectors_and_defines_the_checksum():
    import ctypes

    from ulbtorch._lib import lib
    for text, want in [(b"", 0xEF46DB3751D8E999), (b"abc", 0x44BC2CF5AD770999),
                       (b"Nobody inspects the spammish repetition", 0xFBCEA83C8A378BF1)]:
        assert lib.ulb_xxh64(ctypes.create_string_buffer(text, len(text) + 1), len(text), 0) == want, text
    blob = ops.pack(torch.randint(0, 4, (17, 100), dtype=torch.uint8), torch.rand(17, 1) + 0.5, "int2_sym")
    assert torch.equal(_reseal(blob), blob)
    assert ops.packed_info(blob, verify=True)["checked"] is True


@pytest.mark.parametrize("fmt,tiles", [("binary", "vnni"), ("binary", "lanes"), ("int2_sym", "vnni"),
                                       ("int8", "kmajor"), ("ternary", "vnni")])
def test_every_single_bit_flip_of_a_blob_is_refused_by_verify(fmt, tiles):
    """Flips of the header gave another valid header 154 times in 42 blobs
    (the tile order of 1-bit blobs among them); the checksum refuses them
    and every flip of the body too."""
    f = ulbtorch.formats.FORMATS[fmt]
    g = torch.Generator().manual_seed(3)
    blob = ops.pack(torch.randint(0, f.max_code + 1, (20, 64), generator=g, dtype=torch.uint8),
                    torch.rand(20, 2, generator=g) + 0.5, fmt, 32, tiles=tiles)
    valid_headers = 0
    for bit in range(blob.numel() * 8):
        bad = blob.clone()
        bad[bit // 8] ^= 1 << (bit % 8)
        try:
            ops.packed_info(bad)
        except RuntimeError:
            continue
        valid_headers += bit < 64 * 8
        with pytest.raises(ValueError, match="packed weight damaged: its bytes do not match the checksum"):
            ops.packed_info(bad, verify=True)
    assert valid_headers > 0  # some flips of the header alone still read as a header


@pytest.mark.parametrize("fmt,tiles,bad_byte", [("int8", "vnni", 0xFF), ("int8", "kmajor", 0xFF),
                                                ("ternary", "vnni", 0x03), ("ternary", "kmajor", 0x30)])
def test_an_out_of_range_code_is_refused_by_unpack_verify_and_load(tmp_path, fmt, tiles, bad_byte):
    """Code 255 in an int8 blob (no such level) was accepted by unpack and the
    loaders, and the AMX prefill path read it as another level than every
    other path; a checksum over it does not make it valid."""
    with pytest.raises(ValueError, match="codes exceed"):
        ops.pack(torch.full((4, 16), ulbtorch.formats.FORMATS[fmt].max_code + 1, dtype=torch.uint8),
                 torch.ones(4, 1), fmt, tiles=tiles)
    blob = ops.pack(torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16, 1), fmt, tiles=tiles)
    info = ops.packed_info(blob)
    codes_at = 64 + (info["n_groups"] * info["M_pad"] * 4 if tiles == "kmajor" else 16 * 4)
    for at in (codes_at, codes_at + 3, codes_at + 7, codes_at + 61, blob.numel() - 65):  # each byte of a word
        bad = blob.clone()
        bad[at] = bad_byte
        bad = _reseal(bad)
        with pytest.raises(ValueError, match="weight code out of range for the format"):
            ops.packed_info(bad, verify=True)
        with pytest.raises(RuntimeError, match="weight code out of range for the format"):
            ops.unpack(bad)


def test_a_non_finite_scale_is_refused_by_unpack_and_verify():
    blob = ops.pack(torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16, 1), "int2_sym")
    bad = blob.clone()
    bad[64:68] = torch.tensor(list(struct.pack("<f", float("nan"))), dtype=torch.uint8)
    bad = _reseal(bad)
    with pytest.raises(ValueError, match="scale is NaN or infinite"):
        ops.packed_info(bad, verify=True)
    with pytest.raises(RuntimeError, match="scale is NaN or infinite"):
        ops.unpack(bad)


def test_retile_refuses_a_damaged_blob_and_seals_what_it_makes():
    blob = ops.pack(torch.randint(0, 2, (20, 64), dtype=torch.uint8), torch.rand(20, 1) + 0.5, "binary", tiles="vnni")
    bad = blob.clone()
    bad[100] ^= 4
    with pytest.raises(RuntimeError, match="checksum"):
        ops.retile(bad, "lanes")
    for tiles in ("lanes", "kmajor", "vnni"):
        out = ops.retile(blob, tiles)
        assert ops.packed_info(out, verify=True) == dict(ops.packed_info(blob), tiles=tiles, checked=True)
        assert all(torch.equal(a, b) for a, b in zip(ops.unpack(out), ops.unpack(blob)))


def test_a_version_2_blob_reads_unchecked_and_loads_with_a_warning(tmp_path):
    """Blobs written before checksums still load: packed_info(verify=True)
    says they are unchecked, load_quantized names them and gives them a
    checksum, so the next save writes them checked."""
    model = _quantized(0)
    old = _as_version_2(model[2].packed)
    assert ops.packed_info(old, verify=True)["checked"] is False
    assert all(torch.equal(a, b) for a, b in zip(ops.unpack(old), ops.unpack(model[2].packed)))
    bad = old.clone()
    bad[CHECKSUM.start] = 1  # in version 2 the high half of K
    with pytest.raises(RuntimeError, match="not a valid ulbtorch packed weight"):
        ops.packed_info(bad)
    ulbtorch.save_quantized(model, str(tmp_path))
    _rewrite(str(tmp_path / "model.safetensors"), lambda t: t.update({"2.packed": old}))
    with pytest.warns(UserWarning, match=r"load_quantized: 1 packed weights in .*model.safetensors \(e.g. 2\) are of "
                                         "blob version 2, which has no checksum"):
        loaded = ulbtorch.load_quantized(_mlp(), str(tmp_path), hugepages=False)
    assert ops.packed_info(loaded[2].packed, verify=True)["checked"] is True
    assert torch.equal(loaded[2].packed, model[2].packed)  # the blob pack makes today
    x = torch.randn(3, 64)
    assert torch.equal(loaded(x), model(x))


def test_a_damaged_blob_in_a_checkpoint_is_refused_before_any_change(tmp_path):
    """A byte of a blob's body changed on disk (the header still valid) loaded
    and computed with other weights."""
    ulbtorch.save_quantized(_quantized(0), str(tmp_path))

    def damage(t):
        blob = t["0.packed"].clone()
        blob[500] ^= 0x10
        t["0.packed"] = blob
    _rewrite(str(tmp_path / "model.safetensors"), damage)
    _refused_and_unchanged(tmp_path, r"layer '0': .*model.safetensors's 0.packed: ulbtorch.ops.packed_info: packed "
                                     "weight damaged: its bytes do not match the checksum")
