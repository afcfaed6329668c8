"""Bad input gives a clear Python exception, never garbage or a crash."""
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import ulbtorch
from ulbtorch import ops, runtime
from ulbtorch.formats import n_groups
from ulbtorch.nn import Linear1Bit, Linear2Bit, Linear4Bit, LinearTernary

M, K = 8, 64


@pytest.fixture
def blob():
    codes = torch.randint(0, 4, (M, K), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    return ops.pack(codes, torch.rand(M, 1) + 0.1, "int2_sym")


@pytest.fixture
def x():
    return torch.randn(3, K)


# ---- torch.ops.ulb.linear ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype,name", [(torch.float64, "float64"), (torch.float16, "float16"),
                                        (torch.int64, "int64"), (torch.int32, "int32"),
                                        (torch.uint8, "uint8")])
def test_linear_wrong_input_dtype(blob, x, dtype, name):
    with pytest.raises(RuntimeError, match=f"input must be float32 or bfloat16, got {name}"):
        torch.ops.ulb.linear(x.to(dtype), blob, None, M)
    with pytest.raises(TypeError, match="input must be float32 or bfloat16"):
        ops.linear(x.to(dtype), blob, None, M)


def test_linear_wrong_bias(blob, x):
    with pytest.raises(RuntimeError, match=r"bias must have shape \[8\]"):
        torch.ops.ulb.linear(x, blob, torch.zeros(M - 1), M)
    with pytest.raises(RuntimeError, match="bias must be float32 or bfloat16, got float64"):
        torch.ops.ulb.linear(x, blob, torch.zeros(M, dtype=torch.float64), M)


def test_linear_wrong_in_features(blob):
    with pytest.raises(RuntimeError, match="input has 60 features but the packed weight expects 64"):
        torch.ops.ulb.linear(torch.randn(3, 60), blob, None, M)
    with pytest.raises(RuntimeError, match="at least 1 dim"):
        torch.ops.ulb.linear(torch.tensor(1.0), blob, None, M)


def test_linear_wrong_out_features(blob, x):
    with pytest.raises(RuntimeError, match="out_features=9 but the packed weight has 8 rows"):
        torch.ops.ulb.linear(x, blob, None, 9)


def test_packed_not_a_blob(blob, x):
    g = torch.Generator().manual_seed(1)
    random_bytes = torch.randint(0, 256, (blob.numel(),), generator=g, dtype=torch.uint8)
    for bad in (random_bytes, blob[:-4].clone(), blob[:-4], torch.cat([blob, blob[:1]]),
                torch.empty(0, dtype=torch.uint8), blob[:63].clone()):
        with pytest.raises(RuntimeError, match="not a valid ulbtorch packed weight"):
            torch.ops.ulb.linear(x, bad, None, M)
        with pytest.raises(RuntimeError, match="not a valid ulbtorch packed weight"):
            ops.unpack(bad)
    for bad in (blob.float(), blob.view(1, -1), blob.to(torch.int8)):
        with pytest.raises(RuntimeError, match="packed weight must be a 1-D contiguous uint8 tensor"):
            torch.ops.ulb.linear(x, bad, None, M)
    with pytest.raises(RuntimeError, match="1-D contiguous uint8 tensor .* 1 dims, not contiguous"):
        torch.ops.ulb.linear(x, torch.stack([blob, blob], 1)[:, 0], None, M)
    with pytest.raises(TypeError, match="packed weight must be the 1-D uint8 tensor"):
        ops.packed_info(blob.float())
    with pytest.raises(TypeError, match="packed weight must be the 1-D uint8 tensor"):
        ops.unpack(blob.view(1, -1))


@pytest.mark.parametrize("offset,value,what", [(0, 0x00, "magic"), (4, 0x03, "version"),
                                               (6, 0x09, "format id"), (6, 0x04, "format of another size"),
                                               (8, 0x20, "M"), (16, 0x50, "K"), (24, 0x20, "group size"),
                                               (32, 0x02, "n_groups"), (40, 0x20, "M_pad"),
                                               (48, 0x50, "K_pad"), (56, 0x00, "panels bytes")])
def test_corrupt_header(blob, x, offset, value, what):
    bad = blob.clone()
    assert bad[offset] != value
    bad[offset] = value
    with pytest.raises(RuntimeError, match="not a valid ulbtorch packed weight"):
        torch.ops.ulb.linear(x, bad, None, M)
    with pytest.raises(RuntimeError, match="not a valid ulbtorch packed weight"):
        ops.packed_info(bad)


def test_blob_of_older_layout_version(blob, x):
    """A version-1 blob (scales after all codes) is named as such, not
    misread and not called corrupt."""
    old = blob.clone()
    old[4] = 1
    for call in (lambda: torch.ops.ulb.linear(x, old, None, M), lambda: ops.packed_info(old),
                 lambda: ops.unpack(old)):
        with pytest.raises(RuntimeError, match="older ulbtorch .blob layout version 1.; pack it again"):
            call()


