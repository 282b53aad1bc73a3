"""Building blocks of the Sana DiT, one small module per item of docs/model.md.

Every module computes exactly the math written there; the attribute names are the reference's
state-dict names, so checkpoints move between Sana and sana2. Nothing here knows about parallelism.
"""

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


def layer_norm(x: torch.Tensor) -> torch.Tensor:
    """LayerNorm without affine parameters (eps 1e-6): the pre-norm of every block and the head."""
    return F.layer_norm(x, x.shape[-1:], eps=1e-6)


class RMSNorm(nn.Module):
    """w * x / rms(x), computed in fp32 and cast back (so bf16 training normalises exactly)."""

    def __init__(self, dim: int, eps: float, init_scale: float = 1.0):
        super().__init__()
        self.eps = eps
        self.init_scale = init_scale  # the value initialisation gives the weight
        self.weight = nn.Parameter(torch.full((dim,), init_scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed).to(x.dtype)


class TimestepEmbedder(nn.Module):
    """t -> [cos(t f), sin(t f)] with f_k = exp(-ln(10000) k / 128) -> Linear -> SiLU -> Linear."""

    frequency_dim = 256

    def __init__(self, hidden_size: int):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(self.frequency_dim, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size)
        )

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.frequency_dim // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t.float()[:, None] * freqs[None]
        embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        return self.mlp(embedding.to(self.mlp[0].weight.dtype))


class CaptionMlp(nn.Module):
    """fc1 -> GELU(tanh) -> fc2, the caption projection (reference key names fc1 / fc2)."""

    def __init__(self, in_features: int, hidden_size: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_size)
        self.fc2 = nn.Linear(hidden_size, hidden_size)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(y), approximate="tanh"))


class CaptionEmbedder(nn.Module):
    """Projects caption embeddings; the captions `drop_ids` marks are replaced by the null caption first.

    Which captions are dropped is decided by the objective (training.caption_dropout, sana2/components/flow.py),
    from seeded draws no world size changes; the model has no dropout of its own.
    """

    def __init__(self, caption_channels: int, hidden_size: int, model_max_length: int):
        super().__init__()
        self.y_proj = CaptionMlp(caption_channels, hidden_size)
        # The learned-free null caption: a buffer, saved in the state dict, never optimised.
        self.register_buffer("y_embedding", torch.zeros(model_max_length, caption_channels))

    def forward(self, caption: torch.Tensor, drop_ids: torch.Tensor | None = None) -> torch.Tensor:
        """caption: [B, 1, L, C]; drop_ids: [B] bool, which captions to replace by the null one."""
        if drop_ids is not None:
            null = self.y_embedding.to(caption.dtype)[None, None]
            caption = torch.where(drop_ids.view(-1, 1, 1, 1), null, caption)
        return self.y_proj(caption)


