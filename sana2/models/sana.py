"""SanaMS: the multi-scale Sana text-to-image DiT (the math is in docs/model.md)."""

import math

import torch
from einops import rearrange
from torch import nn

from sana2.models.config import SanaConfig
from sana2.models.layers import (
    CaptionEmbedder,
    CrossAttention,
    FinalLayer,
    GLUMBConv,
    LinearAttention,
    RMSNorm,
    SoftmaxAttention,
    TimestepEmbedder,
    layer_norm,
    modulate,
    sincos_pos_embed,
)
from sana2.models.weight_init import initial_value


class SanaBlock(nn.Module):
    """adaLN-single block: gated self-attention, ungated cross-attention, gated GLUMBConv."""

    def __init__(
        self, hidden_size: int, num_heads: int, attn: nn.Module, mlp: nn.Module, cross_norm: bool, cross_attn_fp32: bool
    ):
        super().__init__()
        self.scale_shift_table = nn.Parameter(torch.zeros(6, hidden_size))
        self.attn = attn
        self.cross_attn = CrossAttention(hidden_size, num_heads, cross_norm, cross_attn_fp32)
        self.mlp = mlp

    def forward(self, x, y, t0, mask, grid, rope=None):
        shift1, scale1, gate1, shift2, scale2, gate2 = (
            self.scale_shift_table[None] + t0.reshape(x.shape[0], 6, -1)
        ).chunk(6, dim=1)
        attn_in = modulate(layer_norm(x), shift1, scale1)
        x = x + gate1 * (self.attn(attn_in) if rope is None else self.attn(attn_in, rope))
        x = x + self.cross_attn(x, y, mask)
        x = x + gate2 * self.mlp(modulate(layer_norm(x), shift2, scale2), grid)
        return x


def _as_tuple(value, length: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, (list, tuple)) else (value,) * length