def test_int_dots_and_quantize_act_shapes(blob):
    with pytest.raises(RuntimeError, match=r"input must be \[N, 64\]"):
        torch.ops.ulb.quantize_act(torch.randn(3, 60), blob)
    with pytest.raises(RuntimeError, match=r"xq must be int8 \[N, 64\]"):
        torch.ops.ulb.int_dots(blob, torch.zeros(3, 60, dtype=torch.int8), torch.zeros(3, 1, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"xq must be int8"):
        torch.ops.ulb.int_dots(blob, torch.zeros(3, 64), torch.zeros(3, 1, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"xsum must be int32 \[N, 1\]"):
        torch.ops.ulb.int_dots(blob, torch.zeros(3, 64, dtype=torch.int8), torch.zeros(2, 1, dtype=torch.int32))


@pytest.mark.parametrize("group_size", [0, 32])
def test_int_dots_takes_only_quantize_act_output(group_size):
    """The AMX GEMM reads xq's padding and ignores xsum, the other kernels the
    reverse: anything but quantize_act's output would make the dots depend on
    the ISA, so it is refused (from 16 tokens AMX differed from scalar)."""
    codes = torch.randint(0, 4, (16, 100), dtype=torch.uint8)
    blob = ops.pack(codes, torch.ones(16, n_groups(group_size, 100)), "int2", group_size)
    xq, _, xsum = torch.ops.ulb.quantize_act(torch.randn(16, 100), blob)
    torch.ops.ulb.int_dots(blob, xq, xsum)
    padded, off = xq.clone(), xsum.clone()
    padded[:, -1] = 1
    off[5, -1] += 1
    for args in ((blob, padded, xsum), (blob, xq, off)):
        with pytest.raises(RuntimeError, match="xq must be zero past in_features and xsum the sums of xq"):
            torch.ops.ulb.int_dots(*args)


@pytest.mark.parametrize("fmt", [2 ** 32 + 2, -(2 ** 32) + 4, 7])
def test_pack_format_id_checked_before_narrowing(fmt):
    """An int64 format id was cast to int first: 2**32 + 2 packed as format 2."""
    with pytest.raises(RuntimeError, match=f"unknown format id {fmt}"):
        torch.ops.ulb.pack(torch.zeros(16, 32, dtype=torch.uint8), torch.ones(16, 1), fmt, 0)


def test_meta_input_to_op_raises(blob, x):
    """A meta input with a real CPU blob cannot be computed: an error, not a
    silently shaped meta result and not a crash."""
    with pytest.raises((RuntimeError, ValueError), match="(?i)device|meta"):
        torch.ops.ulb.linear(x.to("meta"), blob, None, M)
    with pytest.raises(ValueError, match="runs on CPU; input is on meta"):
        ops.linear(x.to("meta"), blob, None, M)
    # A meta bias beside CPU tensors: an error too, not uninitialised memory.
    with pytest.raises(ValueError, match="bias is on meta"):
        torch.ops.ulb.linear(x, blob, torch.zeros(M, device="meta"), M)
    w = torch.randn(M, x.shape[-1]).to(torch.bfloat16)
    with pytest.raises(ValueError, match="bias is on meta"):
        torch.ops.ulb.linear_bf16(x.to(torch.bfloat16), w, torch.zeros(M, device="meta"))
    with pytest.raises(ValueError, match="weight is on meta"):
        torch.ops.ulb.linear_bf16(x.to(torch.bfloat16), w.to("meta"), None)


# ---- packing ----------------------------------------------------------------------------------

def test_bad_group_size():
    codes = torch.zeros(M, K, dtype=torch.uint8)
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 16"):
        ops.pack(codes, torch.ones(M, 3), "int2", 24)
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 32 for format 'binary'"):
        ops.pack(codes, torch.ones(M, 4), "binary", 16)
    with pytest.raises(RuntimeError, match="group size must be a positive multiple of 16"):
        torch.ops.ulb.pack(codes, torch.ones(M, 3), ulbtorch.get_format("int2").id, 24)
    with pytest.raises(ValueError, match="multiple of 16"):
        Linear2Bit(K, M, group_size=24)
    with pytest.raises(ValueError, match="multiple of 32"):
        Linear1Bit(K, M, group_size=48)
    with pytest.raises(ValueError, match="multiple of 16"):
        ulbtorch.QuantConfig(bits=2, group_size=40)
    lin = torch.nn.Linear(K, M)
    with pytest.raises(ValueError, match="multiple of 16"):
        LinearTernary.from_linear(lin, group_size=8)
    with pytest.raises(ValueError, match="granularity='group' needs a group_size"):
        Linear2Bit.from_linear(lin, granularity="group", group_size=0)


def test_unknown_format():
    codes = torch.zeros(M, K, dtype=torch.uint8)
    with pytest.raises(ValueError, match="unknown weight format 'int3'"):
        ops.pack(codes, torch.ones(M, 1), "int3")
    with pytest.raises(RuntimeError, match="unknown format id 9"):
        torch.ops.ulb.pack(codes, torch.ones(M, 1), 9, 0)
    with pytest.raises(ValueError, match="unknown weight format"):
        ops.dequantize(codes, torch.ones(M, 1), "int6")
    with pytest.raises(ValueError, match="unknown format 'int6'"):
        ulbtorch.QuantConfig(format="int6")
    with pytest.raises(ValueError, match="bits must be 1, 'ternary'/1.58, 2, 4 or 8, got 3"):
        ulbtorch.quantize_(torch.nn.Sequential(torch.nn.Linear(K, M)), bits=3)
    with pytest.raises(ValueError, match="Linear2Bit takes formats"):
        Linear2Bit(K, M, format="ternary")
    with pytest.raises(ValueError, match="LinearTernary takes formats"):
        LinearTernary.from_linear(torch.nn.Linear(K, M), format="binary")
    with pytest.raises(ValueError, match="granularity must be one of"):
        Linear2Bit.from_linear(torch.nn.Linear(K, M), granularity="row")
    with pytest.raises(ValueError, match="method must be one of"):
        Linear2Bit.from_linear(torch.nn.Linear(K, M), method="gptq")


@pytest.mark.parametrize("fmt,code", [("int2", 4), ("int2_sym", 255), ("ternary", 3), ("binary", 2)])
def test_codes_out_of_range(fmt, code):
    codes = torch.zeros(M, K, dtype=torch.uint8)
    codes[M - 1, K - 1] = code
    with pytest.raises(ValueError, match="codes exceed"):
        ops.pack(codes, torch.ones(M, 1), fmt)
    with pytest.raises(RuntimeError, match="weight code out of range for the format"):
        torch.ops.ulb.pack(codes, torch.ones(M, 1), ulbtorch.get_format(fmt).id, 0)
    cls = {"int2": Linear2Bit, "int2_sym": Linear2Bit, "ternary": LinearTernary, "binary": Linear1Bit}[fmt]
    with pytest.raises(ValueError, match="codes exceed"):
        cls.from_codes(codes, torch.ones(M, 1), format=fmt)


def test_codes_wrong_dtype_or_shape():
    with pytest.raises(TypeError, match="codes must be uint8, got torch.int64"):
        ops.pack(torch.zeros(M, K, dtype=torch.int64), torch.ones(M, 1), "int2")
    with pytest.raises(ValueError, match="codes must be 2-D"):
        ops.pack(torch.zeros(K, dtype=torch.uint8), torch.ones(1, 1), "int2")
    with pytest.raises(ValueError, match=r"scales must have shape \(8, 1\)"):
        ops.pack(torch.zeros(M, K, dtype=torch.uint8), torch.ones(M - 1, 1), "int2")
    with pytest.raises(ValueError, match="out_features=0: packed weights hold 1 to"):
        ops.pack(torch.zeros(0, K, dtype=torch.uint8), torch.ones(0, 1), "int2")
    with pytest.raises(ValueError, match="in_features=0: packed weights hold 1 to"):
        ops.pack(torch.zeros(M, 0, dtype=torch.uint8), torch.ones(M, 1), "int2")
    with pytest.raises(RuntimeError, match=r"codes of shape \[0, 64\]: packed weights hold 1 to"):
        torch.ops.ulb.pack(torch.zeros(0, K, dtype=torch.uint8), torch.ones(0, 1), ulbtorch.formats.get_format("int2").id, 0)


def test_group_size_checked_everywhere():
    """int4 groups must be multiples of its 8-column tile, at every entry point."""
    codes = torch.zeros(M, K, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"multiple of 16 \(32 for 1-bit, 8 for 4-bit"):
        torch.ops.ulb.pack(codes, torch.ones(M, 6), ulbtorch.get_format("int4").id, 12)
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 8 for format 'int4'"):
        ops.pack(codes, torch.ones(M, 6), "int4", 12)
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 8 for format 'int4'"):
        Linear4Bit(K, M, group_size=12)
    with pytest.raises(ValueError, match="multiple of 8 for 'int4'"):
        ulbtorch.QuantConfig(bits=4, group_size=12)
    with pytest.raises(ValueError, match="group_size must be 0 .* or positive, got -8"):
        ulbtorch.QuantConfig(bits=4, group_size=-8)
    with pytest.raises(ValueError, match="lm_head_group_size must be 0 .* or positive, got -8"):
        ulbtorch.QuantConfig(lm_head_bits=4, lm_head_group_size=-8)
    with pytest.raises(TypeError, match="lm_head_group_size must be an int, got '32'"):
        ulbtorch.QuantConfig(lm_head_bits=4, lm_head_group_size="32")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_scales(bad):
    scales = torch.ones(M, 2)
    scales[3, 1] = bad
    with pytest.raises(RuntimeError, match="scale is NaN or infinite"):
        ops.pack(torch.zeros(M, K, dtype=torch.uint8), scales, "ternary", 32)
    w = torch.randn(M, K)
    w[0, 0] = bad
    lin = torch.nn.Linear(K, M)
    with torch.no_grad():
        lin.weight.copy_(w)
    with pytest.raises(ValueError, match="NaN or infinite"):
        Linear2Bit.from_linear(lin)


# ---- modules ----------------------------------------------------------------------------------

def test_module_wrong_in_features():
    layer = Linear2Bit.from_linear(torch.nn.Linear(K, M))
    with pytest.raises(ValueError, match="Linear2Bit expects 64 input features, got input of shape"):
        layer(torch.randn(2, 60))
    layer.force_reference = True
    with pytest.raises(ValueError, match="expects 64 input features"):
        layer(torch.randn(2, 60))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_module_integer_input_rejected(dtype):
    """nn.Linear refuses integer input; a quantised layer must not silently
    cast it to float and truncate the output back to integers."""
    layer = Linear2Bit.from_linear(torch.nn.Linear(K, M))
    with pytest.raises((TypeError, RuntimeError), match="(?i)dtype|float"):
        layer(torch.ones(2, K, dtype=dtype))


def test_load_state_dict_of_another_format():
    src = LinearTernary.from_linear(torch.nn.Linear(K, M))
    dst = Linear2Bit(K, M, True, format="int2")
    before = dst.packed.clone()
    with pytest.raises(RuntimeError, match="packed weight is .*'format': 'ternary'.* but the layer is .*'int2'"):
        dst.load_state_dict(src.state_dict())
    assert torch.equal(dst.packed, before)
    with pytest.raises(RuntimeError, match="no packed weights"):
        dst.dequantize()


def test_assigning_a_blob_of_another_format_or_group_size():
    """layer.packed = blob is checked like load_state_dict: the kernel follows
    the blob's header, dequantize() and the reference path the layer's."""
    lin = torch.nn.Linear(K, M)
    dst = Linear2Bit(K, M, True)
    for src in (Linear2Bit.from_linear(lin, group_size=32), Linear1Bit.from_linear(lin),
                Linear2Bit.from_linear(torch.nn.Linear(K + 32, M))):
        with pytest.raises(ValueError, match=r"Linear2Bit.packed: packed weight is .* but the layer is"):
            dst.packed = src.packed.clone()
    with pytest.raises(ValueError, match="not a valid ulbtorch packed weight"):
        dst.packed = torch.randint(0, 256, dst.packed.shape, dtype=torch.uint8)
    same = Linear2Bit.from_linear(lin)
    dst.packed = same.packed.clone()  # same geometry: taken
    assert torch.equal(dst.dequantize(), same.dequantize())


def test_quantize_of_a_bare_linear_says_how():
    """The model itself cannot be swapped in place (it used to gain a child
    named "" and stay float)."""
    with pytest.raises(ValueError, match=r"cannot swap the model itself .*nn.Sequential"):
        ulbtorch.quantize_(torch.nn.Linear(K, M), bits=2)
    with pytest.raises(ValueError, match="cannot swap the model itself"):
        ulbtorch.bf16_gemv_(torch.nn.Linear(K, M).to(torch.bfloat16))
    seq = ulbtorch.quantize_(torch.nn.Sequential(torch.nn.Linear(K, M)), bits=2)
    assert type(seq[0]) is Linear2Bit


def test_quant_config_checks_its_options_up_front():
    with pytest.raises(ValueError, match="granularity must be one of"):
        ulbtorch.QuantConfig(bits=2, granularity="row")
    with pytest.raises(ValueError, match="method must be one of"):
        ulbtorch.QuantConfig(bits=2, method="foo")
    with pytest.raises(ValueError, match="group_size=32 needs granularity='group'"):
        ulbtorch.QuantConfig(bits=2, granularity="channel", group_size=32)


@pytest.mark.parametrize("bad", ["no", 1, 0, None])
def test_ulb_config_bf16_gemv_is_a_bool(bad):
    """bool("no") is True: the option took any truthy value as on."""
    pytest.importorskip("transformers")
    with pytest.raises(TypeError, match=f"UlbConfig's bf16_gemv takes True or False, got {bad!r}"):
        ulbtorch.UlbConfig(bf16_gemv=bad)


@pytest.mark.parametrize("kwargs,match", [(dict(bf16_gemv="no"), "bf16_gemv takes True or False"),
                                          (dict(format=["int4"]), "format must be a format name")])
def test_quant_config_option_types(kwargs, match):
    with pytest.raises(TypeError, match=match):
        ulbtorch.QuantConfig(**kwargs)


def test_quant_config_bits_and_format_must_agree():
    with pytest.raises(ValueError, match="bits must be 1, 'ternary'/1.58, 2, 4 or 8, got 3"):
        ulbtorch.QuantConfig(bits=3, format="int4")
    with pytest.raises(ValueError, match="bits=1 and format='ternary' disagree"):
        ulbtorch.QuantConfig(bits=1, format="ternary")
    assert ulbtorch.QuantConfig(bits=4, format="int4").format == "int4"
    assert ulbtorch.QuantConfig(format="int2").format == "int2"
    assert ulbtorch.QuantConfig(bits="ternary", format="ternary").format == "ternary"


@pytest.mark.parametrize("fmt", ["binary", "ternary", "int4", "int8"])
def test_quant_config_explicit_bits_2_must_agree_with_format(fmt):
    """bits=2 said "2-bit" only when format was unset: bits=2 with
    format='binary' quantized to 1 bit silently."""
    with pytest.raises(ValueError, match=f"bits=2 and format='{fmt}' disagree"):
        ulbtorch.QuantConfig(bits=2, format=fmt)


@pytest.mark.parametrize("kwargs,bits,fmt", [(dict(), 2, "int2_sym"), (dict(bits=2, format="int2"), 2, "int2"),
                                             (dict(format="int2"), 2, "int2"), (dict(format="binary"), 1, "binary"),
                                             (dict(format="ternary"), "ternary", "ternary")])
def test_quant_config_bits_follow_format(kwargs, bits, fmt):
    """bits is filled from format, so a saved UlbConfig names both consistently."""
    q = ulbtorch.QuantConfig(**kwargs)
    assert (q.bits, q.format) == (bits, fmt)
    assert ulbtorch.QuantConfig(bits=q.bits, format=q.format) == q


def test_ulb_config_from_dict_and_update_check_their_options():
    """transformers' mixin set from_dict's kwargs and update's as attributes,
    past __init__'s checks (from_dict(d, bf16_gemv="no") kept "no")."""
    pytest.importorskip("transformers")
    d = ulbtorch.UlbConfig(format="binary").to_dict()
    with pytest.raises(TypeError, match="UlbConfig's bf16_gemv takes True or False, got 'no'"):
        ulbtorch.UlbConfig.from_dict(d, bf16_gemv="no")
    config, unused = ulbtorch.UlbConfig.from_dict(d, group_size=64, other=1, return_unused_kwargs=True)
    assert (config.format, config.group_size, config.granularity, unused) == ("binary", 64, "group", {"other": 1})
    with pytest.raises(ValueError, match="group_size must be 0 or a multiple of 32 for 'binary', got 48"):
        config.update(group_size=48)
    assert config.group_size == 64  # a refused update leaves the config as it was
    assert config.update(group_size=0, other=2) == {"other": 2}
    assert (config.group_size, config.granularity) == (0, "channel")
    tensor = ulbtorch.UlbConfig(granularity="tensor")
    with pytest.raises(ValueError, match="group_size=32 needs granularity='group'"):
        tensor.update(group_size=32)


def test_ulb_config_checks_options_as_quantize_does():
    pytest.importorskip("transformers")
    for kwargs, error, match in [(dict(bits=True), ValueError, "bits must be 1, 'ternary'/1.58, 2, 4 or 8"),
                                 (dict(group_size=32.0), TypeError, "group_size must be an int"),
                                 (dict(lm_head_bits=True), ValueError, "lm_head_bits=True"),
                                 (dict(lm_head_group_size="32"), TypeError, "lm_head_group_size must be an int")]:
        with pytest.raises(error, match=match):
            ulbtorch.UlbConfig(**kwargs)
        with pytest.raises(error, match=match):
            ulbtorch.QuantConfig(**kwargs)
    cfg = ulbtorch.UlbConfig(bits=4, group_size=32, bf16_gemv=False, lm_head_bits=8)
    back = ulbtorch.UlbConfig.from_dict(json.loads(cfg.to_json_string()))
    assert back.to_dict() == cfg.to_dict() and back.bf16_gemv is False


def test_grid_exclude_is_a_pattern_list_or_one_name():
    from ulbtorch.importers.grid import convert_grid_linears
    model = torch.nn.Sequential()
    model.add_module("body", torch.nn.Linear(K, M))
    model.add_module("lm_head", torch.nn.Linear(M, M))  # not on a grid: must be left alone
    with torch.no_grad():
        model.body.weight.copy_(torch.sign(torch.randn(M, K)) * 0.1)
    convert_grid_linears(model, 1, exclude="lm_head")  # one string is one name, not its characters
    assert type(model.body) is Linear1Bit and type(model.lm_head) is torch.nn.Linear


def test_load_state_dict_of_garbage():
    dst = Linear2Bit(K, M, True)
    sd = Linear2Bit.from_linear(torch.nn.Linear(K, M)).state_dict()
    sd["packed"] = torch.randint(0, 256, (sd["packed"].numel(),), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="not a valid ulbtorch packed weight"):
        dst.load_state_dict(sd)
    sd["packed"] = torch.zeros(10)
    with pytest.raises(RuntimeError, match="packed weight must be the 1-D uint8 tensor"):
        dst.load_state_dict(sd)


def test_runtime_controls():
    with pytest.raises(ValueError, match="unknown ISA 'sse'"):
        runtime.set_isa("sse")
    with pytest.raises(ValueError, match="unknown ISA"):
        with runtime.use_isa("neon"):
            pass
    with pytest.raises(ValueError, match="invalid slowdown"):
        runtime.set_thread_slowdown(-1, 2.0)
    with pytest.raises(ValueError, match="invalid slowdown"):
        runtime.set_thread_slowdown(64, 2.0)
    with pytest.raises(ValueError, match="invalid slowdown"):
        runtime.set_thread_slowdown(0, 0.5)
    with pytest.raises(ValueError, match="no scheduler table for bits=3"):
        runtime.scheduler_stats(3)


@pytest.mark.parametrize("switch", [runtime.set_eager_fast_path, runtime.set_lut1, runtime.scheduler_static,
                                    lambda on: runtime.use_eager_fast_path(on).__enter__()])
@pytest.mark.parametrize("bad", ["no", 1, None])
def test_runtime_switches_take_bools(switch, bad):
    """set_eager_fast_path("no") turned the fast path on."""
    before = runtime.eager_fast_path(), runtime.lut1_setting()
    with pytest.raises(TypeError, match=f"takes True(,| or) False.* got {bad!r}"):
        switch(bad)
    assert (runtime.eager_fast_path(), runtime.lut1_setting()) == before


@pytest.mark.parametrize("bits", [2 ** 40, 2 ** 32 + 2, -1, 3, 2.0, True, "2", None])
def test_scheduler_stats_checks_bits_before_c(bits):
    """ctypes cut 2**40 to a C int of 0 and gave the read probe's table."""
    with pytest.raises(ValueError, match=r"no scheduler table for bits=.*; widths are \(0, 1, 2, 4, 8, 16\)"):
        runtime.scheduler_stats(bits)


def test_runtime_isa_names_checked():
    """Names were looked up with tuple.index: 'x not in tuple'."""
    for call in (lambda: runtime.scheduler_stats(2, "bogus"), lambda: runtime.lut1_available("bogus"),
                 lambda: runtime.set_isa("bogus")):
        with pytest.raises(ValueError, match=r"unknown ISA 'bogus'; choose from \('scalar', 'avx2'"):
            call()
    assert runtime.scheduler_stats(2, runtime.get_isa())["calls"] >= 0


@pytest.mark.parametrize("bits", [2.0, True, 2 ** 32 + 2, "2"])
def test_prefetch_width_checked_before_c(bits):
    with pytest.raises(ValueError, match="no prefetch setting for bits="):
        runtime.prefetch_distance(bits)
    with pytest.raises(ValueError, match="no prefetch setting for bits="):
        runtime.set_prefetch_distance(bits, 64)


@pytest.mark.parametrize("tid,factor", [(2 ** 32, 2.0), (2 ** 40, 2.0), (True, 2.0), (1.0, 2.0), (0, "2"),
                                        (0, None), (0, True), (0, float("nan")), (0, float("inf")), (0, 1e300)])
def test_thread_slowdown_checked_before_c(tid, factor):
    """ctypes cut tid=2**32 to thread 0, float("2") took a string, and an
    infinite factor would have made the thread spin for ever."""
    with pytest.raises(ValueError, match="invalid slowdown .*tid must be an int from 0 to 63, factor a finite number"):
        runtime.set_thread_slowdown(tid, factor)


@pytest.mark.parametrize("threads", [0, -1, 2 ** 40, 2.0, "2"])
def test_read_probe_thread_count(threads):
    with pytest.raises(ValueError, match="threads must be an int from 1 to 65536"):
        runtime.read_probe(torch.zeros(64), threads)


def test_lut1_switch(monkeypatch):
    at_load = {"0": False, "1": True}.get(os.environ.get("ULB_LUT1"), "auto")
    assert runtime.lut1_setting() == at_load, "the lookup-table kernels are on 'auto' unless ULB_LUT1 says"
    assert runtime.lut1_enabled() == (at_load is not False and runtime.lut1_available())
    if runtime.lut1_available():
        for other in (True, False, "auto"):
            with runtime.use_lut1(other):
                assert runtime.lut1_setting() == other and runtime.lut1_enabled() == (other is not False)
            assert runtime.lut1_setting() == at_load
        show = "import ulbtorch; print(repr(ulbtorch.runtime.lut1_setting()))"
        for env_value, shown in (("0", "False"), ("1", "True"), ("auto", "'auto'"), ("", "'auto'")):
            out = subprocess.run([sys.executable, "-c", show],
                                 capture_output=True, text=True, timeout=120, env=dict(os.environ, ULB_LUT1=env_value))
            assert out.stdout.strip() == shown, (env_value, out.stderr)
            assert ("ULB_LUT1=" in out.stderr) == (env_value == ""), (env_value, out.stderr)  # '' alone warns
    monkeypatch.setattr(runtime, "lut1_available", lambda isa=None: False)
    assert not runtime.lut1_enabled()
    with pytest.raises(RuntimeError, match="no 1-bit lookup-table kernel runs on this CPU"):
        runtime.set_lut1(True)
    runtime.set_lut1(False)  # turning it off is always allowed


def test_load_quantized_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory written by ulbtorch.save_quantized"):
        ulbtorch.load_quantized(torch.nn.Sequential(torch.nn.Linear(K, M)), str(tmp_path))
    with pytest.raises(ValueError, match="no ulbtorch low-bit layers"):
        ulbtorch.save_quantized(torch.nn.Sequential(torch.nn.Linear(K, M)), str(tmp_path))
    model = ulbtorch.quantize_(torch.nn.Sequential(torch.nn.Linear(K, M)), bits=2)
    ulbtorch.save_quantized(model, str(tmp_path))
    with pytest.raises(ValueError, match=r"is 32->8 in the model but 64->8 in the checkpoint"):
        ulbtorch.load_quantized(torch.nn.Sequential(torch.nn.Linear(32, M)), str(tmp_path))


def test_load_quantized_into_a_float32_model_warns_of_the_bf16_gemv(tmp_path):
    """The manifest's bf16_gemv layers need bf16 weights: a float32 model kept
    lm_head on F.linear, with other logits, and said nothing."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    model = ulbtorch.quantize_(transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16), bits=2)
    ulbtorch.save_quantized(model, str(tmp_path))
    with pytest.warns(UserWarning, match=r"load_quantized: lm_head \(float32\) left on F.linear: .*"
                                         r"build the model with dtype=torch.bfloat16"):
        # (from_config(cfg) with no dtype would be bf16 too: the first call set cfg.dtype)
        loaded = ulbtorch.load_quantized(transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32),
                                         str(tmp_path))
    assert type(loaded.lm_head) is torch.nn.Linear  # behaviour unchanged: only the warning is new
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="load_quantized")  # a bf16 model: no warning
        loaded = ulbtorch.load_quantized(transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16),
                                         str(tmp_path))
    assert type(loaded.lm_head) is ulbtorch.LinearBF16


FUZZ = textwrap.dedent("""
    import torch, ulbtorch
    from ulbtorch import ops
    g = torch.Generator().manual_seed(0)
    for fmt, gs in (("int2", 0), ("ternary", 32), ("binary", 64)):
        f = ulbtorch.get_format(fmt)
        codes = torch.randint(0, f.max_code + 1, (40, 200), generator=g, dtype=torch.uint8)
        blob = ops.pack(codes, torch.rand(40, -(-200 // gs) if gs else 1) + 0.1, fmt, gs)
        x = torch.randn(5, 200, generator=g)
        accepted = 0
        for i in range(64):
            for v in (0, 1, 0x7F, 0x80, 0xFF, int(blob[i]) ^ 1, int(blob[i]) ^ 0x10):
                bad = blob.clone()
                bad[i] = v
                try:
                    info = ops.packed_info(bad)
                    y = torch.ops.ulb.linear(torch.randn(5, info["in_features"]), bad, None,
                                             info["out_features"])
                    assert y.shape == (5, info["out_features"])
                    accepted += 1
                except RuntimeError as e:
                    assert "ulb." in str(e), e
        # Any bytes in the panel area are some codes and scales (perhaps NaN):
        # never an error or a crash.
        bad = blob.clone()
        panels_bytes = int(blob[56:64].view(torch.int64))
        bad[64:64 + panels_bytes] = torch.randint(0, 256, (panels_bytes,), generator=g, dtype=torch.uint8)
        torch.ops.ulb.linear(x, bad, None, 40)
        torch.ops.ulb.int_dots(bad, *torch.ops.ulb.quantize_act(x, bad)[::2])
        assert accepted > 0
    print("FUZZ-OK")
""")


def test_header_fuzz_never_crashes():
    """Every single-byte change of a header is rejected or consistent; run in a
    child process so that a crash is reported as a failure, not a dead run."""
    r = subprocess.run([sys.executable, "-c", FUZZ], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "FUZZ-OK" in r.stdout, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])


def test_unknown_isa_in_the_environment_warns():
    env = dict(os.environ, ULB_ISA="avx-2")
    out = subprocess.run([sys.executable, "-c", "import ulbtorch; print(ulbtorch.runtime.get_isa())"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip() in runtime.ISAS, out.stderr
    assert "ULB_ISA='avx-2' is not one of" in out.stderr


@pytest.mark.parametrize("name,warning,setting", [
    ("ULB_EAGER", "ULB_EAGER='off' is not '0' or '1'; taken as '1' (on)", "eager_fast_path()"),
    ("ULB_LUT1", "ULB_LUT1='off' is not '0', '1' or 'auto'; taken as 'auto'", "lut1_setting() == 'auto'")])
def test_switch_in_the_environment_of_another_value_warns(name, warning, setting):
    env = dict(os.environ, **{name: "off"})
    out = subprocess.run([sys.executable, "-c", f"import ulbtorch; print(ulbtorch.runtime.{setting})"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and warning in out.stderr, out.stderr
    assert out.stdout.strip() == str(name == "ULB_LUT1" or runtime.eager_fast_path())


def test_lut1_on_in_the_environment_without_a_kernel_is_auto(monkeypatch):
    """ULB_LUT1=1 where no lookup kernel runs left a setting that set_lut1
    refuses, so restoring it (use_lut1, the tests' fixture) raised."""
    monkeypatch.setenv("ULB_LUT1", "1")
    monkeypatch.setattr(runtime, "lut1_available", lambda isa=None: False)
    runtime.set_lut1(False)
    runtime._lib.ulb_lut1_set(1)  # as the kernels read ULB_LUT1=1 at load
    with pytest.warns(RuntimeWarning, match="ULB_LUT1=1, but no 1-bit lookup-table kernel runs on this CPU"):
        runtime._check_switch_env()
    assert runtime.lut1_setting() == "auto"


@pytest.mark.parametrize("value", ["inf", "1e7", "abc", "", "0x10"])
def test_bad_spin_time_warns_and_workers_still_sleep(value):
    """ULB_SPIN_US=inf once made the ulb pool's workers spin for ever (a
    core's worth of CPU while idle); other bad values silently meant 0."""
    code = textwrap.dedent("""
        import time, torch, ulbtorch
        from ulbtorch import ops, runtime
        runtime.set_thread_pool("ulb")
        torch.set_num_threads(2)
        blob = ops.pack(torch.zeros(1024, 1024, dtype=torch.uint8), torch.ones(1024, 1), "int2_sym")
        torch.ops.ulb.linear(torch.randn(1, 1024), blob, None, 1024)
        assert runtime.scheduler_stats(2)["nthreads"] == 2
        time.sleep(0.05)  # past the default spin
        c0 = time.process_time()
        time.sleep(0.3)
        print("idle cpu", time.process_time() - c0)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, ULB_SPIN_US=value))
    assert out.returncode == 0, out.stderr
    assert f"ULB_SPIN_US={value!r} is not a number of microseconds from 0 to 1e6" in out.stderr
    assert float(out.stdout.split()[-1]) < 0.1, out.stdout  # asleep, not spinning (0.3 s if spinning)


@pytest.mark.parametrize("value", ["0", "50", "1e6", "2.5e1"])
def test_good_spin_time_is_taken_without_a_warning(value):
    code = ("import ctypes, ulbtorch; from ulbtorch import runtime; ok = ctypes.c_int(0); "
            "print(runtime._lib.ulb_spin_us(ctypes.byref(ok)), ok.value)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, ULB_SPIN_US=value))
    assert out.returncode == 0 and "ULB_SPIN_US" not in out.stderr, out.stderr
    assert out.stdout.split() == [repr(float(value)), "1"]


def test_spin_time_set_after_import_is_the_one_in_use():
    """ulb_spin_us once started the pool's setup, which reads ULB_SPIN_US,
    at import: a value set after it was ignored."""
    code = ("import ctypes, os, ulbtorch; from ulbtorch import runtime; os.environ['ULB_SPIN_US'] = '0'; "
            "print(runtime._lib.ulb_spin_us(None))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "ULB_SPIN_US"})
    assert out.returncode == 0 and out.stdout.split() == ["0.0"], out.stderr


def test_meta_input_to_a_module_gives_the_output_shape():
    """Shape inference on meta inputs runs the reference path; its bias
    followed the module's device and the call failed with a device clash."""
    layer = Linear2Bit.from_linear(torch.nn.Linear(K, M))
    y = layer(torch.randn(3, K, device="meta"))
    assert y.is_meta and y.shape == (3, M)


def test_read_probe_on_more_threads_than_torch_runs():
    """On PyTorch's pool the shares of threads > torch.get_num_threads() ran
    one after another, and the probe's split table learned from that."""
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with pytest.raises(ValueError, match=r"threads=2 but PyTorch runs 1; call torch.set_num_threads\(2\)"):
            runtime.read_probe(torch.zeros(1 << 16, dtype=torch.uint8), threads=2)
        runtime.set_thread_pool("ulb")
        assert runtime.thread_pool() == "ulb"
        runtime.read_probe(torch.zeros(1 << 16, dtype=torch.uint8), threads=2)  # its own workers
    finally:
        runtime.set_thread_pool("torch")
        torch.set_num_threads(prev)
    assert runtime.thread_pool() == "torch"


def test_read_probe_of_nothing():
    assert runtime.read_probe(torch.zeros(0)) == 0
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        runtime.read_probe(torch.zeros(8, 2)[:, 0])


@pytest.mark.parametrize("streams", [0, -1, 9, 2.0, True, None])
def test_read_probe_stream_count(streams):
    with pytest.raises(ValueError, match="streams must be an int in \\[1, 8\\]"):
        runtime.read_probe(torch.zeros(64), 1, streams)


def test_read_probe_misaligned():
    with pytest.raises(ValueError, match="8-byte aligned"):
        runtime.read_probe(torch.zeros(80, dtype=torch.uint8)[3:])


@pytest.mark.parametrize("args", [(128.0, 64), (128, 64.0), (True, 64), ("128", 64)])
def test_layer_features_must_be_ints(args):
    with pytest.raises(TypeError, match="features must be an int"):
        ulbtorch.nn.Linear2Bit(*args)


# ---- limits and edges found by a review (2026-11-27) -----------------------------------------------

def test_shape_limits_are_named_and_checked_before_ctypes():
    max_m, max_k = ops.shape_limits()
    assert (max_m, max_k) == (1 << 26, 1 << 16)
    # ctypes would have wrapped these to another geometry's size
    for m, k in [(2**64 + 64, 128), (64, 2**64 + 128), (-(2**64) + 64, 128)]:
        with pytest.raises(ValueError, match="packed weights hold 1 to"):
            ops.packed_nbytes("int2", m, k)
    with pytest.raises(ValueError, match="in_features=65537: packed weights hold 1 to 65536 inputs"):
        ops.packed_nbytes("int2", 16, max_k + 1)
    assert ops.packed_nbytes("int2", 16, max_k) > 0
    with pytest.raises(ValueError, match="in_features=70000"):
        Linear2Bit.from_linear(torch.nn.Linear(70000, 16))
    with pytest.raises(RuntimeError, match=r"codes of shape \[1, 70000\]: packed weights hold"):
        torch.ops.ulb.pack(torch.zeros(1, 70000, dtype=torch.uint8), torch.zeros(1, 1), 1, 0, -1)
    with pytest.raises(ValueError, match=r"quantize_: layer '1': in_features=70000.*exclude"):
        ulbtorch.quantize_(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(70000, 16)), bits=2)


def test_pack_with_scales_on_meta_is_refused():
    """The meta key sent this call to the fake, which returned uninitialised
    CPU bytes."""
    codes = torch.randint(0, 4, (70, 100), dtype=torch.uint8)
    with pytest.raises(ValueError, match="scales is on meta"):
        torch.ops.ulb.pack(codes, torch.rand(70, 1, device="meta"), 1, 0, -1)


def test_fakes_refuse_what_the_ops_refuse():
    blob = ops.pack(torch.randint(0, 4, (8, 64), dtype=torch.uint8), torch.rand(8, 1) + 0.1, "int2_sym")
    fake = torch._subclasses.fake_tensor.FakeTensorMode()
    with fake:
        fb = fake.from_tensor(blob)
        for x, what in [(torch.empty((), dtype=torch.float32), "at least 1 dim"),
                        (torch.empty(64, dtype=torch.float16), "float32 or bfloat16, got torch.float16")]:
            with pytest.raises(RuntimeError, match=what):
                torch.ops.ulb.linear(x, fb, None, 8)
        with pytest.raises(RuntimeError, match="2-D bfloat16"):
            torch.ops.ulb.linear_bf16(torch.empty(64, dtype=torch.bfloat16),
                                      torch.empty(64, dtype=torch.bfloat16), None)
        with pytest.raises(RuntimeError, match="bfloat16"):
            torch.ops.ulb.linear_bf16(torch.empty(64), torch.empty(8, 64, dtype=torch.bfloat16), None)


def test_linear_bf16_ignores_strides_of_size_one_dims():
    """Contiguous by PyTorch's rules, refused before: a [1, K] weight whose
    row stride is 1, and a [M, 1] weight whose column stride is M."""
    for w in (torch.randn(100, 1).bfloat16().t(), torch.randn(1, 70).bfloat16().t()):
        assert w.is_contiguous()
        x = torch.randn(w.shape[1]).bfloat16()
        assert torch.equal(torch.ops.ulb.linear_bf16(x, w, None), torch.ops.ulb.linear_bf16(x, w.clone(), None))
    w = torch.randn(70, 100).bfloat16()[:1].expand(70, 100)  # rows overlap: stride 0
    with pytest.raises(RuntimeError, match=r"rows must be contiguous and not overlap \(strides 0, 1"):
        torch.ops.ulb.linear_bf16(torch.randn(100).bfloat16(), w, None)


def test_linear_bf16_module_with_no_inputs_is_f_linear():
    lin = torch.nn.Linear(0, 4, bias=True).bfloat16()
    torch.nn.init.uniform_(lin.bias)
    layer = ulbtorch.nn.LinearBF16.from_linear(lin)
    with torch.no_grad():
        for shape in [(0,), (3, 0)]:
            x = torch.empty(shape, dtype=torch.bfloat16)
            assert torch.equal(layer(x), lin(x))


def test_read_probe_refuses_a_length_not_a_multiple_of_8():
    b = torch.zeros(16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiple of 8 bytes long, got 9 bytes"):
        runtime.read_probe(b[:9])
    b[8] = 1
    assert runtime.read_probe(b) != runtime.read_probe(torch.zeros(16, dtype=torch.uint8))


def test_binary_absmean_of_huge_finite_weights():
    """mean|W| of finite weights can overflow fp32; the scale stays finite."""
    lin = torch.nn.Linear(64, 70)
    with torch.no_grad():
        lin.weight.fill_(3e38)
        lin.weight[1::2] *= -1
    w = Linear1Bit.from_linear(lin).dequantize()
    assert torch.isfinite(w).all()
    assert torch.allclose(w, lin.weight, rtol=1e-6)


# ---- found by the bad-input review of 2026-11-28 ----------------------------

@pytest.mark.parametrize("call", [
    lambda b, x: ops.linear(x, None, None, M),
    lambda b, x: torch.ops.ulb.linear(None, b, None, M),
    lambda b, x: torch.ops.ulb.pack(None, torch.rand(M, 1), 2, 0),
    lambda b, x: torch.ops.ulb.pack(torch.zeros(M, K, dtype=torch.uint8), None, 2, 0),
    lambda b, x: torch.ops.ulb.quantize_act(x, None),
    lambda b, x: torch.ops.ulb.quantize_act(None, b),
    lambda b, x: torch.ops.ulb.int_dots(b, None, None),
    lambda b, x: ops.linear_bf16(x.bfloat16(), None),
])
def test_none_for_a_tensor_is_named(blob, x, call):
    with pytest.raises(RuntimeError, match=r"must be a tensor, got None"):
        call(blob, x)


@pytest.mark.parametrize("op", ["linear", "linear_many", "linear_bf16"])
def test_public_ops_refuse_inputs_that_need_a_gradient(blob, op):
    x = torch.randn(2, K, requires_grad=True)
    calls = {"linear": lambda: ops.linear(x, blob, None, M),
             "linear_many": lambda: ops.linear_many([x], [blob], None, M),
             "linear_bf16": lambda: ops.linear_bf16(x.bfloat16(), torch.randn(M, K, dtype=torch.bfloat16))}
    with pytest.raises(RuntimeError, match="has no backward"):
        calls[op]()
    with torch.no_grad():
        assert calls[op]().shape == (2, M)


def test_vmap_of_a_0dim_sample_is_refused(blob):
    with pytest.raises(RuntimeError, match="at least 1 dim"):
        torch.vmap(lambda t: ops.linear(t, blob, None, M))(torch.randn(K))
    assert torch.vmap(lambda t: ops.linear(t, blob, None, M))(torch.randn(5, K)).shape == (5, M)


def test_reference_path_of_a_layer_made_in_inference_mode():
    with torch.inference_mode():
        layer = Linear2Bit.from_linear(torch.nn.Linear(K, M))
        x = torch.randn(3, K)
        kernel = layer(x)
        layer.force_reference = True
        ref = layer(x)
    torch.testing.assert_close(ref, kernel, rtol=1e-4, atol=1e-4)
    # No gradient through a weight made in inference mode, as nn.Linear's:
    # the kernel's autograd function says so, the reference path's F.linear too.
    for reference in (False, True):
        layer.force_reference = reference
        with pytest.raises(RuntimeError, match="made in inference mode|Inference tensors"):
            layer(torch.randn(3, K, requires_grad=True))


def _saved_mlp(tmp_path):
    def mk():
        return torch.nn.Sequential(torch.nn.Linear(K, K), torch.nn.ReLU(), torch.nn.Linear(K, M))
    ulbtorch.save_quantized(ulbtorch.quantize_(mk(), bits=2, hugepages=False), str(tmp_path))
    return mk


@pytest.mark.parametrize("damage", ["header", "bias"])
def test_load_quantized_with_a_bad_tensor_leaves_the_model_as_it_was(tmp_path, damage):
    from safetensors.torch import load_file, save_file
    mk = _saved_mlp(tmp_path)
    path = str(tmp_path / "model.safetensors")
    sd = load_file(path)
    if damage == "header":
        blob = sd["2.packed"].clone()
        blob[8] ^= 0xFF
        sd["2.packed"] = blob
    else:
        sd["2.bias"] = torch.zeros(M - 1)
    save_file(sd, path)
    model = mk()
    with pytest.raises(ValueError, match="layer '2'"):
        ulbtorch.load_quantized(model, str(tmp_path), hugepages=False)
    assert [type(m) for m in model] == [torch.nn.Linear, torch.nn.ReLU, torch.nn.Linear]


def test_convert_grid_linears_with_a_layer_off_the_grid_leaves_the_model_as_it_was():
    from ulbtorch.importers import convert_grid_linears
    on_grid = torch.nn.Linear(32, 8)
    with torch.no_grad():
        on_grid.weight.copy_(torch.where(torch.rand(8, 32) > 0.5, 0.1, -0.1))
    model = torch.nn.Sequential(on_grid, torch.nn.Linear(32, 8))
    with pytest.raises(ValueError, match="not on a binary grid"):
        convert_grid_linears(model, 1)
    assert [type(m) for m in model] == [torch.nn.Linear, torch.nn.Linear]


def test_quantize_that_selects_nothing_changes_nothing():
    model = torch.nn.Sequential(torch.nn.Linear(K, K), torch.nn.Linear(K, M)).bfloat16()
    with pytest.warns(UserWarning, match="no layer converted"):
        ulbtorch.quantize_(model, include=["nomatch"])
    assert [type(m) for m in model] == [torch.nn.Linear, torch.nn.Linear]


@pytest.mark.parametrize("group_size, error", [(-16, ValueError), ("16", TypeError), (True, TypeError),
                                                (16.0, TypeError)])
def test_pack_and_layers_refuse_a_bad_group_size(group_size, error):
    codes = torch.zeros(M, K, dtype=torch.uint8)
    with pytest.raises(error, match="group_size"):
        ops.pack(codes, torch.ones(M, 1), "int2_sym", group_size)
    with pytest.raises(error, match="group_size"):
        Linear2Bit(K, M, group_size=group_size)


def test_pack_takes_numpy_and_torch_ints_as_group_size():
    np = pytest.importorskip("numpy")
    codes = torch.zeros(M, K, dtype=torch.uint8)
    for gs in (np.int64(16), torch.tensor(16)):
        assert ops.packed_info(ops.pack(codes, torch.ones(M, K // 16), "int2_sym", gs))["group_size"] == 16


@pytest.mark.parametrize("scales, error, match", [
    ([1.0] * M, TypeError, "scales must be a tensor"),
    (torch.ones(M, 1, dtype=torch.complex64), TypeError, "real numbers"),
    (torch.ones(M, 1, dtype=torch.bool), TypeError, "real numbers"),
    (torch.ones(M, 1, device="meta"), ValueError, "meta"),
])
def test_pack_refuses_scales_it_cannot_read(scales, error, match):
    with pytest.raises(error, match=match):
        ops.pack(torch.zeros(M, K, dtype=torch.uint8), scales, "int2_sym")


@pytest.mark.parametrize("out_features, error", [(True, TypeError), (float(M), TypeError), (0, ValueError),
                                                  (2**63, ValueError)])
def test_linear_refuses_a_bad_out_features(blob, x, out_features, error):
    with pytest.raises(error, match="out_features"):
        ops.linear(x, blob, None, out_features)
    with pytest.raises(error, match="out_features"):
        ops.linear_many([x], [blob], None, out_features)


def test_the_base_layer_names_the_real_ones():
    from ulbtorch.nn.linear import LowBitLinear
    with pytest.raises(TypeError, match="Linear2Bit"):
        LowBitLinear(K, M)


def test_bf16_layer_refuses_what_nn_linear_refuses():
    from ulbtorch.nn import LinearBF16
    lin = torch.nn.Linear(K, M).to(torch.bfloat16)
    lin.bias = torch.nn.Parameter(torch.randn(M))  # fp32 bias on a bf16 weight
    layer = LinearBF16.from_linear(lin)
    with torch.no_grad():
        for inp in (torch.randn(1, K, dtype=torch.bfloat16), torch.randn(2, K, dtype=torch.bfloat16),
                    torch.tensor(1.0, dtype=torch.bfloat16)):
            with pytest.raises(RuntimeError) as want:
                lin(inp)
            with pytest.raises(RuntimeError) as got:
                layer(inp)
            assert str(got.value) == str(want.value)


def test_c_refuses_a_slowdown_past_its_cap():
    assert runtime._lib.ulb_sched_set_slowdown(0, 1e300) != 0


@pytest.mark.parametrize("codes_shape, scales_shape", [((K,), (M, 1)), ((M, K), (M,)), ((M, K), (M - 1, 1)),
                                                       ((M, K), (M, 3))])
def test_dequantize_names_mismatched_shapes(codes_shape, scales_shape):
    with pytest.raises(ValueError, match="codes must be|scales must have shape"):
        ops.dequantize(torch.zeros(codes_shape, dtype=torch.uint8), torch.ones(scales_shape), "int2_sym", 16)


def test_autocast_leaves_float64_to_the_ops_check(blob):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="float64"):
            torch.ops.ulb.linear(torch.randn(2, K, dtype=torch.float64), blob, None, M)
        assert torch.ops.ulb.linear(torch.randn(2, K), blob, None, M).dtype == torch.bfloat16


@pytest.mark.parametrize("shape", [(K,), (M, 0), (2, M, K)])
def test_grid_import_names_a_weight_that_is_not_a_matrix(shape):
    from ulbtorch.importers.grid import pack_grid_weight
    with pytest.raises(ValueError, match="2-D"):
        pack_grid_weight(torch.ones(shape), 1)


def test_from_codes_refuses_a_meta_bias():
    with pytest.raises(ValueError, match="meta"):
        Linear2Bit.from_codes(torch.zeros(M, K, dtype=torch.uint8), torch.ones(M, 1), bias=torch.zeros(M, device="meta"))