def whole_sequence_sums(*sums: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Sums over the tokens of an input that holds the whole sequence: already complete."""
    return sums


def zero_frame_halo(x: torch.Tensor, frames: int) -> torch.Tensor:
    """x [B, D, F, N] with `frames` zero frames on each side: a temporal convolution's padding."""
    return F.pad(x, (0, 0, frames, frames))


def first_frame(frames: int) -> int:
    """The index in the whole clip of an input's first frame, given its frame count: 0 (it is the clip)."""
    return 0


class LinearAttention(nn.Module):
    """ReLU linear attention over heads of `head_dim` channels, computed in fp32.

    out_i = sum_j v_j (phi k_j . phi q_i) / (sum_j phi k_j . phi q_i + 1e-8), phi = ReLU.
    With `rope`, q and k are rotated in the numerator only (the video model).
    """

    eps = 1e-8

    def __init__(self, dim: int, head_dim: int, qk_norm: bool):
        super().__init__()
        self.head_dim = head_dim
        # (sum phi(k) v^T, sum phi(k)) of this input's tokens -> the same sums over the whole sequence;
        # the identity unless the sequence is split (context parallelism installs its all-reduce here)
        self.sequence_sums = whole_sequence_sums
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        if qk_norm:
            self.q_norm = RMSNorm(dim, eps=1e-5)
            self.k_norm = RMSNorm(dim, eps=1e-5)
        self.qk_norm = qk_norm

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # fp32 attention: sums over thousands of tokens overflow / lose precision in bf16.
        q, k, v = (rearrange(t.float(), "b n (h d) -> b h n d", d=self.head_dim) for t in (q, k, v))
        q, k = F.relu(q), F.relu(k)
        k_sum = k.sum(dim=2)
        q_rotated, k_rotated = (apply_rope(q, rope), apply_rope(k, rope)) if rope is not None else (q, k)
        kv = torch.einsum("bhnd,bhne->bhde", k_rotated, v)
        # the only quantities that mix tokens: the sums over the whole sequence
        kv, k_sum = self.sequence_sums(kv, k_sum)
        denominator = torch.einsum("bhnd,bhd->bhn", q, k_sum)
        numerator = torch.einsum("bhnd,bhde->bhne", q_rotated, kv)
        out = numerator / (denominator[..., None] + self.eps)
        out = rearrange(out, "b h n d -> b n (h d)").to(x.dtype)
        return self.proj(out)


class SoftmaxAttention(nn.Module):
    """Multi-head softmax self-attention (attn_type "flash"), optional affine-LayerNorm qk_norm."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim)
        if qk_norm:
            self.q_norm = nn.LayerNorm(dim, eps=1e-5)
            self.k_norm = nn.LayerNorm(dim, eps=1e-5)
        self.qk_norm = qk_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=self.num_heads) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(rearrange(out, "b h n d -> b n (h d)"))


class CrossAttention(nn.Module):
    """Softmax attention from image tokens to caption tokens; padded caption tokens get -10000.

    `compute_in_fp32` is cross_attn_type "vanilla": the same math with q, k, v in fp32.
    """

    def __init__(self, dim: int, num_heads: int, cross_norm: bool, compute_in_fp32: bool):
        super().__init__()
        self.num_heads = num_heads
        self.compute_in_fp32 = compute_in_fp32
        self.q_linear = nn.Linear(dim, dim)
        self.kv_linear = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)
        if cross_norm:
            self.q_norm = RMSNorm(dim, eps=1e-6)
            self.k_norm = RMSNorm(dim, eps=1e-6)
        self.cross_norm = cross_norm

    def forward(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x: [B, N, D]; y: [B, L, D]; mask: [B, L], 1 = real token."""
        q = self.q_linear(x)
        k, v = self.kv_linear(y).chunk(2, dim=-1)
        if self.cross_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        compute_dtype = torch.float32 if self.compute_in_fp32 else q.dtype
        q, k, v = (rearrange(t.to(compute_dtype), "b n (h d) -> b h n d", h=self.num_heads) for t in (q, k, v))
        bias = ((1 - mask.to(compute_dtype)) * -10000.0)[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        out = rearrange(out, "b h n d -> b n (h d)").to(x.dtype)
        return self.proj(out)


class Conv(nn.Module):
    """A conv layer under the reference's `<name>.conv` key."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, groups: int = 1, bias: bool = True):
        super().__init__()
        self.conv = nn.Conv2d(
            in_channels, out_channels, kernel_size, padding=kernel_size // 2, groups=groups, bias=bias
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class GLUMBConv(nn.Module):
    """1x1 conv + SiLU -> 3x3 depthwise conv -> value * SiLU(gate) -> 1x1 conv, on the token grid."""

    def __init__(self, dim: int, mlp_ratio: float):
        super().__init__()
        hidden = int(mlp_ratio * dim)
        self.inverted_conv = Conv(dim, 2 * hidden, 1)
        self.depth_conv = Conv(2 * hidden, 2 * hidden, 3, groups=2 * hidden)
        self.point_conv = Conv(hidden, dim, 1, bias=False)

    def forward(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """x: [B, h*w, D] tokens of an h x w grid."""
        h, w = grid
        x = rearrange(x, "b (h w) d -> b d h w", h=h, w=w)
        return rearrange(self.conv_forward(x), "b d h w -> b (h w) d")

    def conv_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The FFN on a [B, D, h, w] feature map."""
        x = self.depth_conv(F.silu(self.inverted_conv(x)))
        value, gate = x.chunk(2, dim=1)
        return self.point_conv(value * F.silu(gate))


class FinalLayer(nn.Module):
    """LN -> modulate with (table + t) -> Linear to patch pixels (no SiLU, no zero init)."""

    def __init__(self, hidden_size: int, patch_pixels: int, out_channels: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, patch_pixels * out_channels)
        self.scale_shift_table = nn.Parameter(torch.zeros(2, hidden_size))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        shift, scale = (self.scale_shift_table[None] + t[:, None]).chunk(2, dim=1)
        return self.linear(modulate(layer_norm(x), shift, scale))


def sincos_encoding(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """[sin(pos w_k), cos(pos w_k)] for k < dim/2, w_k = 10000^(-k / (dim/2)), in float64."""
    half = dim // 2
    omega = 1.0 / 10000 ** (torch.arange(half, dtype=torch.float64) / half)
    args = positions.double().reshape(-1)[:, None] * omega[None]
    return torch.cat([torch.sin(args), torch.cos(args)], dim=1)


def sincos_pos_embed(dim: int, grid: tuple[int, int], base_size: int, pe_interpolation: float) -> torch.Tensor:
    """2-D sincos table [h*w, dim] (column code first), positions scaled to the base grid."""
    h, w = grid
    col = torch.arange(w, dtype=torch.float32) / (w / base_size) / pe_interpolation
    row = torch.arange(h, dtype=torch.float32) / (h / base_size) / pe_interpolation
    rows, cols = torch.meshgrid(row, col, indexing="ij")
    table = torch.cat([sincos_encoding(cols, dim // 2), sincos_encoding(rows, dim // 2)], dim=1)
    return table.float()


def rope_axis_dims(head_dim: int) -> tuple[int, int, int]:
    """Channel counts given to (frame, row, column) by the 3-D rotary embedding."""
    spatial = 2 * (head_dim // 6)
    return head_dim - 2 * spatial, spatial, spatial


def rope_angles(head_dim: int, grid: tuple[int, int, int], device=None, frame_offset: int = 0) -> torch.Tensor:
    """Rotation angles [f*h*w, head_dim/2] (float64): pair i of an axis turns by pos * 10000^(-2i/axis_dim).

    Frame positions start at `frame_offset` (a clip's later frames), row and column positions at 0.
    """
    per_axis = []
    for axis, (size, axis_dim) in enumerate(zip(grid, rope_axis_dims(head_dim))):
        inv_freq = 1.0 / 10000 ** (torch.arange(0, axis_dim, 2, dtype=torch.float64) / axis_dim)
        start = frame_offset if axis == 0 else 0
        angles = torch.arange(start, start + size, dtype=torch.float64)[:, None] * inv_freq[None]
        shape = [1, 1, 1, axis_dim // 2]
        shape[axis] = size
        per_axis.append(angles.view(shape).expand(*grid, axis_dim // 2))
    return torch.cat(per_axis, dim=-1).reshape(-1, head_dim // 2).to(device)


def apply_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (2i, 2i+1) of x [B, H, N, d] as complex numbers by e^{i angle} [N, d/2]."""
    pairs = torch.view_as_complex(rearrange(x.double(), "... (d two) -> ... d two", two=2).contiguous())
    rotated = pairs * torch.polar(torch.ones_like(angles), angles)
    return rearrange(torch.view_as_real(rotated), "... d two -> ... (d two)").to(x.dtype)
