"""vLLM glue: this rank's KV layout, read from vLLM itself, never assumed.

vLLM hands the connector one tensor per attention layer. Where each K and V element of a block sits
in that tensor is the attention backend's business: vLLM-CPU's kernels pack K per ISA (`vec`
stores K dim-major inside a block, `amx` interleaves pairs of tokens or dims), CUDA backends view
the page as token- or head-major depending on the resolved `KVCacheLayout`. So the layout is
measured: the backend's own KV write (`impl.do_kv_cache_update`, the call the engine makes every
step) stores probe keys and values into a scratch block with the real tensor's strides, dtype and
device, and where every element landed is read back. Element positions are encoded one bit per
pass as 0/1 values, which every KV dtype (fp32, bf16, fp16, fp8) stores exactly.

The result is fitted to `KVLayout` (layout.py); a backend, spec or packing that cannot be measured
or fitted is refused with `UnsupportedCacheError` naming the layer, backend and reason, so a rank
never starts transferring KV it cannot place.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from kvferry.connector.layout import KVLayout, LayoutError, split_heads
from kvferry.connector.mapping import HOLE, element_addresses

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
Write = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor", "torch.Tensor"], None]
# Quantization modes whose cache holds plain per-element values (scales live outside the page).
PLAIN_QUANT_MODES = ("NONE", "FP8_PER_TENSOR")


class UnsupportedCacheError(RuntimeError):
    """A KV cache kvferry cannot describe; the message names the layer, backend and reason."""


def probe_offsets(
    write: Write, like: torch.Tensor, *, num_heads: int, head_dim: int, src_dtype: torch.dtype
) -> np.ndarray:
    """Byte offset, from the block's start, of every element (plane, head, token, dim) of one block
    as `write` stores it into a tensor laid out like `like` ([blocks, heads, tokens, content])."""
    import torch

    _, heads, bs, _ = like.shape
    if heads != num_heads:
        raise UnsupportedCacheError(f"cache has {heads} head slots, the model {num_heads} KV heads here")
    extent = 1 + sum((n - 1) * s for n, s in zip(like.shape[1:], like.stride()[1:], strict=True))
    raw = torch.zeros(extent, dtype=like.dtype, device=like.device)
    scratch = raw.as_strided((1, *like.shape[1:]), like.stride())
    bits_view = raw.view(int_of_size(raw.element_size()))
    count = 2 * heads * bs * head_dim
    code = torch.arange(1, count + 1, dtype=torch.int64, device=like.device).view(2, heads, bs, head_dim)
    slots = torch.arange(bs, dtype=torch.int64, device=like.device)
    found = torch.zeros(extent, dtype=torch.int64, device=like.device)
    for bit in range(count.bit_length()):
        planes = ((code >> bit) & 1).to(src_dtype)  # 2 x heads x tokens x dim
        key = planes[0].transpose(0, 1).contiguous()  # tokens x heads x dim, as the model produces
        value = planes[1].transpose(0, 1).contiguous()
        raw.zero_()
        write(key, value, scratch, slots)
        found |= (bits_view != 0).to(torch.int64) << bit
    found = found.cpu().numpy()
    where = np.flatnonzero(found)
    positions = found[where] - 1
    if positions.size != count or positions.max(initial=-1) >= count:
        raise UnsupportedCacheError(
            f"the backend's KV write stored {positions.size} elements for {count} written "
            "(packed, scaled or padded content kvferry cannot place)"
        )
    if not (np.bincount(positions, minlength=count) == 1).all():
        raise UnsupportedCacheError("the backend's KV write stored some element twice or not at all")
    offsets = np.empty(count, dtype=np.int64)
    offsets[positions] = where * raw.element_size()
    return offsets.reshape(2, heads, bs, head_dim)


def read_elements(layout: KVLayout, block_ids: list[list[int]], num_tokens: int) -> np.ndarray:
    """This process's KV of a request (host memory), element by element through `layout`:
    layers x planes x heads x tokens x dims x element bytes (uint8), the same on any two ranks that
    hold the same KV, whatever their block sizes and packings. Tokens a windowed layer no longer
    keeps read as zeros on every side."""
    if layout.memory != "DRAM":
        raise UnsupportedCacheError(
            "reading KV back needs host memory; VRAM caches are read by the GPU check"
        )
    addr = element_addresses(layout, block_ids, num_tokens)
    held = addr != HOLE
    lo, hi = int(addr[held].min()), int(addr[held].max()) + layout.elem_bytes
    memory = np.frombuffer((ctypes.c_uint8 * (hi - lo)).from_address(lo), dtype=np.uint8)
    out = memory[(np.where(held, addr, lo) - lo)[..., None] + np.arange(layout.elem_bytes)]
    out[~held] = 0
    return out


def read_host(addr: np.ndarray, elem_bytes: int) -> bytes:
    """The bytes of the elements at these host addresses, in order (sentinel.py's reader)."""
    lo, hi = int(addr.min()), int(addr.max()) + elem_bytes
    memory = np.frombuffer((ctypes.c_uint8 * (hi - lo)).from_address(lo), dtype=np.uint8)
    return memory[(addr - lo)[..., None] + np.arange(elem_bytes)].tobytes()


def int_of_size(n: int) -> Any:
    """The torch integer dtype of an element size: compares element bits whatever the float type."""
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[n]


def layout_from_tensors(
    tensors: list[torch.Tensor],
    offsets: np.ndarray,
    *,
    kind: str,
    total_heads: int,
    tp_rank: int,
    tp_size: int,
    groups: list[int],
    windows: list[int] | None = None,
) -> KVLayout:
    """A KVLayout over these layer tensors (same shape and strides), with measured block offsets."""
    first = tensors[0]
    for t in tensors:
        if t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype:
            raise UnsupportedCacheError(
                f"KV tensors differ: {tuple(t.shape)}/{t.stride()}/{t.dtype} vs "
                f"{tuple(first.shape)}/{first.stride()}/{first.dtype}"
            )
    local = split_heads(total_heads, tp_rank, tp_size)
    try:
        return KVLayout.from_offsets(
            offsets,
            block_stride=first.stride(0) * first.element_size(),
            bases=[t.data_ptr() for t in tensors],
            num_blocks=first.shape[0],
            groups=groups,
            windows=tuple(windows or ()),
            kind=kind,
            dtype=str(first.dtype).removeprefix("torch."),
            head_offset=local.start,
            total_heads=total_heads,
            elem_bytes=first.element_size(),
            memory="VRAM" if first.is_cuda else "DRAM",
            device_id=(first.device.index or 0) if first.is_cuda else 0,
        )
    except LayoutError as exc:
        raise UnsupportedCacheError(str(exc)) from None


def spec_window(spec: Any) -> int:
    """The tokens a group keeps in vLLM's KV manager: a SlidingWindowSpec's window; 0 (all) for full
    attention, including a windowed layer vLLM manages as full (hybrid allocator off)."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return int(spec.sliding_window) if type(spec) is SlidingWindowSpec else 0


def check_spec(name: str, spec: Any) -> None:
    """Refuse KV cache specs kvferry cannot move element by element or whose kept blocks it cannot
    prove (MLA, Mamba, chunked-local, sinks, packed quant): only full attention and plain sliding
    windows, whose kept tokens mapping.py derives (KVLayout.kept_from)."""
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    kind = type(spec).__name__
    if isinstance(spec, MLAAttentionSpec):
        raise UnsupportedCacheError(
            f"layer {name}: MLA (latent) KV caches ({kind}) are not supported by kvferry; "
            "serve this model without P/D or with vLLM's NixlConnector"
        )
    if not isinstance(spec, AttentionSpec):
        raise UnsupportedCacheError(
            f"layer {name}: KV cache spec {kind} is not attention K/V (hybrid state caches such as "
            "Mamba are not supported by kvferry)"
        )
    if type(spec) not in (FullAttentionSpec, SlidingWindowSpec):
        raise UnsupportedCacheError(
            f"layer {name}: KV cache spec {kind} keeps or frees blocks in a way kvferry does not prove "
            "(only full attention and plain sliding windows are moved); serve this model without P/D "
            "or with vLLM's NixlConnector"
        )
    if getattr(spec, "extra_retained_tokens", 0):
        raise UnsupportedCacheError(
            f"layer {name}: sliding window with extra_retained_tokens={spec.extra_retained_tokens} "
            "(multi-token speculative prefill) is not supported by kvferry"
        )
    quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    odd = {
        "kv_quant_mode": quant if quant not in PLAIN_QUANT_MODES else None,
        "head_size_v": spec.head_size_v if spec.head_size_v != spec.head_size else None,
        "num_head_slots": getattr(spec, "num_head_slots", None),
        "state_content_bytes": getattr(spec, "state_content_bytes", None),
        "tokens_per_state": getattr(spec, "tokens_per_state", 1)
        if getattr(spec, "tokens_per_state", 1) != 1
        else None,
    }
    odd = {k: v for k, v in odd.items() if v is not None}
    if odd:
        raise UnsupportedCacheError(f"layer {name}: {kind} with {odd} is not supported by kvferry")


def describe_kv_caches(
    kv_caches: dict[str, torch.Tensor],
    vllm_config: Any,
    kv_cache_config: Any,
    *,
    tp_rank: int,
    tp_size: int,
) -> KVLayout:
    """This rank's KVLayout, measured through each layer's own attention backend."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    groups, specs = {}, {}
    windows = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        windows.append(spec_window(layer_spec(g.kv_cache_spec)))
        for n in g.layer_names:
            groups[n], specs[n] = i, g.kv_cache_spec
    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, list(kv_caches))
    model = vllm_config.model_config
    order = getattr(vllm_config.cache_config, "kv_cache_layout", None) or ""
    measured: dict[tuple, tuple[str, np.ndarray]] = {}
    for name, tensor in kv_caches.items():
        check_spec(name, layer_spec(specs.get(name)))
        layer = layers.get(name)
        if layer is None:
            raise UnsupportedCacheError(f"layer {name}: no attention layer of that name in the model")
        key = (
            tuple(tensor.shape[1:]),
            tensor.stride(),
            tensor.dtype,
            type(layer.impl),
            getattr(layer, "isa", None),
        )
        if key not in measured:
            measured[key] = _measure(
                name, layer, tensor, head_dim=model.get_head_size(), src_dtype=model.dtype, order=order
            )
    kinds = {kind for kind, _ in measured.values()}
    first_kind, first_off = next(iter(measured.values()))
    if any(not np.array_equal(off, first_off) for _, off in measured.values()) or len(kinds) > 1:
        raise UnsupportedCacheError(
            f"layers store KV in different layouts ({sorted(kinds)}); kvferry needs one"
        )
    return layout_from_tensors(
        list(kv_caches.values()),
        first_off,
        kind=first_kind,
        total_heads=model.get_total_num_kv_heads(),
        tp_rank=tp_rank,
        tp_size=tp_size,
        groups=[groups.get(n, 0) for n in kv_caches],
        windows=windows,
    )


