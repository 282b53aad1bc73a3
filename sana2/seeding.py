"""The one seed scheme: every random stream sana2 draws is seeded by `derive_seed(purpose, ...)`.

A stream is named by what it is for and what it belongs to, e.g. ("sample", seed, step, index) for
one training sample's noise or ("init", seed, "blocks.0.attn.qkv.weight") for one tensor's initial
value. Seeding by name instead of drawing from a shared generator is what keeps results independent
of the world size, the batch split, the order of creation and a resume.
"""

import hashlib

import torch


def derive_seed(*parts) -> int:
    """A 63-bit seed from `parts` (ints and strings), e.g. derive_seed("loader", seed, epoch).

    The seed is the SHA-256 of the text "sana2-<part0>/<part1>/...", so neighbouring values of any
    part give unrelated streams (plain arithmetic on seeds can make two streams collide).
    """
    text = "sana2-" + "/".join(str(part) for part in parts)
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def seeded_generator(*parts) -> torch.Generator:
    """A CPU generator seeded with derive_seed(*parts)."""
    return torch.Generator().manual_seed(derive_seed(*parts))
