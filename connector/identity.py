"""Identity step: digests that let prefill check decode computed over the same tokens and weights.

Pure. The operator's revision covers the CR's shared spec, not each role's extra args or env, so a
`--tokenizer`, `--revision`, `--quantization` or chat template on one role alone gives right-looking KV
for the wrong prompt or weights. Decode sends both digests in its Registration; prefill refuses a
mismatch by name (`token_mismatch`, `model_mismatch`) instead of writing KV decode would misuse.
"" (no digest) matches only "": a caller that knows no token ids (tools, tests) pairs with one alike.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import numpy as np

DIGEST_BYTES = 16


def tokens_digest(token_ids: Sequence[int] | None, num_tokens: int) -> str:
    """Digest of the first `num_tokens` token ids ("" without ids); ValueError if there are fewer."""
    if token_ids is None:
        return ""
    if len(token_ids) < num_tokens:
        raise ValueError(f"{len(token_ids)} token ids for {num_tokens} tokens")
    ids = np.asarray(token_ids[:num_tokens], dtype=np.int64)  # fixed width: the same on both sides
    return hashlib.blake2b(ids.tobytes(), digest_size=DIGEST_BYTES).hexdigest()


def model_digest(identity: Mapping[str, object]) -> str:
    """Digest of what decides the weights and tokenizer (model, revision, dtype, quantization, ...)."""
    text = repr(sorted((str(k), repr(v)) for k, v in identity.items()))
    return hashlib.blake2b(text.encode(), digest_size=DIGEST_BYTES).hexdigest()
