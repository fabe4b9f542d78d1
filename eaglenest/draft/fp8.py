"""FP8 (e4m3) training of the draft's large matrix products on GPUs that have FP8 tensor cores.

``train.fp8`` (auto | true | false) resolves here (``resolve_fp8``) and ``convert_to_fp8`` swaps
the chosen ``nn.Linear`` modules for torchao's ``Float8Linear``: each product casts its input and
weight to e4m3 (the gradient of the output to e5m2 in backward) with one dynamic scale per tensor,
and runs on the FP8 tensor cores; the weights stay the bf16 ``nn.Parameter``s they were (the same
objects, so the optimizer's fp32 masters and bf16 moments, ``state_dict()`` and the checkpoint are
unchanged). Per-tensor ("tensorwise") scaling rather than per-row: torchao's rowwise kernel was
slower than bf16 at the draft's shapes on an H200, the tensorwise one faster (issue 41 has the
probe); per-tensor scales are recomputed from each tensor's amax at every call, which keeps
training stable for the draft's sizes (``benchmarks/fp8_accuracy.py`` compares it with bf16).

Which products: fc (3·Ht -> H), q/k/v/o and the MLP's gate/up/down. Not lm_head: the loss multiplies
by ``lm_head.weight`` itself (``losses.py``), never through the module, so swapping it would change
nothing. Only Linears whose both dimensions are multiples of 16 (what FP8 matrix products need).

torchao is imported only here and only when FP8 is on: it is not in the CPU lock, and on a GPU
without it ``auto`` trains in bf16 (one log line) while ``true`` stops with what to install.
"""

import importlib.util

import torch
from torch import nn

from ..util import say

MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0) and newer
FP8_MODULES = ("fc", "midlayer.self_attn.q_proj", "midlayer.self_attn.k_proj", "midlayer.self_attn.v_proj",
               "midlayer.self_attn.o_proj", "midlayer.mlp.gate_proj", "midlayer.mlp.up_proj", "midlayer.mlp.down_proj")
TORCHAO = "torchao==0.18.0"  # the version checked against the GPU machine's torch (2.11)

_said_fallback = False


def torchao_available():
    return importlib.util.find_spec("torchao") is not None


def device_capability(device):
    """(major, minor) CUDA capability of ``device``, or None where it is not a CUDA device here."""
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(torch.device(device))


def resolve_fp8(setting, device, capability=None, has_torchao=None):
    """``train.fp8`` made concrete (a bool) for ``device``: auto is on where the GPU has FP8 tensor
    cores (``capability``, default: the device's own) and torchao is installed. ``true`` where
    either is missing raises, naming the key and what to do."""
    if setting not in ("auto", True, False):
        raise ValueError(f"train.fp8 must be auto, true or false, got {setting!r}")
    if setting is False:
        return False
    if capability is None:
        capability = device_capability(device)
    capable = capability is not None and tuple(capability) >= MIN_CAPABILITY
    if not capable:
        if setting is True:
            where = f"{device}, capability {capability[0]}.{capability[1]}" if capability else str(device)
            raise ValueError(f"train.fp8: true needs a CUDA GPU of capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
                             f"or newer (Ada, Hopper), here {where}; set train.fp8 to auto or false")
        return False
    if has_torchao is None:
        has_torchao = torchao_available()
    if not has_torchao:
        if setting is True:
            raise ValueError(f"train.fp8: true needs torchao, which is not installed: `pip install {TORCHAO}` "
                             "(see pyproject.toml's gpu extra), or set train.fp8 to auto or false")
        global _said_fallback
        if not _said_fallback:
            say(f"train_draft: the GPU has FP8 but torchao is not installed: training in bf16 (pip install {TORCHAO} "
                "for FP8 products; train.fp8: false silences this)")
            _said_fallback = True
        return False
    return True


def fp8_module(module, name):
    """Whether ``convert_to_fp8`` swaps ``module`` (named ``name`` in the draft)."""
    return (isinstance(module, nn.Linear) and name in FP8_MODULES
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def convert_to_fp8(model, emulate=False):
    """Swap the draft's large Linears for torchao's Float8Linear (tensorwise scaling), in place;
    call it after ``model.to(device)`` and before the step is compiled. ``emulate``: torchao's FP8
    emulation, for CPU tests. -> the names swapped."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    swapped = []

    def take(module, name):
        if fp8_module(module, name):
            swapped.append(name)
            return True
        return False

    convert_to_float8_training(model, module_filter_fn=take, config=Float8LinearConfig(emulate=emulate))
    return swapped
