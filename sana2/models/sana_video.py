"""SanaMSVideo: the text-to-video DiT (docs/model.md, "The video model").

The image model with a Conv3d patch embedding, ReLU linear attention with a 3-D rotary embedding,
and an FFN that adds a temporal convolution to the per-frame GLUMBConv.
"""

import torch
from einops import rearrange
from torch import nn

from sana2.models.config import SanaVideoConfig
from sana2.models.layers import GLUMBConv, first_frame, rope_angles, zero_frame_halo
from sana2.models.sana import SanaMS


class PerFrameGLUMBConv(GLUMBConv):
    """The image FFN applied to each frame of a [B, f*h*w, D] token sequence on its own."""

    def forward(self, x: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        f, h, w = grid
        frames = rearrange(x, "b (f h w) d -> (b f) d h w", f=f, h=h, w=w)
        return rearrange(self.conv_forward(frames), "(b f) d h w -> b (f h w) d", f=f)


class GLUMBConvTemp(PerFrameGLUMBConv):
    """s = GLUMBConv on every frame; out = s + t_conv(s) along the frame axis."""

    def __init__(self, dim: int, mlp_ratio: float, t_kernel_size: int):
        super().__init__(dim, mlp_ratio)
        # the reference pads by (k // 2, 0) inside the conv; here the padding frames come from
        # `frame_halo`: zeros, or the neighbouring ranks' frames when a clip is split (context parallelism)
        self.t_conv = nn.Conv2d(dim, dim, (t_kernel_size, 1), bias=False)
        self.halo_frames = t_kernel_size // 2
        self.frame_halo = zero_frame_halo

    def forward(self, x: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        f, h, w = grid
        s = rearrange(super().forward(x, grid), "b (f hw) d -> b d f hw", f=f)
        return rearrange(s + self.t_conv(self.frame_halo(s, self.halo_frames)), "b d f hw -> b (f hw) d")


class SanaMSVideo(SanaMS):
    """The video DiT, built from its config (SanaVideoConfig: the image DiT's fields plus the video ones)."""

    spatial_dims = 3

    def __init__(self, config: SanaVideoConfig):
        self.t_kernel_size = config.t_kernel_size
        self.ffn_type = config.ffn_type
        # which frame of the clip the input starts at (> 0 for a rank's part of a split clip)
        self.first_frame = first_frame
        self.use_rope = config.use_pe and config.pos_embed_type == "wan_rope" and config.attn_type == "LiteLAReLURope"
        super().__init__(config)

    def make_attention(self, attn_type: str, qk_norm: bool) -> nn.Module:
        # both video attentions are linear attention; LiteLAReLURope adds the rotary embedding (rotary_angles)
        return super().make_attention("linear", qk_norm)

    def make_mlp(self, mlp_ratio: float) -> nn.Module:
        if self.ffn_type == "GLUMBConvTemp":
            return GLUMBConvTemp(self.hidden_size, mlp_ratio, self.t_kernel_size)
        return PerFrameGLUMBConv(self.hidden_size, mlp_ratio)

    def positional_embedding(self, grid, device):
        return None  # position enters through the rotary embedding only

    def rotary_angles(self, grid, device):
        if not self.use_rope:
            return None
        return rope_angles(self.linear_head_dim, grid, device, frame_offset=self.first_frame(grid[0]))

    def initial_pos_embed(self) -> torch.Tensor:
        return torch.zeros_like(self.pos_embed, device="cpu")

    def unpatchify(self, tokens, grid):
        (f, h, w), (p, q, r) = grid, self.patch_size
        return rearrange(tokens, "b (f h w) (p q r c) -> b c (f p) (h q) (w r)", f=f, h=h, w=w, p=p, q=q, r=r)
