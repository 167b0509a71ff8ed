"""How a tensor is named in keys' labels and messages: ``f32[8, 512] cuda:0``.

>>> describe_tensor(torch.zeros(8, 512, device="cuda"))
'f32[8, 512] cuda:0'
>>> describe_tensor(x.t())        # a layout a key tells apart is named
'f32[512, 8] cuda:0 strides=(1, 512)'

The watchers name the tensors they find with it and the keys label calls with it, so that a
message and ``stats()`` speak of a tensor the same way.
"""

from __future__ import annotations

from typing import Optional

import torch

Tensor = torch.Tensor

DTYPE_NAMES = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
    torch.complex64: "c64",
    torch.complex128: "c128",
}


def describe_tensor(t: Tensor, shape: Optional[torch.Size] = None) -> str:
    dtype = DTYPE_NAMES.get(t.dtype, str(t.dtype).replace("torch.", ""))
    if t.is_nested:
        return f"{dtype} nested tensor of {t.dim()} dims {t.device}"
    text = f"{dtype}[{', '.join(map(str, t.shape if shape is None else shape))}] {t.device}"
    if t.layout is not torch.strided:
        text += f" {str(t.layout).replace('torch.', '')}"
    elif shape is None and not t.is_contiguous():
        text += f" strides={tuple(t.stride())}"
    if t.requires_grad:
        text += " requires_grad"
    return text
