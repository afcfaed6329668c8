"""Float layers, the format grid and the ISA lookup that the module,
quantizer, op and checkpoint tests share."""
import torch

from ulbtorch import ops, runtime
from ulbtorch.formats import get_format
from ulbtorch.nn import MODULE_FOR_FORMAT, Linear2Bit

CLASS_FORMATS = [(cls, fmt) for fmt, cls in MODULE_FOR_FORMAT.items()]  # every row of the format table
CF_IDS = [f for _, f in CLASS_FORMATS]
METHODS = ["absmax", "absmean", "mse"]
K_IN, M_OUT = 100, 37  # K deliberately not a multiple of 16


def _float_linear(gen, K=K_IN, M=M_OUT, bias=True):
    lin = torch.nn.Linear(K, M, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(M, K, generator=gen) / K ** 0.5)
        if bias:
            lin.bias.copy_(torch.randn(M, generator=gen) * 0.1)
    return lin


def fit_group(fmt, gs):
    """gs, or for a format whose tiles it does not divide (base 3's 20
    columns) the next multiple of its tile: the group size the bit-field
    formats' cases stand for in that format."""
    tk = get_format(fmt).tile_k
    return gs if not gs or gs % tk == 0 else -(-gs // tk) * tk


def _layer(gen, cls=Linear2Bit, fmt="int2_sym", gs=32, bias=True, K=K_IN, M=M_OUT):
    lin = _float_linear(gen, K, M, bias)
    return lin, cls.from_linear(lin, format=fmt, group_size=fit_group(fmt, gs))


def isa_preferring(tiles):
    """A supported ISA under which 1-bit codes pack in `tiles` order, or None."""
    for isa in runtime.supported_isas():
        with runtime.use_isa(isa):
            if ops.preferred_tiles("binary") == tiles:
                return isa
    return None