class SanaMS(nn.Module):
    """The image DiT, built from its config (sana2/models/config.py: every field checked, documented there)."""

    spatial_dims = 2

    def __init__(self, config: SanaConfig):
        super().__init__()
        self.config = config
        c = config
        patch_size, in_channels, hidden_size, num_heads = c.patch_size, c.in_channels, c.hidden_size, c.num_heads
        caption_channels, model_max_length, y_norm = c.caption_channels, c.model_max_length, c.y_norm
        self.patch_size = _as_tuple(patch_size, self.spatial_dims)
        self.in_channels = in_channels
        self.out_channels = in_channels * 2 if c.pred_sigma else in_channels
        self.hidden_size = hidden_size
        self.input_size = c.input_size
        self.use_pe = c.use_pe
        self.pe_interpolation = c.pe_interpolation
        self.timestep_norm_scale_factor = c.timestep_norm_scale_factor
        self.y_norm = y_norm
        self.linear_head_dim = c.linear_head_dim
        self.num_heads = num_heads

        self.x_embedder = PatchEmbed(in_channels, hidden_size, self.patch_size)
        self.register_buffer("pos_embed", torch.zeros(1, self.base_tokens(), hidden_size))
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.t_block = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))
        self.y_embedder = CaptionEmbedder(caption_channels, hidden_size, model_max_length)
        if y_norm:
            self.attention_y_norm = RMSNorm(hidden_size, eps=1e-5, init_scale=c.y_norm_scale_factor)
        cross_attn_fp32 = c.cross_attn_type == "vanilla"
        self.blocks = nn.ModuleList(
            SanaBlock(
                hidden_size,
                num_heads,
                self.make_attention(c.attn_type, c.qk_norm),
                self.make_mlp(c.mlp_ratio),
                c.cross_norm,
                cross_attn_fp32,
            )
            for _ in range(c.depth)
        )
        patch_pixels = 1
        for p in self.patch_size:
            patch_pixels *= p
        self.final_layer = FinalLayer(hidden_size, patch_pixels, self.out_channels)

    # -- construction hooks the video model overrides -------------------------------------------
    def base_tokens(self) -> int:
        # (the video model too sizes its unused buffer by the first two patch dims, as the reference)
        return (self.input_size // self.patch_size[0]) * (self.input_size // self.patch_size[1])

    def make_attention(self, attn_type: str, qk_norm: bool) -> nn.Module:
        if attn_type == "linear":
            return LinearAttention(self.hidden_size, self.linear_head_dim, qk_norm)
        return SoftmaxAttention(self.hidden_size, self.num_heads, qk_norm)

    def make_mlp(self, mlp_ratio: float) -> nn.Module:
        return GLUMBConv(self.hidden_size, mlp_ratio)

    # -- forward -----------------------------------------------------------------------------
    def embed_timestep(self, timestep: torch.Tensor) -> torch.Tensor:
        t = timestep.float()
        if self.timestep_norm_scale_factor == 1:
            t = t.long().float()  # released configs truncate the timestep toward zero
        else:
            t = t / self.timestep_norm_scale_factor
        return self.t_embedder(t)

    def embed_caption(self, y, mask, drop_ids):
        """Returns caption tokens [B, L, D] and the mask [B, L] (tiled for guidance batches)."""
        if mask is None:
            mask = torch.ones(y.shape[0], y.shape[-2], device=y.device)
        mask = mask.reshape(mask.shape[0], -1)
        if y.shape[0] != mask.shape[0]:
            mask = mask.repeat(y.shape[0] // mask.shape[0], 1)
        y = self.y_embedder(y, drop_ids)
        if self.y_norm:
            y = self.attention_y_norm(y)
        return y.squeeze(1), mask

    def patch_grid(self, x: torch.Tensor) -> tuple[int, ...]:
        return tuple(size // p for size, p in zip(x.shape[2:], self.patch_size))

    def positional_embedding(self, grid, device):
        if not self.use_pe:
            return None
        base = self.input_size // self.patch_size[0]
        return sincos_pos_embed(self.hidden_size, grid, base, self.pe_interpolation).to(device)

    def forward(self, x, timestep, y, mask=None, drop_ids=None):
        """x: [B, C, H, W]; timestep: [B]; y: [B, 1, L, C_cap]; mask: [B, 1, 1, L] or [B, L].

        drop_ids ([B] bool) forces which captions classifier-free dropout replaces in training.
        """
        compute_dtype = self.x_embedder.proj.weight.dtype
        grid = self.patch_grid(x)
        tokens = self.x_embedder(x.to(compute_dtype))
        pos = self.positional_embedding(grid, x.device)
        if pos is not None:
            tokens = tokens + pos.to(tokens.dtype)
        t = self.embed_timestep(timestep)
        t0 = self.t_block(t)
        y, mask = self.embed_caption(y.to(compute_dtype), mask, drop_ids)
        rope = self.rotary_angles(grid, x.device)
        for block in self.blocks:
            tokens = block(tokens, y, t0, mask, grid, rope)
        return self.unpatchify(self.final_layer(tokens, t), grid)

    def rotary_angles(self, grid, device):
        return None  # the image model has no rotary embedding

    def initial_pos_embed(self) -> torch.Tensor:
        """The stored (never read) `pos_embed` buffer: the base-grid sincos table, or zeros."""
        if not self.use_pe:
            return torch.zeros_like(self.pos_embed, device="cpu")
        base = self.input_size // self.patch_size[0]
        return sincos_pos_embed(self.hidden_size, (base, base), base, self.pe_interpolation)[None]

    def unpatchify(self, tokens, grid):
        (h, w), (p, q) = grid, self.patch_size
        return rearrange(tokens, "b (h w) (p q c) -> b c (h p) (w q)", h=h, w=w, p=p, q=q)

    # -- what other components need to know ---------------------------------------------------
    @property
    def caption_shape(self) -> tuple[int, int]:
        """(tokens, width) of the caption embeddings the model takes: (model_max_length, caption_channels)."""
        return tuple(self.y_embedder.y_embedding.shape)

    def null_caption(self) -> torch.Tensor:
        """The unconditional caption [L, C_cap] that classifier-free guidance and dropout use.

        A buffer, so it sits on the compute device even when FSDP offloads parameters to the CPU.
        """
        return self.y_embedder.y_embedding

    def num_tokens(self, latent_shape: tuple[int, ...]) -> int:
        """Tokens the blocks see for one latent of `latent_shape` ([C, H, W] or [C, T, H, W])."""
        return math.prod(size // p for size, p in zip(latent_shape[1:], self.patch_size))

    def check_fits(self, latent_shape: tuple[int, ...], caption_shape: tuple[int, int]) -> None:
        """Raise ValueError naming every way the data ([C, *spatial] latents, (tokens, width)
        captions) does not fit this model."""
        problems = []
        if self.in_channels != latent_shape[0]:
            problems.append(
                f"model in_channels={self.in_channels} but the data's latents have {latent_shape[0]} channels"
            )
        spatial = latent_shape[1:]
        if len(spatial) != len(self.patch_size):
            problems.append(
                f"the model takes {len(self.patch_size)}-D latents, the data's are "
                f"{len(spatial)}-D {tuple(latent_shape)}"
            )
        elif any(size % p for size, p in zip(spatial, self.patch_size)):
            problems.append(
                f"the data's latent size {tuple(spatial)} is not divisible by the patch size {self.patch_size}"
            )
        length, width = self.caption_shape
        if width != caption_shape[1]:
            problems.append(f"model caption_channels={width} but the data's caption embeddings have {caption_shape[1]}")
        if length != caption_shape[0]:
            problems.append(f"model model_max_length={length} but the data's captions have {caption_shape[0]} tokens")
        if problems:
            raise ValueError("; ".join(problems))

    def initial_value(self, name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        """The full initial value of parameter or buffer `name` (of full shape `shape`), drawn from
        `generator`, as the reference initialises it."""
        return initial_value(self, name, shape, generator)


class PatchEmbed(nn.Module):
    """Conv with kernel = stride = patch, then flattened to row-major tokens."""

    def __init__(self, in_channels: int, hidden_size: int, patch_size: tuple[int, ...]):
        super().__init__()
        conv = nn.Conv2d if len(patch_size) == 2 else nn.Conv3d
        self.proj = conv(in_channels, hidden_size, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)
