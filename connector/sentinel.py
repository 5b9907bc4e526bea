"""Sentinel: a cheap production check that decode's blocks hold what prefill sent, with no reference.

For a sampled request (`sampled`: one in `sentinel_every`, chosen by key so both sides agree) the
producer digests the KV of a few of the request's tokens, every layer and plane of the heads it shares
with the consumer rank, as it posts the WRITE, and sends the digest in the Done notice that rides on
it. When the notice arrives (the WRITE has landed), the consumer digests the same tokens through its
own layout and block list; a different digest fails the receive (`sample_mismatch`, counted, and
kv_load_failure_policy recomputes) instead of decoding on wrong KV. It catches what the value-by-value
tests catch in CI: a layout or mapping disagreement, a WRITE into other blocks, bytes changed on the way.

Pure: addresses come from the layouts (mapping.py arithmetic); memory is read by the caller's `read`.
Host memory only: a VRAM cache is not sampled (its digest would need a device copy on this thread).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np
from kvferry.connector.layout import KVLayout, LayoutError, split_heads
from kvferry.connector.mapping import HOLE, block_table

SAMPLE_TOKENS = 2  # the range's last token and one more, per sampled request
# read(addresses, elem_bytes) -> the bytes of those elements, in order
Read = Callable[[np.ndarray, int], bytes]


def _hash(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "big")


def sampled(request_id: str, attempt: int, every: int) -> bool:
    """Whether (request_id, attempt) is checked: one key in `every` (0: none), the same on both sides."""
    return every > 0 and _hash(request_id, attempt) % every == 0


def sample_tokens(
    layout: KVLayout, request_id: str, attempt: int, first_token: int, num_tokens: int
) -> list[int]:
    """Tokens every layer still holds after a transfer of [first_token, num_tokens): the last one and
    one chosen by key (sorted, distinct)."""
    lo = max(layout.kept_from(r.group, first_token, num_tokens) for r in layout.regions)
    if lo >= num_tokens:
        return []
    picks = {num_tokens - 1, lo + _hash(request_id, attempt, "t") % (num_tokens - lo)}
    return sorted(picks)[:SAMPLE_TOKENS]


def shared_heads(layout: KVLayout, peer_rank: int, peer_tp: int) -> range:
    """Global KV heads this rank shares with the peer rank (what a WRITE between them moves)."""
    theirs = split_heads(layout.total_heads, peer_rank, peer_tp)
    mine = layout.heads()
    return range(max(mine.start, theirs.start), min(mine.stop, theirs.stop))


def addresses(
    layout: KVLayout,
    block_ids: Sequence[Sequence[int]],
    listed_from: int,
    tokens: Sequence[int],
    heads: range,
) -> np.ndarray:
    """Byte address of each element (layer, plane, head, token, dim) of `tokens` and global `heads`;
    `block_ids[g][0]` holds token `listed_from`. Raises LayoutError for a token in a hole."""
    end = max(tokens) + 1
    tab = block_table(layout, block_ids, end, "this side", first_token=listed_from, listed_from=listed_from)
    tok = np.asarray(tokens, dtype=np.int64)
    local = np.arange(heads.start, heads.stop) - layout.head_offset
    in_block = layout.block_offsets()[:, local][:, :, tok % layout.block_size, :]  # P x H x T x D
    col = tok // layout.block_size - listed_from // layout.block_size
    out = np.empty((len(layout.regions), *in_block.shape), dtype=np.int64)
    for i, r in enumerate(layout.regions):
        ids = tab[r.group][col]
        if (ids == HOLE).any():
            raise LayoutError(f"sampled token {int(tok[ids == HOLE][0])} of group {r.group} is in a hole")
        out[i] = r.base + (ids * layout.block_stride)[None, None, :, None] + in_block
    return out


def digest(
    layout: KVLayout,
    block_ids: Sequence[Sequence[int]],
    listed_from: int,
    tokens: Sequence[int],
    heads: range,
    read: Read,
) -> str:
    """Digest of the sampled elements' bytes, in logical order (equal on any two ranks that hold the
    same KV, whatever their block sizes and packings); "" when there is nothing to sample."""
    if not tokens or not len(heads) or layout.memory != "DRAM":
        return ""
    data = read(addresses(layout, block_ids, listed_from, tokens, heads), layout.elem_bytes)
    return hashlib.blake2b(data, digest_size=8).hexdigest()