def layer_spec(spec: Any) -> Any:
    """UniformTypeKVCacheSpecs wraps per-layer specs of one type: look at the first."""
    inner = getattr(spec, "kv_cache_specs", None)
    return next(iter(inner.values())) if isinstance(inner, dict) and inner else spec


def _measure(
    name: str, layer: Any, tensor: torch.Tensor, *, head_dim: int, src_dtype: Any, order: str
) -> tuple[str, np.ndarray]:
    """(kind, offsets) of one layer, through its backend's own KV write."""
    backend = layer.attn_backend if hasattr(layer, "attn_backend") else layer.get_attn_backend()
    bname = backend.get_name()
    if getattr(backend, "forward_includes_kv_cache_update", True):
        raise UnsupportedCacheError(
            f"layer {name}: attention backend {bname} writes the KV cache inside its forward pass, so "
            "kvferry cannot measure its layout; choose a backend with a separate KV update "
            "(CPU_ATTN, FLASH_ATTN, FLASHINFER, TRITON_ATTN)"
        )
    impl = layer.impl

    def write(key: Any, value: Any, cache: Any, slots: Any) -> None:
        impl.do_kv_cache_update(layer, key, value, cache, slots)

    try:
        offsets = probe_offsets(
            write, tensor, num_heads=tensor.shape[1], head_dim=head_dim, src_dtype=src_dtype
        )
    except UnsupportedCacheError as exc:
        raise UnsupportedCacheError(f"layer {name} ({bname}): {exc}") from None
    isa = getattr(layer, "isa", None)
    return bname + (f"/{isa}" if isa else "") + (f" {order}" if order else ""), offsets
